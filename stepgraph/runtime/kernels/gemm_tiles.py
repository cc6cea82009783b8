"""Pieces the split-K GEMM kernels share: a split's K range and the store of one output tile
(the output itself, or a float32 partial that the tile's last split sums in split order)."""

from __future__ import annotations

import triton
import triton.language as tl

from stepgraph.runtime.kernels.sync import arrive, reset


@triton.jit
def store_tile(acc, offs_w, offs_r, w_rows, x_rows, pid_s, tile, out_ptr, ws_ptr, sem_ptr,
               R, N, stride_or, stride_on,
               SPLIT: tl.constexpr, FUSED: tl.constexpr, FENCE: tl.constexpr):
    """Write one output tile ``acc[w, r]`` (float32) of K split ``pid_s``: the output itself
    with one split; else its float32 partial ``[split, R, N]``, and with ``FUSED`` the
    tile's last split to finish (counter ``tile`` in ``sem_ptr``, left at zero again) sums
    the partials in split order and writes the output."""
    mask = w_rows[:, None] & x_rows[None, :]
    if SPLIT == 1:
        ptrs = out_ptr + offs_r[None, :] * stride_or + offs_w[:, None] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + (pid_s * R + offs_r[None, :]) * N + offs_w[:, None]
        tl.store(ws, acc, mask=mask)
        if FUSED:  # noqa: SIM102 (a constexpr test apart: Triton folds it at compile time)
            if arrive(sem_ptr + tile, offs_w, FENCE) == SPLIT - 1:  # the others are stored
                total = tl.zeros(acc.shape, dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    part = ws_ptr + (s * R + offs_r[None, :]) * N + offs_w[:, None]
                    total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                ptrs = out_ptr + offs_r[None, :] * stride_or + offs_w[:, None] * stride_on
                tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                reset(sem_ptr + tile)


@triton.jit
def k_range(pid_s, blocks_per_split, K, BLOCK: tl.constexpr):
    """The K range ``[k_lo, k_hi)`` of split ``pid_s`` (``k_lo`` a multiple of ``BLOCK``:
    aligned loads) and its number of ``BLOCK``-wide steps."""
    k_lo = pid_s * blocks_per_split * BLOCK
    k_hi = k_lo + blocks_per_split * BLOCK
    if k_hi > K:
        k_hi = K
    return k_lo, k_hi, tl.cdiv(k_hi - k_lo, BLOCK)


@triton.jit
def next_chunks(w0, w1, w2, w_new, DEPTH: tl.constexpr):
    """The weight chunks in flight once ``w0`` is multiplied and ``w_new`` (chunk ``i + DEPTH
    - 1``) issued, ``w0`` the next to multiply (``w1``, ``w2``: the later chunks in flight at
    ``DEPTH`` 3 and 4, else unused)."""
    if DEPTH == 2:
        w0 = w_new
    elif DEPTH == 3:
        w0 = w1
        w1 = w_new
    else:
        w0 = w1
        w1 = w2
        w2 = w_new
    return w0, w1, w2
