"""The Triton kernels of LayerNorm and RMSNorm (``IS_RMS`` picks one), launched from
:mod:`speedkit.kernels.norms`: the forward and the persistent backward for rows held in registers and
for wide rows walked in chunks, and the sum of the backward's dw/db partials."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    stride_x,
    stride_y,
    M,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows that fit in one block: BLOCK_M rows × BLOCK_N (>= N) columns per program."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _norm_fwd_looped_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    stride_x,
    stride_y,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One wide row per program: statistics in one pass, then y.

    Each lane keeps a running (count, mean, M2) over the elements it sees (Welford), and the lanes
    are merged at the end (Chan et al.), so the variance never subtracts two large sums.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols0 = tl.arange(0, BLOCK_N)
    cnt = tl.zeros([BLOCK_N], dtype=tl.float32)
    avg = tl.zeros([BLOCK_N], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if IS_RMS:
            m2 += x * x
        else:
            cnt += ok.to(tl.float32)
            delta = x - avg
            avg += tl.where(ok, delta / tl.maximum(cnt, 1.0), 0.0)
            m2 += tl.where(ok, delta * (x - avg), 0.0)
    if IS_RMS:
        mean = 0.0
        var = tl.sum(m2, axis=0) / N
    else:
        mean = tl.sum(cnt * avg, axis=0) / N
        var = (tl.sum(m2, axis=0) + tl.sum(cnt * (avg - mean) * (avg - mean), axis=0)) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd_kernel(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PART,
    DB_PART,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Persistent: program p takes row blocks p, p+P, …; dw/db partials stay in registers."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, nprog * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
            dw += tl.sum(dy * xhat, axis=0)
        else:
            g = dy
        if HAS_B:
            db += tl.sum(dy, axis=0)
        c1 = tl.sum(xhat * g, axis=1) / N
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / N
            dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * N + cols, db, mask=col_ok)


@triton.jit
def _norm_bwd_looped_kernel(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PART,
    DB_PART,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Persistent over wide rows: per row one pass for the two means, one for dx; the program's own
    row of the partial buffers accumulates dw/db (no other program touches it)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_N)
    part = pid.to(tl.int64) * N
    for row in range(pid, M, nprog):
        row64 = tl.cast(row, tl.int64)
        rstd = tl.load(RSTD + row64)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(MEAN + row64)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            ok = cols < N
            x = tl.load(X + row64 * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
            xhat = tl.where(ok, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_W:
                g = dy * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
            acc1 += xhat * g
            acc2 += g
        c1 = tl.sum(acc1, axis=0) / N
        c2 = tl.sum(acc2, axis=0) / N
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            ok = cols < N
            x = tl.load(X + row64 * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
            xhat = tl.where(ok, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_W:
                g = dy * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
                acc = tl.load(DW_PART + part + cols, mask=ok, other=0.0)
                tl.store(DW_PART + part + cols, acc + dy * xhat, mask=ok)
            if HAS_B:
                acc_b = tl.load(DB_PART + part + cols, mask=ok, other=0.0)
                tl.store(DB_PART + part + cols, acc_b + dy, mask=ok)
            if IS_RMS:
                dx = (g - xhat * c1) * rstd
            else:
                dx = (g - (xhat * c1 + c2)) * rstd
            tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)


@triton.jit
def _sum_partials_kernel(
    PART, DW, DB, P, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """dw = Σ_p part[0, p], db = Σ_p part[-1, p] for one column block, BLOCK_P partial rows at a
    time, written in the parameters' dtype: one launch for both, many programs (narrow blocks)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc_w = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    b_plane = tl.cast(P, tl.int64) * N if HAS_W else 0
    for p0 in range(0, P, BLOCK_P):
        prow = p0 + tl.arange(0, BLOCK_P)
        mask = (prow < P)[:, None] & ok[None, :]
        offs = prow.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_W:
            acc_w += tl.load(PART + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(PART + b_plane + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(DW + cols, tl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=ok)
    if HAS_B:
        tl.store(DB + cols, tl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=ok)
