"""GEMMs with cuBLASLt's own epilogues: a Linear and its tanh-GELU in one GEMM, and the GELU's
derivative applied in the epilogue of the GEMM that produces its incoming gradient (as llm.c does).

    linear_gelu_aux(x, w, b) -> (g, h)   h = x wᵀ + b,  g = gelu_tanh(h)    epilogue GELU_AUX_BIAS
    linear_dgelu(dy, w, h)   -> dh       dh = (dy w) · gelu_tanh'(h)         epilogue DGELU

Why: on GPT-2 small's MLP (16384 tokens, 768 → 3072, bf16, H200; bench/gemm_epilogues.py) the
forward took 161 us against 175 for cuBLAS's addmm plus Inductor's GELU, and the backward 152 us
against 233 for cuBLAS's mm plus Inductor's GELU backward and bias sum (with the bias sum apart,
31 us). cuBLASLt's DGELU_BGRAD (the bias gradient in the epilogue too) took 452 us: not used.

cuBLASLt is called through ctypes on the library torch itself has loaded (no build step, no new
dependency), on the current stream, so the calls are captured by CUDA graphs; each shape's
descriptors and algorithm are chosen once. Both ops are ``torch.library`` custom ops with fake
implementations (torch.compile keeps them as calls); on the CPU, and for inputs cuBLASLt is not
given here, they compute the same function with PyTorch's ops (what the tests compare).
The enum values are cuBLASLt's C ABI (cublasLt.h, CUDA 12 and 13).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

# cublasLt.h ----------------------------------------------------------------------------------------------
DESC = {
    "TRANSA": 3,
    "TRANSB": 4,
    "EPILOGUE": 7,
    "BIAS_POINTER": 8,
    "EPILOGUE_AUX_POINTER": 11,
    "EPILOGUE_AUX_LD": 12,
    "BIAS_DATA_TYPE": 26,
}
EPILOGUE = {"DEFAULT": 1, "BIAS": 4, "GELU_AUX_BIAS": 164, "DGELU": 192, "DGELU_BGRAD": 208, "BGRADB": 512}
PREF_MAX_WORKSPACE_BYTES = 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
_DATA_TYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}
#: the dtypes given to cuBLASLt here (fp32 goes through PyTorch's own GEMMs, which follow its TF32 setting)
DTYPES = tuple(_DATA_TYPES)
_WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _loaded_path(stem: str) -> str | None:
    """The file of a shared library mapped into this process (Linux), e.g. the cuBLASLt torch uses."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith(stem + ".so"):
            return path
    return None


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The cuBLASLt library torch uses, or why there is none."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "no CUDA device (cuBLASLt is NVIDIA's)"
    path = _loaded_path("libcublasLt")
    if path is None:  # torch loads cuBLAS(Lt) with its first GEMM
        a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        a @ a  # noqa: B018 (no host sync: loading happens on the host)
        path = _loaded_path("libcublasLt") or ctypes.util.find_library("cublasLt")
    if path is None:
        return "libcublasLt is not loaded in this process and was not found"
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        return f"libcublasLt could not be opened ({exc})"


#: set by :func:`unavailable` once cuBLASLt was found: a plain global, so that code torch.compile
#: traces reads it as a constant (Dynamo cannot trace the search itself)
READY = False


def unavailable() -> str | None:
    """None when cuBLASLt's epilogues can be used here, else why not (found once per process)."""
    global READY
    lib = _library()
    READY = not isinstance(lib, str)
    return lib if isinstance(lib, str) else None


class Lt:
    """One cuBLASLt handle and workspace per device; a plan (descriptors, algorithm) per GEMM shape."""

    _lock = threading.Lock()
    _per_device: dict[int, Lt] = {}

    @classmethod
    def on(cls, device: torch.device) -> Lt:
        index = device.index if device.index is not None else torch.cuda.current_device()
        lt = cls._per_device.get(index)
        if lt is None:
            with cls._lock:
                lt = cls._per_device.get(index) or cls(index)
                cls._per_device[index] = lt
        return lt

    def __init__(self, index: int) -> None:
        lib = _library()
        if isinstance(lib, str):
            raise RuntimeError(f"cuBLASLt is not available: {lib}")
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
        self.plans: dict[tuple, tuple] = {}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt: {what} failed (cublasStatus_t {status})")

    def _set(self, desc: ctypes.c_void_p, attr: str, value: ctypes._SimpleCData) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, DESC[attr], ctypes.byref(value), ctypes.sizeof(value)), attr)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(
            self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(layout), ctypes.c_int(dtype), ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)
            ),
            "layout",
        )
        return layout

    def _plan(self, key: tuple) -> tuple:
        ta, tb, m, n, k, lda, ldb, ldd, epilogue, aux_ld, d_dtype, b_dtype, has_aux = key
        dtype, bias_dtype = _DATA_TYPES[d_dtype], None if b_dtype is None else _DATA_TYPES[b_dtype]
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor")
        self._set(desc, "TRANSA", ctypes.c_int32(OP_T if ta else OP_N))
        self._set(desc, "TRANSB", ctypes.c_int32(OP_T if tb else OP_N))
        self._set(desc, "EPILOGUE", ctypes.c_uint32(EPILOGUE[epilogue]))
        if bias_dtype is not None:
            self._set(desc, "BIAS_DATA_TYPE", ctypes.c_int32(bias_dtype))
            self._set(desc, "BIAS_POINTER", ctypes.c_void_p(self.workspace.data_ptr()))  # aligned stand-in for the search
        if has_aux:
            self._set(desc, "EPILOGUE_AUX_LD", ctypes.c_int64(aux_ld))
            self._set(desc, "EPILOGUE_AUX_POINTER", ctypes.c_void_p(self.workspace.data_ptr()))
        a = self._layout(dtype, k if ta else m, m if ta else k, lda)
        b = self._layout(dtype, n if tb else k, k if tb else n, ldb)
        d = self._layout(dtype, m, n, ldd)
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(_WORKSPACE_BYTES)
        self._check(
            self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size)
            ),
            "workspace preference",
        )
        found, count = (_Heuristic * 1)(), ctypes.c_int(0)
        self._check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, 1, found, ctypes.byref(count)),
            f"algorithm search ({epilogue}, {m}x{n}x{k})",
        )
        if count.value == 0:
            raise RuntimeError(f"cuBLASLt has no algorithm for epilogue {epilogue} at {m}x{n}x{k}")
        return desc, a, b, d, found[0]

    def gemm(
        self,
        a: Tensor,
        ta: bool,
        b: Tensor,
        tb: bool,
        d: Tensor,
        m: int,
        n: int,
        k: int,
        lda: int,
        ldb: int,
        ldd: int,
        epilogue: str = "DEFAULT",
        bias: Tensor | None = None,
        aux: Tensor | None = None,
        aux_ld: int = 0,
    ) -> None:
        """Column-major ``D (m×n) = op(A) (m×k) · op(B) (k×n)`` with an epilogue, on the current stream."""
        key = (ta, tb, m, n, k, lda, ldb, ldd, epilogue, aux_ld, d.dtype, None if bias is None else bias.dtype, aux is not None)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(key)
        desc, la, lb, ld_, found = plan
        if bias is not None:
            self._set(desc, "BIAS_POINTER", ctypes.c_void_p(bias.data_ptr()))
        if aux is not None:
            self._set(desc, "EPILOGUE_AUX_POINTER", ctypes.c_void_p(aux.data_ptr()))
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream(d.device).cuda_stream)
        self._check(
            self.lib.cublasLtMatmul(
                self.handle,
                desc,
                ctypes.byref(alpha),
                ctypes.c_void_p(a.data_ptr()),
                la,
                ctypes.c_void_p(b.data_ptr()),
                lb,
                ctypes.byref(beta),
                ctypes.c_void_p(d.data_ptr()),
                ld_,
                ctypes.c_void_p(d.data_ptr()),
                ld_,
                ctypes.byref(found.algo),
                ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(_WORKSPACE_BYTES),
                stream,
            ),
            f"matmul ({epilogue}, {m}x{n}x{k})",
        )


def takes(*tensors: Tensor) -> bool:
    """cuBLASLt is given these operands here: CUDA, one half dtype, contiguous, 16-byte aligned rows."""
    t0 = tensors[0]
    return (
        t0.is_cuda
        and t0.dtype in DTYPES
        and unavailable() is None
        and all(
            t.device == t0.device
            and t.dtype == t0.dtype
            and t.is_contiguous()
            and t.data_ptr() % 16 == 0
            and t.shape[-1] % 8 == 0
            for t in tensors
        )
    )


# row-major operations ------------------------------------------------------------------------------------


def _linear_gelu_aux_lt(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    (M, K), N = x.shape, w.shape[0]
    g, h = x.new_empty(M, N), x.new_empty(M, N)
    # column-major: gᵀ (N×M) = op(w) (N×K) · xᵀ (K×M); w is stored K×N (ld K), x K×M (ld K)
    Lt.on(x.device).gemm(w, True, x, False, g, N, M, K, K, K, N, "GELU_AUX_BIAS", bias=b, aux=h, aux_ld=N)
    return g, h


def _linear_dgelu_lt(dy: Tensor, w: Tensor, h: Tensor) -> Tensor:
    (M, N), K = dy.shape, w.shape[1]
    dh = dy.new_empty(M, K)
    # column-major: dhᵀ (K×M) = w (K×N, stored as such, ld K) · dyᵀ (N×M, ld N), then · gelu'(hᵀ)
    Lt.on(dy.device).gemm(w, False, dy, False, dh, K, M, N, K, N, K, "DGELU", aux=h, aux_ld=K)
    return dh


def _linear_gelu_aux_reference(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    h = F.linear(x, w, b)
    return F.gelu(h, approximate="tanh"), h


def _linear_dgelu_reference(dy: Tensor, w: Tensor, h: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(dy @ w, h, approximate="tanh")


@torch.library.custom_op("speedkit::linear_gelu_aux", mutates_args=())
def linear_gelu_aux(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(gelu_tanh(x wᵀ + b), x wᵀ + b)`` for x (M, K), w (N, K), b (N,): one GEMM on CUDA."""
    if takes(x, w, b):
        return _linear_gelu_aux_lt(x, w, b)
    return _linear_gelu_aux_reference(x, w, b)


@linear_gelu_aux.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("speedkit::linear_dgelu", mutates_args=())
def linear_dgelu(dy: Tensor, w: Tensor, h: Tensor) -> Tensor:
    """``(dy w) · gelu_tanh'(h)`` for dy (M, N), w (N, K), h (M, K): one GEMM on CUDA."""
    if takes(dy, w, h):
        return _linear_dgelu_lt(dy, w, h)
    return _linear_dgelu_reference(dy, w, h)


@linear_dgelu.register_fake
def _(dy, w, h):
    return dy.new_empty(dy.shape[0], w.shape[1])


# the MLP --------------------------------------------------------------------------------------------------


class _GeluMLP(torch.autograd.Function):
    """``linear(gelu_tanh(linear(x, w1, b1)), w2, b2)`` computed in ``dtype``: the first GEMM with its
    GELU (``linear_gelu_aux``), the GELU's derivative in the epilogue of the GEMM of ``dy · w2``
    (``linear_dgelu``); the other GEMMs and the bias sums are PyTorch's. Gradients come back in the
    dtypes of the inputs, as autocast's casts give them."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, dtype: torch.dtype) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
            w1c, b1c, w2c, b2c = (t.to(dtype) for t in (w1, b1, w2, b2))
            g, h = torch.ops.speedkit.linear_gelu_aux(x2, w1c, b1c)
            y = F.linear(g, w2c, b2c)
        ctx.save_for_backward(x2, w1c, w2c, g, h)
        ctx.in_shape, ctx.dtypes = x.shape, (x.dtype, w1.dtype, b1.dtype, w2.dtype, b2.dtype)
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, w1c, w2c, g, h = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(g.dtype).contiguous()
            dh = torch.ops.speedkit.linear_dgelu(dy2, w2c, h)
            dw2, db2 = dy2.t() @ g, dy2.sum(0)
            dx, dw1, db1 = dh @ w1c, dh.t() @ x2, dh.sum(0)
        x_dtype, w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        return (dx.view(ctx.in_shape).to(x_dtype), dw1.to(w1_dtype), db1.to(b1_dtype), dw2.to(w2_dtype), db2.to(b2_dtype), None)


def gelu_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)`` with the GELU and its
    derivative in cuBLASLt's GEMM epilogues, computed in ``dtype`` (default: x's); x (..., K),
    w1 (F, K), w2 (N, F)."""
    return _GeluMLP.apply(x, w1, b1, w2, b2, dtype or x.dtype)
