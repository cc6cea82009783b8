"""Triton kernels of the small fused ops: the token embedding (a program per row and column
block), RMSNorm (one program a row), the residual add (a program per row and column
block), the AttnRes mix (two launches spread over rows x sources, then rows x column
blocks), and the fuse pass's prefix-sum + mix + RMSNorm (one launch, one program a row);
float32 math, written in the output's dtype through its row stride. Kernels load their
weights before ``gdc_wait()`` where they can and let their dependents launch right after
it (PDL)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.launch_utils import next_pow2, pdl_allowed, scratch
from stepgraph.runtime.kernels.sums import sums3
from stepgraph.runtime.kernels.sync import await_signal

MAX_ROW = 32768  # the widest row one program holds (RMSNorm, AttnRes)
ADD_BLOCK = 1024
EMBED_BLOCK = 1024
MIX_BLOCK = 2048  # columns a mix program covers (logits: per loop step)
MAX_SOURCES = 64
FUSED_CHUNK = 2048  # the most columns a sweep of the fused mix + norm covers at a time
FUSED_TILE = 8192  # sources x columns of its accumulator tiles (32 registers a thread)
FUSED_WARPS = 8
FUSED_STAGES = 3  # chunks of the sweeps' loads in flight (Triton's loop pipelining)
ROW_TILE = 32768  # sources x columns the one-tile fused kernel holds (64 registers a thread)
ROW_WARPS = 16  # 8: k3-rank-tp8 B=1 1514.0-1515.6 us against 1505.2-1508.8 (eleventh session)
ROW_REGS = 128  # registers a thread may use: 16 warps fit one SM (ptxas alone chose 64 and spilled)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _embed_kernel(tok_ptr, table_ptr, out_ptr, H, V, stride_tv, stride_or,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """out[r, block] = table[tokens[r], block]; a token outside 0..V-1 gives zeros.
    ``TRIGGER``: let the dependents launch at once, also when this launch itself is not a
    PDL launch (the step's first launch, after the host's input copy), so that the next
    launch streams its weights while this one gathers."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.load(tok_ptr + row).to(tl.int64)
    known = (token >= 0) & (token < V)
    values = tl.load(table_ptr + token * stride_tv + offs, mask=mask & known, other=0.0)
    tl.store(out_ptr + row * stride_or + offs, values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, stride_xr, stride_or, eps,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, in float32."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_xr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(out_ptr + row * stride_or + offs, (x * scale * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _add_kernel(srcs, strides, out_ptr, H, stride_or, N_SRC: tl.constexpr,
                BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[r, block] = sum_i srcs[i][r, block], in float32."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N_SRC):
        acc += tl.load(srcs[i] + row * strides[i] + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_or + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_logits_kernel(srcs, strides, q_ptr, n_ptr, logits_ptr, H, eps,
                       N_SRC: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """AttnRes logits: program (row, i) writes rsqrt(mean(v_i^2) + eps) * sum(v_i * norm *
    query) of source i's row to logits[row, i] (float32)."""
    row = tl.program_id(0)
    src = tl.program_id(1)
    offs0 = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for i in tl.static_range(N_SRC):
        if src == i:
            dot = tl.zeros([BLOCK], dtype=tl.float32)
            square = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, H, BLOCK):
                offs = start + offs0
                mask = offs < H
                nq = (tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                      * tl.load(n_ptr + offs, mask=mask, other=0.0).to(tl.float32))
                v = tl.load(srcs[i] + row * strides[i] + offs, mask=mask, other=0.0)
                v = v.to(tl.float32)
                dot += v * nq
                square += v * v
            logit = tl.sum(dot, 0) * tl.rsqrt(tl.sum(square, 0) / H + eps)
            tl.store(logits_ptr + row * S_PAD + i, logit)


@triton.jit
def _mix_sum_kernel(srcs, strides, logits_ptr, out_ptr, H, stride_or,
                    N_SRC: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """AttnRes output: out[row, block] = sum_i softmax(logits[row])_i v_i[row, block]."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    idx = tl.arange(0, S_PAD)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    logits = tl.load(logits_ptr + row * S_PAD + idx, mask=idx < N_SRC, other=float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N_SRC):
        v = tl.load(srcs[i] + row * strides[i] + offs, mask=mask, other=0.0)
        acc += tl.sum(tl.where(idx == i, p, 0.0), 0) * v.to(tl.float32)
    tl.store(out_ptr + row * stride_or + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefix_sum(srcs, strides, deltas, delta_strides, prefix_ptr, row, stride_pr, offs, mask,
                N_SRC: tl.constexpr, N_DELTA: tl.constexpr):
    """Columns ``offs`` of the row's last source plus its deltas, in float32: with deltas the
    sum is stored to ``prefix`` in its dtype and returned as stored; else the last source."""
    last = tl.load(srcs[N_SRC - 1] + row * strides[N_SRC - 1] + offs, mask=mask,
                   other=0.0).to(tl.float32)
    return _add_deltas(last, deltas, delta_strides, prefix_ptr, row, stride_pr, offs, mask,
                       N_DELTA)


@triton.jit
def _add_deltas(last, deltas, delta_strides, prefix_ptr, row, stride_pr, offs, mask,
                N_DELTA: tl.constexpr):
    """``last`` (float32) plus the row's deltas at columns ``offs``: with deltas the sum is
    stored to ``prefix`` in its dtype and returned as stored; else ``last``."""
    if N_DELTA > 0:
        for j in tl.static_range(N_DELTA):
            d = tl.load(deltas[j] + row * delta_strides[j] + offs, mask=mask, other=0.0)
            last += d.to(tl.float32)
        stored = last.to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_ptr + row * stride_pr + offs, stored, mask=mask)
        last = stored.to(tl.float32)
    return last


@triton.jit
def _mix_norm_kernel(srcs, strides, deltas, delta_strides, q_ptr, n_ptr, w_ptr, out_ptr,
                     prefix_ptr, probs_ptr, H, stride_or, stride_pr, eps, norm_eps, flag_ptr,
                     N_SRC: tl.constexpr, N_DELTA: tl.constexpr, S_PAD: tl.constexpr,
                     CHUNK: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr,
                     WAIT: tl.constexpr):
    """One row of the fused AttnRes step, in three sweeps over column chunks of the row:
    (1) prefix = srcs[-1] + sum(deltas), stored, and every source's query dot and square
    sum, accumulated per column in an [S_PAD, CHUNK] tile and reduced once; the softmax
    weights go to ``probs`` (a per-row scratch) so that (2) reads each as a scalar instead
    of reducing again; (2) the weighted sum, stored in the output's dtype (where the unfused
    mix stored it) with its square sum; (3) RMSNorm of the stored mix with ``w``. CTA
    barriers make the stored prefix, weights and mix visible to the threads rereading
    them. ``WAIT``: as :func:`_mix_norm_row_kernel`."""
    row = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    idx = tl.arange(0, S_PAD)
    sel = idx[:, None]
    if WAIT:
        await_signal(flag_ptr, tl.num_programs(0))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dot2 = tl.zeros([S_PAD, CHUNK], dtype=tl.float32)
    square2 = tl.zeros([S_PAD, CHUNK], dtype=tl.float32)
    for start in tl.range(0, H, CHUNK, num_stages=STAGES):
        # rows as [1, CHUNK] tiles: they broadcast into the accumulators' layout for free
        offs = start + cols[None, :]
        mask = offs < H
        nq = (tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
              * tl.load(n_ptr + offs, mask=mask, other=0.0).to(tl.float32))
        last = _prefix_sum(srcs, strides, deltas, delta_strides, prefix_ptr, row, stride_pr,
                           offs, mask, N_SRC, N_DELTA)
        dot2 += tl.where(sel == N_SRC - 1, last * nq, 0.0)
        square2 += tl.where(sel == N_SRC - 1, last * last, 0.0)
        for i in tl.static_range(N_SRC - 1):
            v = tl.load(srcs[i] + row * strides[i] + offs, mask=mask, other=0.0).to(tl.float32)
            dot2 += tl.where(sel == i, v * nq, 0.0)
            square2 += tl.where(sel == i, v * v, 0.0)
    dots = tl.sum(dot2, 1)
    squares = tl.sum(square2, 1)
    logits = tl.where(idx < N_SRC, dots * tl.rsqrt(squares / H + eps), float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    tl.store(probs_ptr + row * S_PAD + idx, p / tl.sum(p, 0))
    tl.debug_barrier()
    total = tl.zeros([CHUNK], dtype=tl.float32)
    for start in tl.range(0, H, CHUNK, num_stages=STAGES):
        offs = start + cols
        mask = offs < H
        if N_DELTA > 0:
            last = tl.load(prefix_ptr + row * stride_pr + offs, mask=mask, other=0.0)
        else:
            last = tl.load(srcs[N_SRC - 1] + row * strides[N_SRC - 1] + offs, mask=mask,
                           other=0.0)
        acc = tl.load(probs_ptr + row * S_PAD + N_SRC - 1) * last.to(tl.float32)
        for i in tl.static_range(N_SRC - 1):
            v = tl.load(srcs[i] + row * strides[i] + offs, mask=mask, other=0.0).to(tl.float32)
            acc += tl.load(probs_ptr + row * S_PAD + i) * v
        mixed = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_or + offs, mixed, mask=mask)
        m = mixed.to(tl.float32)
        total += m * m
    scale = tl.rsqrt(tl.sum(total, 0) / H + norm_eps)
    tl.debug_barrier()
    for start in tl.range(0, H, CHUNK, num_stages=STAGES):
        offs = start + cols
        mask = offs < H
        m = tl.load(out_ptr + row * stride_or + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_or + offs, (m * scale * w).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _row_sources(srcs, strides, row, cols, mask, sel, N_SRC: tl.constexpr,
                 S_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """The row's sources in float32: the earlier ones as rows of an ``[S_PAD, BLOCK]`` tile,
    the last one as a ``[1, BLOCK]`` row (all loads issued before any store, which Triton
    would keep them behind)."""
    vals = tl.zeros([S_PAD, BLOCK], dtype=tl.float32)
    for i in tl.static_range(N_SRC - 1):
        v = tl.load(srcs[i] + row * strides[i] + cols, mask=mask, other=0.0).to(tl.float32)
        vals = tl.where(sel == i, v, vals)
    last = tl.load(srcs[N_SRC - 1] + row * strides[N_SRC - 1] + cols, mask=mask,
                   other=0.0).to(tl.float32)
    return vals, last


@triton.jit
def _mix_norm_gram(vals, last, nq, w, deltas, delta_strides, out_ptr, prefix_ptr, row, H,
                   stride_or, stride_pr, cols, mask, eps, norm_eps, flag_ptr,
                   N_SRC: tl.constexpr, N_DELTA: tl.constexpr, S_PAD: tl.constexpr,
                   USE_PDL: tl.constexpr, WAIT: tl.constexpr):
    """The one-tile AttnRes step with the earlier sources (rows of ``vals``, loaded before
    the wait) mixed before it: their logits, weights ``e_i = exp(logit_i - top)`` against
    the largest, ``u = sum_i e_i v_i`` and ``|u|^2``. After the wait the last source ``L``
    (plus the deltas) adds three dot products, ``<u, L>``, ``<L, L>`` and ``<q n, L>``, in
    one reduction; then, with ``a = exp(top - top')`` and ``e_L`` against the new top
    ``top'``, the mix is ``m = (a u + e_L L) / Z``, ``Z = a sum(e) + e_L``, and its mean
    square ``(a^2 |u|^2 + 2 a e_L <u, L> + e_L^2 |L|^2) / Z^2 / H`` needs no reduction of
    its own (recomputed from ``m`` where those terms cancel to under 1e-3 of their size).
    The output is ``m`` rounded to its dtype, times ``rsqrt(mean square + eps)`` and the
    norm weight: the mean square is of the unrounded mix (the three-reduction form squares
    the rounded one)."""
    early = tl.arange(0, S_PAD) < N_SRC - 1
    dots = tl.sum(vals * nq, 1)
    squares = tl.sum(vals * vals, 1)
    logits = tl.where(early, dots * tl.rsqrt(squares / H + eps), float("-inf"))
    top = tl.max(logits, 0)
    e = tl.where(early, tl.exp(logits - top), 0.0)
    e_sum = tl.sum(e, 0)
    u = tl.sum(vals * e[:, None], 0)[None, :]
    uu = tl.sum(u * u, 1)[:, None]
    if WAIT:
        await_signal(flag_ptr, tl.num_programs(0))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    last = _add_deltas(last, deltas, delta_strides, prefix_ptr, row, stride_pr, cols, mask,
                       N_DELTA)
    ul, ll, ql = sums3(u * last, last * last, nq * last, 1)
    ul, ll, ql = ul[:, None], ll[:, None], ql[:, None]
    l_logit = ql * tl.rsqrt(ll / H + eps)
    new_top = tl.maximum(top, l_logit)
    a = tl.exp(top - new_top)
    e_l = tl.exp(l_logit - new_top)
    inv = 1.0 / (a * e_sum + e_l)
    mixed = (a * u + e_l * last) * inv
    parts = a * a * uu + e_l * e_l * ll
    square_sum = (parts + 2.0 * a * e_l * ul) * inv * inv
    if tl.sum(tl.sum(tl.where(square_sum * 1000.0 < parts * inv * inv, 1, 0), 1), 0) > 0:
        square_sum = tl.sum(mixed * mixed, 1)[:, None]
    mixed = mixed.to(out_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.rsqrt(square_sum / H + norm_eps)
    tl.store(out_ptr + row * stride_or + cols,
             (mixed * scale * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_norm_row_kernel(srcs, strides, deltas, delta_strides, q_ptr, n_ptr, w_ptr, out_ptr,
                         prefix_ptr, H, stride_or, stride_pr, eps, norm_eps, flag_ptr,
                         N_SRC: tl.constexpr, N_DELTA: tl.constexpr, S_PAD: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                         PRE_SOURCES: tl.constexpr, WAIT: tl.constexpr,
                         GRAM: tl.constexpr = False):
    """One row of the fused AttnRes step held whole in registers (an [S_PAD, BLOCK] tile of
    the sources): each source read once, the prefix and the normed mix written once, no
    sweep rereads the row. The same roundings as :func:`_mix_norm_kernel` (the prefix and the
    mix in their stored dtypes). Every row vector is a ``[1, BLOCK]`` tile of the sources'
    layout, so that placing a source in the tile and reducing need no layout conversion
    (each one a round trip through shared memory with barriers). ``PRE_SOURCES``: the
    sources were written by launches that have completed when this one starts (the pdl
    pass's ``pre_wait_inputs``), so they load before the PDL wait; only the deltas after.
    ``WAIT``: a side-stream branch's output among the deltas is signalled at ``flag_ptr``
    (:func:`~stepgraph.runtime.kernels.sync.await_signal`, before the PDL wait and before
    the dependents may launch). ``GRAM`` (with ``PRE_SOURCES``, two sources or more): the
    earlier sources' part of the mix is formed before the wait (:func:`_mix_norm_gram`), so
    after it one reduction remains instead of three."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = cols < H
    sel = tl.arange(0, S_PAD)[:, None]
    nq = (tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32)
          * tl.load(n_ptr + cols, mask=mask, other=0.0).to(tl.float32))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PRE_SOURCES:
        vals, last = _row_sources(srcs, strides, row, cols, mask, sel, N_SRC, S_PAD, BLOCK)
    if GRAM:
        _mix_norm_gram(vals, last, nq, w, deltas, delta_strides, out_ptr, prefix_ptr, row,
                       H, stride_or, stride_pr, cols, mask, eps, norm_eps, flag_ptr,
                       N_SRC, N_DELTA, S_PAD, USE_PDL, WAIT)
        return
    if WAIT:
        await_signal(flag_ptr, tl.num_programs(0))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PRE_SOURCES:
        vals, last = _row_sources(srcs, strides, row, cols, mask, sel, N_SRC, S_PAD, BLOCK)
    last = _add_deltas(last, deltas, delta_strides, prefix_ptr, row, stride_pr, cols, mask,
                       N_DELTA)
    vals = tl.where(sel == N_SRC - 1, last, vals)
    dots = tl.sum(vals * nq, 1)
    squares = tl.sum(vals * vals, 1)
    idx = tl.arange(0, S_PAD)
    logits = tl.where(idx < N_SRC, dots * tl.rsqrt(squares / H + eps), float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    mixed = tl.sum(vals * p[:, None], 0)[None, :].to(out_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.rsqrt(tl.sum(mixed * mixed, 1) / H + norm_eps)
    tl.store(out_ptr + row * stride_or + cols,
             (mixed * scale[:, None] * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_of(name: str, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or tuple(t.shape) != tuple(out.shape):
            raise UserError(f"{name}: operand {list(t.shape)} does not match the output "
                            f"{list(out.shape)}")
        if t.stride(1) != 1:
            raise NotImplementedError(f"{name}: operands must be contiguous along the row")
    if out.stride(1) != 1:
        raise NotImplementedError(f"{name}: the output must be contiguous along the row")
    if out.shape[1] > MAX_ROW:
        raise NotImplementedError(f"{name}: rows of {out.shape[1]} > {MAX_ROW} elements")


class RmsNorm:
    """A prepared RMSNorm launch: ``out [R, H] = rmsnorm(x [R, H]) * weight [H]``."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                 pdl: bool = False) -> None:
        _rows_of("rmsnorm", [x], out)
        if tuple(weight.shape) != (out.shape[1],):
            raise UserError(f"rmsnorm: weight {list(weight.shape)} for rows of {out.shape[1]}")
        self.x, self.weight, self.out, self.eps = x, weight, out, float(eps)
        self.block = next_pow2(out.shape[1])
        self.pdl = pdl_allowed(pdl, out.device)

    def __call__(self) -> None:
        """Enqueue the launch (one program a row)."""
        if self.out.shape[0] == 0:
            return
        _rmsnorm_kernel[(self.out.shape[0],)](
            self.x, self.weight, self.out, self.out.shape[1], self.x.stride(0),
            self.out.stride(0), self.eps, BLOCK=self.block, USE_PDL=self.pdl,
            num_warps=_warps(self.block), launch_pdl=self.pdl)


class Embed:
    """A prepared gather of embedding rows: ``table[tokens]`` into ``out`` ``[R, H]``."""

    def __init__(self, tokens: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                 pdl: bool = False) -> None:
        if tokens.dim() != 1 or tokens.shape[0] != out.shape[0] or table.shape[1] != out.shape[1]:
            raise UserError(f"embed: tokens {list(tokens.shape)}, table {list(table.shape)} "
                            f"and output {list(out.shape)} do not fit together")
        if not tokens.is_contiguous() or table.stride(1) != 1 or out.stride(1) != 1:
            raise NotImplementedError("embed: tokens, table rows and output rows must be "
                                      "contiguous")
        self.tokens, self.table, self.out = tokens, table, out
        self.pdl = pdl_allowed(pdl, out.device)
        self.trigger = pdl_allowed(True, out.device)

    def __call__(self) -> None:
        """Enqueue the launch."""
        rows, width = self.out.shape
        if rows == 0:
            return
        _embed_kernel[(rows, triton.cdiv(width, EMBED_BLOCK))](
            self.tokens, self.table, self.out, width, self.table.shape[0], self.table.stride(0),
            self.out.stride(0), BLOCK=EMBED_BLOCK, USE_PDL=self.pdl, TRIGGER=self.trigger,
            num_warps=4, launch_pdl=self.pdl)


class Add:
    """A prepared sum of operands ``[R, H]`` (two or more) into ``out``."""

    def __init__(self, sources: Sequence[torch.Tensor], out: torch.Tensor,
                 pdl: bool = False) -> None:
        if not 1 <= len(sources) <= MAX_SOURCES:
            raise NotImplementedError(f"add: {len(sources)} operands (1..{MAX_SOURCES})")
        _rows_of("add", sources, out)
        self.sources, self.out = tuple(sources), out
        self.strides = tuple(s.stride(0) for s in sources)
        self.pdl = pdl_allowed(pdl, out.device)

    def __call__(self) -> None:
        """Enqueue the launch."""
        rows, width = self.out.shape
        if rows == 0:
            return
        _add_kernel[(rows, triton.cdiv(width, ADD_BLOCK))](
            self.sources, self.strides, self.out, width, self.out.stride(0),
            N_SRC=len(self.sources), BLOCK=ADD_BLOCK, USE_PDL=self.pdl, num_warps=4,
            launch_pdl=self.pdl)


class AttnResMix:
    """A prepared AttnRes mix: sources ``[R, H]`` each, ``query`` and ``norm`` ``[H]``. Two
    launches: the logits (one program per row and source) into a scratch ``[R, S]``, then the
    softmax-weighted sum (one program per row and column block), so that one row's work
    spreads over many SMs (B = 1 included)."""

    def __init__(self, sources: Sequence[torch.Tensor], query: torch.Tensor,
                 norm: torch.Tensor, out: torch.Tensor, eps: float, pdl: bool = False) -> None:
        if not 1 <= len(sources) <= MAX_SOURCES:
            raise NotImplementedError(f"attn_res_mix: {len(sources)} sources (1..{MAX_SOURCES})")
        _rows_of("attn_res_mix", sources, out)
        width = out.shape[1]
        if tuple(query.shape) != (width,) or tuple(norm.shape) != (width,):
            raise UserError(f"attn_res_mix: query {list(query.shape)} / norm "
                            f"{list(norm.shape)} for rows of {width}")
        self.sources, self.query, self.norm, self.out = tuple(sources), query, norm, out
        self.strides = tuple(s.stride(0) for s in sources)
        self.eps = float(eps)
        self.s_pad = max(2, next_pow2(len(sources)))
        self.logits = scratch(out.device, "attn_res_logits", out.shape[0] * self.s_pad,
                              torch.float32)
        self.pdl = pdl_allowed(pdl, out.device)

    def __call__(self) -> None:
        """Enqueue the two launches."""
        rows, width = self.out.shape
        if rows == 0:
            return
        count = len(self.sources)
        _mix_logits_kernel[(rows, count)](
            self.sources, self.strides, self.query, self.norm, self.logits, width, self.eps,
            N_SRC=count, S_PAD=self.s_pad, BLOCK=min(MIX_BLOCK, next_pow2(width)),
            USE_PDL=self.pdl, num_warps=4, launch_pdl=self.pdl)
        _mix_sum_kernel[(rows, triton.cdiv(width, MIX_BLOCK))](
            self.sources, self.strides, self.logits, self.out, width, self.out.stride(0),
            N_SRC=count, S_PAD=self.s_pad, BLOCK=MIX_BLOCK, USE_PDL=self.pdl, num_warps=4,
            launch_pdl=self.pdl)


class AttnResNorm:
    """A prepared fused AttnRes step (the fuse pass's ``attn_res_norm``): ``prefix = last +
    sum(deltas)`` written to ``prefix`` (when there are deltas), the mix of ``sources[:-1]``
    and that prefix with ``query`` and ``mix_norm``, then RMSNorm with ``weight`` into
    ``out``. One launch, one program a row: the whole row in registers where the sources x
    columns fit :data:`ROW_TILE` (K3: 2 or 3 sources of 7168), else three sweeps in column
    chunks (``one_tile=False`` forces the sweeps). ``pre_sources``: the sources may be read
    before the PDL wait (the one-tile form loads them there). ``wait``: an int32 [2] flag
    (and arrival counter) that a side-stream branch writing one of the deltas sets when it
    is done (:func:`~stepgraph.runtime.kernels.sync.signal_kernel`): the launch waits on it
    instead of a graph edge (:attr:`awaits` is that flag). ``gram``: with the sources
    read before the wait, two or more of them and the one-tile form, the earlier sources'
    part of the mix is formed before the wait and one reduction follows it instead of three
    (:func:`_mix_norm_gram`; k3-rank-tp8 B=1 -7 to -9 us a step on the H200, docs/perf.md,
    nineteenth session)."""

    def __init__(self, sources: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor],
                 query: torch.Tensor, mix_norm: torch.Tensor, weight: torch.Tensor,
                 out: torch.Tensor, prefix: torch.Tensor | None, eps: float, norm_eps: float,
                 pdl: bool = False, one_tile: bool = True, pre_sources: bool = False,
                 wait: torch.Tensor | None = None, gram: bool = True) -> None:
        if not 1 <= len(sources) <= MAX_SOURCES or len(deltas) > MAX_SOURCES:
            raise NotImplementedError(f"attn_res_norm: {len(sources)} sources, {len(deltas)} "
                                      f"deltas (1..{MAX_SOURCES} each)")
        if bool(deltas) != (prefix is not None):
            raise UserError("attn_res_norm: a prefix output goes with deltas, and only then")
        rows = [*sources, *deltas, *([prefix] if prefix is not None else [])]
        _rows_of("attn_res_norm", rows, out)
        width = out.shape[1]
        for name, t in (("query", query), ("mix norm", mix_norm), ("norm weight", weight)):
            if tuple(t.shape) != (width,):
                raise UserError(f"attn_res_norm: {name} {list(t.shape)} for rows of {width}")
        # Triton takes no empty tuple: without deltas a stand-in the kernel never reads
        self.sources, self.deltas = tuple(sources), tuple(deltas) or (sources[-1],)
        self.n_delta = len(deltas)
        self.query, self.mix_norm, self.weight, self.out = query, mix_norm, weight, out
        self.prefix = prefix if prefix is not None else out
        self.strides = tuple(s.stride(0) for s in self.sources)
        self.delta_strides = tuple(d.stride(0) for d in self.deltas)
        self.eps, self.norm_eps = float(eps), float(norm_eps)
        self.s_pad = max(2, next_pow2(len(sources)))
        self.chunk = min(FUSED_CHUNK, next_pow2(width), FUSED_TILE // self.s_pad)
        self.block = next_pow2(width)
        self.one_tile = one_tile and self.s_pad * self.block <= ROW_TILE
        self.probs = scratch(out.device, "attn_res_probs", out.shape[0] * self.s_pad,
                             torch.float32)
        self.pdl = pdl_allowed(pdl, out.device)
        self.pre_sources = pre_sources and self.pdl
        self.gram = gram  # wanted; used where :attr:`uses_gram`
        if wait is not None and (wait.dtype != torch.int32 or wait.numel() < 2):
            raise UserError(f"attn_res_norm: the wait flag must be int32 [2], got "
                            f"{wait.dtype} [{wait.numel()}]")
        self.awaits = wait

    @property
    def uses_gram(self) -> bool:
        """Whether the launch runs the Gram form: wanted, the sources read before the wait,
        two or more of them, the one-tile kernel."""
        return self.gram and self.pre_sources and self.one_tile and len(self.sources) >= 2

    def __call__(self) -> None:
        """Enqueue the launch."""
        rows, width = self.out.shape
        if rows == 0:
            return
        rows_in = (self.sources, self.strides, self.deltas, self.delta_strides, self.query,
                   self.mix_norm, self.weight, self.out, self.prefix)
        flag = self.awaits if self.awaits is not None else self.probs  # unread without WAIT
        sizes = (width, self.out.stride(0), self.prefix.stride(0), self.eps, self.norm_eps,
                 flag)
        shape = dict(N_SRC=len(self.sources), N_DELTA=self.n_delta, S_PAD=self.s_pad,
                     USE_PDL=self.pdl, WAIT=self.awaits is not None, launch_pdl=self.pdl)
        if self.one_tile:
            _mix_norm_row_kernel[(rows,)](*rows_in, *sizes, BLOCK=self.block,
                                          PRE_SOURCES=self.pre_sources, GRAM=self.uses_gram,
                                          num_warps=ROW_WARPS,
                                          maxnreg=ROW_REGS, **shape)
        else:
            _mix_norm_kernel[(rows,)](*rows_in, self.probs, *sizes, CHUNK=self.chunk,
                                      STAGES=FUSED_STAGES, num_warps=FUSED_WARPS, **shape)
