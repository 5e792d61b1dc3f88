"""Do cuBLASLt's own GEMM epilogues pay on GPT-2's MLP? A diagnostic (prints, writes no rows).

The naive GPT-2 step spends ~2.2 ms of its 32.5 ms (H200) on the MLP's elementwise passes:
Inductor's GELU forward (reads h, writes g), its GELU backward and a second pass for the fc bias
gradient. cuBLASLt can do them in the GEMMs' epilogues, as llm.c does:
  forward   g = gelu(x W1^T + b1), h kept     one GEMM, epilogue GELU_AUX_BIAS
  backward  dh = (dy W2) * gelu'(h), db1      one GEMM, epilogue DGELU_BGRAD
  weights   dW2 = dy^T g with db2 = sum(dy)   one GEMM, epilogue BGRADB
Each is timed against what the compiled step runs now (cuBLAS through torch plus Inductor's
kernels for the rest), both captured in CUDA graphs (no host cost), CUDA events, median of
windows after warm-up; and checked against an fp32 reference.

cuBLASLt is called through ctypes on the library torch has loaded; the enum values are read from
the cublasLt.h next to it.

Usage: PYTHONPATH=. python bench/gemm_epilogues.py [--tokens 16384] [--width 768]   (GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1


def loaded_library(name: str) -> Path:
    """The path of a shared library this process has mapped (the one torch uses)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if name in line and ".so" in line:
            return Path(line.split()[-1])
    raise RuntimeError(f"{name} is not loaded in this process")


def header_enums(lib: Path) -> dict[str, int]:
    """NAME = value pairs of the cublasLt.h that ships with the library."""
    for cand in [lib.parent.parent / "include" / "cublasLt.h", *lib.parent.parent.rglob("cublasLt.h")]:
        if cand.exists():
            text = cand.read_text(errors="replace")
            values: dict[str, int] = {}
            for name, expr in re.findall(r"\b(CUBLASLT_\w+)\s*=\s*([^,;}\n]+)", text):
                terms = re.findall(r"\w+", expr.split("//")[0].split("/*")[0])
                if terms and "|" in expr and all(t in values or t.isdigit() for t in terms):  # NAME = (A | B | 128)
                    values[name] = 0
                    for t in terms:
                        values[name] |= int(t) if t.isdigit() else values[t]
                elif re.fullmatch(r"\s*\d+\s*", expr):
                    values[name] = int(expr)
            return values
    raise RuntimeError(f"no cublasLt.h near {lib}")


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class Lt:
    """Row-major GEMMs with epilogues on cuBLASLt; one plan (descriptors, algorithm) per shape."""

    def __init__(self) -> None:
        torch.cuda.init()
        torch.ones(4, 4, device="cuda") @ torch.ones(4, 4, device="cuda")  # loads cuBLAS/cuBLASLt
        path = loaded_library("libcublasLt")
        self.lib = ctypes.CDLL(str(path))
        self.e = header_enums(path)
        print(f"cuBLASLt: {path} ({len(self.e)} enum values from its header)")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        self.plans: dict = {}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def _set(self, desc, attr: str, value) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, self.e[attr], ctypes.byref(value), ctypes.sizeof(value)), attr)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        lay = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), ctypes.c_int(dtype), ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def gemm(self, a: torch.Tensor, ta: bool, b: torch.Tensor, tb: bool, d: torch.Tensor, m: int, n: int, k: int,
             lda: int, ldb: int, ldd: int, epilogue: str = "CUBLASLT_EPILOGUE_DEFAULT", bias: torch.Tensor | None = None,
             aux: torch.Tensor | None = None, aux_ld: int = 0) -> None:
        """Column-major D(m x n) = op(A)(m x k) op(B)(k x n) with an epilogue; bf16 in and out."""
        key = (ta, tb, m, n, k, lda, ldb, ldd, epilogue, bias is not None, None if bias is None else bias.dtype, aux_ld)
        plan = self.plans.get(key)
        if plan is None:
            desc = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
            self._set(desc, "CUBLASLT_MATMUL_DESC_TRANSA", ctypes.c_int32(OP_T if ta else OP_N))
            self._set(desc, "CUBLASLT_MATMUL_DESC_TRANSB", ctypes.c_int32(OP_T if tb else OP_N))
            self._set(desc, "CUBLASLT_MATMUL_DESC_EPILOGUE", ctypes.c_uint32(self.e[epilogue]))
            if bias is not None:
                self._set(desc, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE",
                          ctypes.c_int32(CUDA_R_32F if bias.dtype == torch.float32 else CUDA_R_16BF))
                self._set(desc, "CUBLASLT_MATMUL_DESC_BIAS_POINTER", ctypes.c_void_p(bias.data_ptr()))
            if aux is not None:
                self._set(desc, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD", ctypes.c_int64(aux_ld))
                self._set(desc, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", ctypes.c_void_p(aux.data_ptr()))
            la = self._layout(CUDA_R_16BF, k if ta else m, m if ta else k, lda)
            lb = self._layout(CUDA_R_16BF, n if tb else k, k if tb else n, ldb)
            ld_ = self._layout(CUDA_R_16BF, m, n, ldd)
            pref = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
            wsz = ctypes.c_uint64(self.ws.numel())
            self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, self.e["CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES"], ctypes.byref(wsz), ctypes.sizeof(wsz)), "pref ws")
            results = (Heuristic * 8)()
            count = ctypes.c_int(0)
            self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, ld_, ld_, pref, 8, results,
                                                                ctypes.byref(count)), f"heuristic {epilogue}")
            if count.value == 0:
                raise RuntimeError(f"no cuBLASLt algorithm for {epilogue} {m}x{n}x{k}")
            plan = self.plans[key] = (desc, la, lb, ld_, results[0])
        desc, la, lb, ld_, heur = plan
        if bias is not None:
            self._set(desc, "CUBLASLT_MATMUL_DESC_BIAS_POINTER", ctypes.c_void_p(bias.data_ptr()))
        if aux is not None:
            self._set(desc, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", ctypes.c_void_p(aux.data_ptr()))
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(a.data_ptr()), la, ctypes.c_void_p(b.data_ptr()), lb,
            ctypes.byref(beta), ctypes.c_void_p(d.data_ptr()), ld_, ctypes.c_void_p(d.data_ptr()), ld_,
            ctypes.byref(heur.algo), ctypes.c_void_p(self.ws.data_ptr()), ctypes.c_size_t(self.ws.numel()), stream),
            f"matmul {epilogue}")

    # row-major helpers -------------------------------------------------------------------------------------
    def linear_gelu_aux(self, x, w, b, g, h):
        """g = gelu_tanh(x w^T + b), h = x w^T + b; x (M,K), w (N,K), g and h (M,N)."""
        M, K = x.shape
        N = w.shape[0]
        self.gemm(w, True, x, False, g, N, M, K, K, K, N, "CUBLASLT_EPILOGUE_GELU_AUX_BIAS", bias=b, aux=h, aux_ld=N)

    def linear(self, x, w, b, y):
        M, K = x.shape
        N = w.shape[0]
        self.gemm(w, True, x, False, y, N, M, K, K, K, N, "CUBLASLT_EPILOGUE_BIAS", bias=b)

    def dgelu(self, dy, w, h, dh):
        """dh = (dy w) * gelu'(h); dy (M,N), w (N,K), h and dh (M,K)."""
        M, N = dy.shape
        K = w.shape[1]
        self.gemm(w, False, dy, False, dh, K, M, N, K, N, K, "CUBLASLT_EPILOGUE_DGELU", aux=h, aux_ld=K)

    def dgelu_bgrad(self, dy, w, h, dh, db):
        """dh = (dy w) * gelu'(h), db = sum_rows dh; dy (M,N), w (N,K), h and dh (M,K)."""
        M, N = dy.shape
        K = w.shape[1]
        self.gemm(w, False, dy, False, dh, K, M, N, K, N, K, "CUBLASLT_EPILOGUE_DGELU_BGRAD", bias=db, aux=h, aux_ld=K)

    def weight_grad_bgrad(self, dy, x, dw, db):
        """dw = dy^T x (N,K), db = sum_rows dy (N); dy (M,N), x (M,K)."""
        M, N = dy.shape
        K = x.shape[1]
        # column-major dw^T (K x N) = x^T (K x M) @ dy (M x N): A = x, stored K x M; B = dy, stored N x M, transposed
        self.gemm(x, False, dy, True, dw, K, N, M, K, N, K, "CUBLASLT_EPILOGUE_BGRADB", bias=db)


def timed(fn, windows: int = 15, reps: int = 10) -> float:
    """Median ms per call of a CUDA graph holding `reps` calls of fn, over windows after warm-up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=768)
    args = ap.parse_args()
    M, C = args.tokens, args.width
    Fh = 4 * C
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, C, **bf)
    w1 = (torch.randn(Fh, C, **bf) * C ** -0.5)
    b1 = torch.randn(Fh, **bf) * 0.1
    w2 = (torch.randn(C, Fh, **bf) * Fh ** -0.5)
    dy = torch.randn(M, C, **bf) * 1e-2
    lt = Lt()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; tokens {M}, width {C}")

    gelu_c = torch.compile(lambda h: F.gelu(h, approximate="tanh"))

    def gelu_bwd_and_bias(dg, h):
        dh = torch.ops.aten.gelu_backward(dg, h, approximate="tanh")
        return dh, dh.sum(0)
    gelu_bwd_c = torch.compile(gelu_bwd_and_bias)
    sum_c = torch.compile(lambda t: t.sum(0))

    # forward: addmm + Inductor's GELU against GELU_AUX_BIAS
    h_ref = torch.addmm(b1, x, w1.t())
    g_ref = gelu_c(h_ref)
    g, h = torch.empty(M, Fh, **bf), torch.empty(M, Fh, **bf)
    lt.linear_gelu_aux(x, w1, b1, g, h)
    torch.cuda.synchronize()
    hf = x.float() @ w1.float().t() + b1.float()
    gf = F.gelu(hf, approximate="tanh")
    print(f"check fwd: h rel {rel(h, hf):.2e} (torch {rel(h_ref, hf):.2e}), g rel {rel(g, gf):.2e} (torch {rel(g_ref, gf):.2e})")

    # backward through the GELU: mm + Inductor's gelu backward and bias sum against DGELU_BGRAD
    dg_ref = dy @ w2
    dh_ref, db1_ref = gelu_bwd_c(dg_ref, h_ref)
    dh, db1 = torch.empty(M, Fh, **bf), torch.empty(Fh, **bf)
    lt.dgelu_bgrad(dy, w2, h_ref, dh, db1)
    torch.cuda.synchronize()
    dhf = torch.ops.aten.gelu_backward(dy.float() @ w2.float(), h_ref.float(), approximate="tanh")
    print(f"check dgelu: dh rel {rel(dh, dhf):.2e} (torch {rel(dh_ref, dhf):.2e}), "
          f"db1 rel {rel(db1, dhf.sum(0)):.2e} (torch {rel(db1_ref, dhf.sum(0)):.2e})")

    # weight gradient with the bias gradient: mm + sum against BGRADB
    dw2, db2 = torch.empty(C, Fh, **bf), torch.empty(C, **bf)
    lt.weight_grad_bgrad(dy, g_ref, dw2, db2)
    torch.cuda.synchronize()
    dw2f = dy.float().t() @ g_ref.float()
    lt.dgelu(dy, w2, h_ref, dh)
    torch.cuda.synchronize()
    print(f"check dgelu alone: dh rel {rel(dh, dhf):.2e}")
    print(f"check bgradb: dW2 rel {rel(dw2, dw2f):.2e} (torch {rel(dy.t() @ g_ref, dw2f):.2e}), "
          f"db2 rel {rel(db2, dy.float().sum(0)):.2e}")

    out_h = torch.empty(M, Fh, **bf)
    rows = []

    def base_fwd():
        torch.addmm(b1, x, w1.t(), out=out_h)
        gelu_c(out_h)
    rows.append(("fc fwd: addmm + GELU (Inductor)", timed(base_fwd)))
    rows.append(("fc fwd: addmm alone", timed(lambda: torch.addmm(b1, x, w1.t(), out=out_h))))
    rows.append(("fc fwd: cuBLASLt GELU_AUX_BIAS", timed(lambda: lt.linear_gelu_aux(x, w1, b1, g, h))))
    rows.append(("fc fwd: cuBLASLt BIAS", timed(lambda: lt.linear(x, w1, b1, out_h))))

    dg_buf = torch.empty(M, Fh, **bf)

    def base_bwd():
        torch.mm(dy, w2, out=dg_buf)
        gelu_bwd_c(dg_buf, h_ref)
    rows.append(("proj dX + dGELU + db1: mm + Inductor", timed(base_bwd)))
    rows.append(("proj dX: mm alone", timed(lambda: torch.mm(dy, w2, out=dg_buf))))
    rows.append(("proj dX + dGELU + db1: cuBLASLt DGELU_BGRAD", timed(lambda: lt.dgelu_bgrad(dy, w2, h_ref, dh, db1))))
    rows.append(("proj dX + dGELU: cuBLASLt DGELU", timed(lambda: lt.dgelu(dy, w2, h_ref, dh))))

    def lt_dgelu_sum():
        lt.dgelu(dy, w2, h_ref, dh)
        sum_c(dh)
    rows.append(("proj dX + dGELU + db1: cuBLASLt DGELU + sum (Inductor)", timed(lt_dgelu_sum)))
    rows.append(("db1 alone: sum (Inductor)", timed(lambda: sum_c(dh))))
    rows.append(("dGELU + db1 alone (Inductor)", timed(lambda: gelu_bwd_c(dg_buf, h_ref))))
    rows.append(("GELU fwd alone (Inductor)", timed(lambda: gelu_c(out_h))))

    dw_buf = torch.empty(C, Fh, **bf)

    def base_wgrad():
        torch.mm(dy.t(), g_ref, out=dw_buf)
        sum_c(dy)
    rows.append(("proj dW + db2: mm + sum", timed(base_wgrad)))
    rows.append(("proj dW: mm alone", timed(lambda: torch.mm(dy.t(), g_ref, out=dw_buf))))
    rows.append(("proj dW + db2: cuBLASLt BGRADB", timed(lambda: lt.weight_grad_bgrad(dy, g_ref, dw2, db2))))
    for name, ms in rows:
        print(f"  {ms * 1000:8.1f} us  {name}")


if __name__ == "__main__":
    main()
