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

cuBLASLt is called through speedkit's wrapper (ctypes on the library torch has loaded).

H200, torch 2.11 (cu130), 16384 x 768 -> 3072, bf16, per call (b9a97b4; again at 8dfde7a on
speedkit's wrapper: the same within 5%, GELU_AUX_BIAS then 168.8 against 173.9):
  fc forward     addmm + Inductor's GELU 175.4 us (addmm alone 114.7, GELU alone 62.1);
                 GELU_AUX_BIAS 161.4 (BIAS alone 121.9)
  proj dX        mm + Inductor's GELU backward and bias sum 232.6 (mm 114.6, the two kernels 111.7);
                 DGELU 152.1, DGELU + Inductor's bias sum 186.8 (the sum 31.5); DGELU_BGRAD 451.7
  proj dW        mm + sum 123.7 (mm 111.2); BGRADB 128.8
so speedkit uses GELU_AUX_BIAS and DGELU, not DGELU_BGRAD or BGRADB. Errors against fp32 matched
PyTorch's (h 1.66e-3 both; g 1.66e-3 against 2.60e-3; dh 2.35e-3 both).

Usage: PYTHONPATH=. python bench/gemm_epilogues.py [--tokens 16384] [--width 768]   (GPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import measure_graphed, rel_err  # noqa: E402
from speedkit.kernels.cublaslt import Lt  # noqa: E402

DEV = torch.device("cuda")


class RowMajor:
    """The MLP's GEMMs, row-major, on speedkit's cuBLASLt wrapper (speedkit/kernels/cublaslt.py)."""

    def __init__(self) -> None:
        self.lt = Lt.on(torch.device("cuda"))

    def linear_gelu_aux(self, x, w, b, g, h):
        """g = gelu_tanh(x w^T + b), h = x w^T + b; x (M,K), w (N,K), g and h (M,N)."""
        (M, K), N = x.shape, w.shape[0]
        self.lt.gemm(w, True, x, False, g, N, M, K, K, K, N, "GELU_AUX_BIAS", bias=b, aux=h, aux_ld=N)

    def linear(self, x, w, b, y):
        (M, K), N = x.shape, w.shape[0]
        self.lt.gemm(w, True, x, False, y, N, M, K, K, K, N, "BIAS", bias=b)

    def dgelu(self, dy, w, h, dh, db=None):
        """dh = (dy w) * gelu'(h); dy (M,N), w (N,K), h and dh (M,K); with db, also db = sum over rows of
        dh in the epilogue (DGELU_BGRAD; bf16 only: cuBLASLt refuses an fp32 db here)."""
        (M, N), K = dy.shape, w.shape[1]
        self.lt.gemm(
            w, False, dy, False, dh, K, M, N, K, N, K, "DGELU" if db is None else "DGELU_BGRAD", bias=db, aux=h, aux_ld=K
        )

    def weight_grad_bgrad(self, dy, x, dw, db):
        """dw = dy^T x (N,K), db = sum over rows of dy (N); dy (M,N), x (M,K)."""
        (M, N), K = dy.shape, x.shape[1]
        # column-major dw^T (K x N) = x^T (K x M) @ dy (M x N): A = x, stored K x M; B = dy, stored N x M, transposed
        self.lt.gemm(x, False, dy, True, dw, K, N, M, K, N, K, "BGRADB", bias=db)


def timed(fn) -> float:
    """Median us per call: 10 calls captured in one CUDA graph, replayed on the step clock (bench.kernels)."""
    return measure_graphed(fn, DEV, sets=10, warmup=3, steps=10, repeats=15)[0] * 1000


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
    w1 = torch.randn(Fh, C, **bf) * C**-0.5
    b1 = torch.randn(Fh, **bf) * 0.1
    w2 = torch.randn(C, Fh, **bf) * Fh**-0.5
    dy = torch.randn(M, C, **bf) * 1e-2
    lt = RowMajor()
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
    print(
        f"check fwd: h rel {rel_err(h, hf):.2e} (torch {rel_err(h_ref, hf):.2e}), g rel {rel_err(g, gf):.2e} (torch {rel_err(g_ref, gf):.2e})"
    )

    # backward through the GELU: mm + Inductor's gelu backward and bias sum against DGELU_BGRAD
    dg_ref = dy @ w2
    dh_ref, db1_ref = gelu_bwd_c(dg_ref, h_ref)
    dh, db1 = torch.empty(M, Fh, **bf), torch.empty(Fh, **bf)
    lt.dgelu(dy, w2, h_ref, dh, db1)
    torch.cuda.synchronize()
    dhf = torch.ops.aten.gelu_backward(dy.float() @ w2.float(), h_ref.float(), approximate="tanh")
    print(
        f"check dgelu: dh rel {rel_err(dh, dhf):.2e} (torch {rel_err(dh_ref, dhf):.2e}), "
        f"db1 rel {rel_err(db1, dhf.sum(0)):.2e} (torch {rel_err(db1_ref, dhf.sum(0)):.2e})"
    )

    # weight gradient with the bias gradient: mm + sum against BGRADB
    dw2, db2 = torch.empty(C, Fh, **bf), torch.empty(C, **bf)
    lt.weight_grad_bgrad(dy, g_ref, dw2, db2)
    torch.cuda.synchronize()
    dw2f = dy.float().t() @ g_ref.float()
    lt.dgelu(dy, w2, h_ref, dh)
    torch.cuda.synchronize()
    print(f"check dgelu alone: dh rel {rel_err(dh, dhf):.2e}")
    print(
        f"check bgradb: dW2 rel {rel_err(dw2, dw2f):.2e} (torch {rel_err(dy.t() @ g_ref, dw2f):.2e}), "
        f"db2 rel {rel_err(db2, dy.float().sum(0)):.2e}"
    )

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
    rows.append(("proj dX + dGELU + db1: cuBLASLt DGELU_BGRAD", timed(lambda: lt.dgelu(dy, w2, h_ref, dh, db1))))
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
    for name, us in rows:
        print(f"  {us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
