"""The GEMV form over a few batch rows: ``out[R, N] = x[R, K] @ w[N, K].T`` for 2 or 4 rows a
program, each weight chunk loaded from HBM once and multiplied by every row of the program.

One program per (tile of ``BLOCK_W`` weight rows, K split, group of ``ROWS`` batch rows).
A weight chunk is loaded as ``[CHUNK_K / VEC, BLOCK_W, VEC]``: ``VEC`` = 8 BF16 values (one
thread's 16-byte load) in the last dimension, a warp's lanes along the first (512
contiguous bytes of one weight row a warp load). Each row's products with the chunk are
summed over the last dimension at once, inside each thread (no shuffles), so a row's
float32 accumulator is ``[CHUNK_K / VEC, BLOCK_W]``, an eighth of the chunk: the one-row
form's whole-chunk accumulator (``splitk_gemm._gemv_kernel``) times the rows would not fit
the registers beside the chunks in flight. The reduction across threads runs once, at the
end. The PDL discipline, the K splits, the input norm and the expert-slot sum are the
one-row form's: the first ``DEPTH - 1`` chunks load before ``gdc_wait()``, dependents launch
right after it; ``SPLIT`` > 1 writes float32 partials that the tile's last program sums in
split order (``FUSED``) or a reduction launch does. Every row's sums run in the same order
whichever group it is in, so a row's output does not depend on ``ROWS``. (At one row this
form measured slower than ``_gemv_kernel`` in the step: docs/perf.md, twenty-fourth
session.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from stepgraph.runtime.kernels.gemm_tiles import k_range, next_chunks, store_tile

VEC = tl.constexpr(8)  # BF16 values of one 16-byte load


@triton.jit
def _weight_chunk3(w_base, i, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K: tl.constexpr):
    """Chunk ``i`` of the program's weights as ``[CHUNK_K / VEC, BLOCK_W, VEC]``; zeros (and
    no traffic) past ``k_hi``."""
    kk = k_lo + i * CHUNK_K + offs_k
    return tl.load(w_base + kk[:, None, :] * stride_wk,
                   mask=w_rows[None, :, None] & (kk < k_hi)[:, None, :], other=0.0)


@triton.jit
def _row_chunk(x_base, r, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS: tl.constexpr,
               ROUND_BF16: tl.constexpr):
    """Row ``r``'s chunk ``[CHUNK_K / VEC, VEC]`` (zeros past R or ``k_hi``); with ``SLOTS``
    > 0 the sum of its float32 expert slots in slot order, rounded to BF16 with
    ``ROUND_BF16``."""
    mask = (kx < k_hi) & (r < R)
    base = x_base + r * stride_xr
    x = tl.load(base + kx * stride_xk, mask=mask, other=0.0)
    if SLOTS > 0:
        for j in tl.static_range(1, SLOTS):
            x += tl.load(base + j * stride_xj + kx * stride_xk, mask=mask, other=0.0)
        if ROUND_BF16:
            x = x.to(tl.bfloat16)
    return x


@triton.jit
def _row_products(acc, squares, w, x, g, NORM: tl.constexpr):
    """One row's step over a chunk: ``acc += sum over VEC of w * x`` (with ``NORM``, x
    scaled by g's chunk and its squares summed into ``squares``)."""
    xf = x.to(tl.float32)
    if NORM:
        squares += tl.sum(xf * xf, axis=1)
        xf = xf * g
    acc += tl.sum(w * xf[:, None, :], axis=2)
    return acc, squares


@triton.jit
def gemv_rows_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, sem_ptr,
                     R, N, K, chunks_per_split,
                     stride_xr, stride_xk, stride_wn, stride_wk, stride_or, stride_on,
                     g_ptr, eps, stride_xj,
                     ROWS: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK_K: tl.constexpr,
                     DEPTH: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                     FENCE: tl.constexpr, USE_PDL: tl.constexpr, NORM: tl.constexpr,
                     SLOTS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Partial (or whole) ``x[rows] @ w.T`` of one weight tile, K split and group of
    ``ROWS`` (1, 2 or 4) rows (module docstring). ``DEPTH`` (2..4) chunks in flight, the first
    ``DEPTH - 1`` loaded before the PDL wait. ``NORM`` (one split): each row RMS-normalized
    with weight ``g`` on the way (its chunks scaled by g's, its squares summed; the dot
    products scaled by ``rsqrt(mean square + eps)`` at the end). ``SLOTS`` > 0: each row is
    the sum of that many routed-expert slots ``stride_xj`` apart."""
    pid_w = tl.program_id(0)
    pid_s = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, CHUNK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    # Triton's coalescing orders a load's dimensions by their contiguity, and the column
    # groups (VEC apart) tie with the weight rows: without this hint a warp's lanes spread
    # over rows, 16 bytes from each of 16-32 rows, instead of 512 contiguous bytes of one.
    # The hint (2, under the VEC of the vector dimension) only orders the dimensions: the
    # loads stay VEC wide (tests/test_kernels_dense.py checks the layout on sm_90).
    offs_k = tl.max_contiguous(offs_k, [2, VEC])
    k_lo, k_hi, chunks = k_range(pid_s, chunks_per_split, K, CHUNK_K)
    w_rows = offs_w < N
    w_base = w_ptr + offs_w[None, :, None] * stride_wn

    w0 = _weight_chunk3(w_base, 0, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    w1 = w0  # w1, w2: the later chunks in flight at DEPTH 3 and 4 (else unused)
    w2 = w0
    if DEPTH >= 3:
        w1 = _weight_chunk3(w_base, 1, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    if DEPTH >= 4:
        w2 = _weight_chunk3(w_base, 2, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    kx = k_lo + offs_k
    xa = _row_chunk(x_ptr, r0, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS, ROUND_BF16)
    acc_a = tl.zeros([CHUNK_K // VEC, BLOCK_W], dtype=tl.float32)
    sq_a = tl.zeros([CHUNK_K // VEC], dtype=tl.float32)
    if ROWS >= 2:
        xb = _row_chunk(x_ptr, r0 + 1, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS,
                        ROUND_BF16)
        acc_b = tl.zeros([CHUNK_K // VEC, BLOCK_W], dtype=tl.float32)
        sq_b = tl.zeros([CHUNK_K // VEC], dtype=tl.float32)
    if ROWS == 4:
        xc = _row_chunk(x_ptr, r0 + 2, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS,
                        ROUND_BF16)
        xd = _row_chunk(x_ptr, r0 + 3, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS,
                        ROUND_BF16)
        acc_c = tl.zeros([CHUNK_K // VEC, BLOCK_W], dtype=tl.float32)
        acc_d = tl.zeros([CHUNK_K // VEC, BLOCK_W], dtype=tl.float32)
        sq_c = tl.zeros([CHUNK_K // VEC], dtype=tl.float32)
        sq_d = tl.zeros([CHUNK_K // VEC], dtype=tl.float32)
    g = tl.zeros([CHUNK_K // VEC, VEC], dtype=tl.float32)
    if NORM:
        g = tl.load(g_ptr + kx, mask=kx < k_hi, other=0.0).to(tl.float32)
    for i in range(0, chunks):
        w_new = _weight_chunk3(w_base, i + DEPTH - 1, k_lo, k_hi, offs_k, w_rows, stride_wk,
                               CHUNK_K)
        kx = k_lo + (i + 1) * CHUNK_K + offs_k
        xa_new = _row_chunk(x_ptr, r0, kx, k_hi, R, stride_xr, stride_xk, stride_xj, SLOTS,
                            ROUND_BF16)
        if ROWS >= 2:
            xb_new = _row_chunk(x_ptr, r0 + 1, kx, k_hi, R, stride_xr, stride_xk, stride_xj,
                                SLOTS, ROUND_BF16)
        if ROWS == 4:
            xc_new = _row_chunk(x_ptr, r0 + 2, kx, k_hi, R, stride_xr, stride_xk, stride_xj,
                                SLOTS, ROUND_BF16)
            xd_new = _row_chunk(x_ptr, r0 + 3, kx, k_hi, R, stride_xr, stride_xk, stride_xj,
                                SLOTS, ROUND_BF16)
        if NORM:
            g_new = tl.load(g_ptr + kx, mask=kx < k_hi, other=0.0).to(tl.float32)
        wf = w0.to(tl.float32)
        acc_a, sq_a = _row_products(acc_a, sq_a, wf, xa, g, NORM)
        xa = xa_new
        if ROWS >= 2:
            acc_b, sq_b = _row_products(acc_b, sq_b, wf, xb, g, NORM)
            xb = xb_new
        if ROWS == 4:
            acc_c, sq_c = _row_products(acc_c, sq_c, wf, xc, g, NORM)
            acc_d, sq_d = _row_products(acc_d, sq_d, wf, xd, g, NORM)
            xc = xc_new
            xd = xd_new
        if NORM:
            g = g_new
        w0, w1, w2 = next_chunks(w0, w1, w2, w_new, DEPTH)
    offs_r = r0 + tl.arange(0, ROWS)
    which = tl.arange(0, ROWS)[None, :]
    part = tl.where(which == 0, tl.sum(acc_a, axis=0)[:, None], 0.0)
    if NORM:
        scale = tl.where(which == 0, tl.rsqrt(tl.sum(sq_a, axis=0) / K + eps), 0.0)
    if ROWS >= 2:
        part += tl.where(which == 1, tl.sum(acc_b, axis=0)[:, None], 0.0)
        if NORM:
            scale += tl.where(which == 1, tl.rsqrt(tl.sum(sq_b, axis=0) / K + eps), 0.0)
    if ROWS == 4:
        part += tl.where(which == 2, tl.sum(acc_c, axis=0)[:, None], 0.0)
        part += tl.where(which == 3, tl.sum(acc_d, axis=0)[:, None], 0.0)
        if NORM:
            scale += tl.where(which == 2, tl.rsqrt(tl.sum(sq_c, axis=0) / K + eps), 0.0)
            scale += tl.where(which == 3, tl.rsqrt(tl.sum(sq_d, axis=0) / K + eps), 0.0)
    if NORM:
        part = part * scale
    store_tile(part, offs_w, offs_r, w_rows, offs_r < R, pid_s,
               tl.program_id(2) * tl.num_programs(0) + pid_w, out_ptr, ws_ptr, sem_ptr, R, N,
               stride_or, stride_on, SPLIT, FUSED, FENCE)
