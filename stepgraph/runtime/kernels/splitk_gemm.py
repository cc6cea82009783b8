"""Split-K skinny GEMM for decode projections: ``out[R, N] = x[R, K] @ w[N, K].T`` for a few
rows (1..64), BF16 operands, float32 accumulation, written in the output's dtype (BF16, or
float32 for the MoE front) through its strides (a column slice of a packed output works).

Kernel 1 (``_splitk_kernel``): one program per (tile of ``m_tile`` weight rows, K split,
tile of batch rows). It computes ``w_tile @ x_tile.T`` (the weight tile is the MMA's large
operand, the batch rows its narrow one), loading its first ``pre`` weight tiles *before*
``gdc_wait()`` (weights never depend on the predecessor), then the activations. With one
split it writes the output; with more it writes float32 partials ``[split, R, N]`` to a
shared scratch buffer, and the last program of each output tile to finish sums them in split
order (deterministic whichever finishes last) into the output; tactics with ``fused: 0`` sum
them in a second launch (``_splitk_reduce_kernel``) instead. Launches use PDL when allowed,
and let their dependents launch right after the wait (as every kernel of the runtime), so
the next launch's own weight loads overlap this one's whole stream, not only its tail.

The GEMV forms (``n_tile`` up to :data:`GEMV_GROUP_ROWS`, no MMA, weights straight to registers):
``_gemv_kernel`` for one row a program, :mod:`~stepgraph.runtime.kernels.gemv_rows` for two
or four.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.elementwise import Add, RmsNorm
from stepgraph.runtime.kernels.gemm_tiles import k_range, next_chunks, store_tile
from stepgraph.runtime.kernels.gemv_rows import gemv_rows_kernel
from stepgraph.runtime.kernels.launch_utils import (
    GEMV_GROUP_ROWS,
    dot_in_f32,
    interpreting,
    next_pow2,
    pdl_allowed,
    scratch,
    tile_width,
)

SMEM_LIMIT = 232448  # bytes of shared memory one program may use (H100/H200: 227 KB)
REDUCE_BLOCK = 1024


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a @ b`` with BF16 operands (float32 ones under the interpreter or for float32
    weights) and float32 accumulation."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, sem_ptr,
                   R, N, K, tiles_per_split,
                   stride_xr, stride_xk, stride_wn, stride_wk, stride_or, stride_on,
                   BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT: tl.constexpr, PRE: tl.constexpr, EVEN_K: tl.constexpr,
                   FUSED: tl.constexpr, FENCE: tl.constexpr,
                   USE_PDL: tl.constexpr, DOT_F32: tl.constexpr):
    """Partial (or whole, SPLIT == 1) ``x @ w.T`` of one weight tile, K split, row tile.

    ``EVEN_K``: K is a multiple of BLOCK_K, so the main loop needs no K mask (a K mask of
    unknown alignment keeps Triton from pipelining the loads). ``FUSED`` (SPLIT > 1): the
    tile's last program to finish (a counter per output tile in ``sem_ptr``, left at zero
    again) sums the partials in split order and writes the output, so no reduction launch
    follows. ``FENCE``: order the partial stores before the counter with a GPU fence (off
    under the interpreter, which runs programs one at a time)."""
    pid_w = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo, k_hi, tiles = k_range(pid_s, tiles_per_split, K, BLOCK_K)
    w_rows = offs_w < N
    x_rows = offs_r < R
    w_base = w_ptr + offs_w[:, None] * stride_wn
    x_base = x_ptr + offs_r[None, :] * stride_xr

    # The first weight tiles never depend on the predecessor: load them before the PDL
    # wait, so that the predecessor's tail overlaps this kernel's first HBM reads.
    k0 = k_lo + offs_k
    w0 = tl.load(w_base + k0[None, :] * stride_wk,
                 mask=w_rows[:, None] & (k0 < k_hi)[None, :], other=0.0)
    if PRE >= 2:
        k1 = k0 + BLOCK_K
        w1 = tl.load(w_base + k1[None, :] * stride_wk,
                     mask=w_rows[:, None] & (k1 < k_hi)[None, :], other=0.0)
    if USE_PDL:
        # Dependents may launch now: they only load weights until this grid completes.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    acc = tl.zeros([BLOCK_W, BLOCK_R], dtype=tl.float32)
    x0 = tl.load(x_base + k0[:, None] * stride_xk,
                 mask=x_rows[None, :] & (k0 < k_hi)[:, None], other=0.0)
    acc = mma(w0, x0, acc, DOT_F32)
    if PRE >= 2:
        x1 = tl.load(x_base + k1[:, None] * stride_xk,
                     mask=x_rows[None, :] & (k1 < k_hi)[:, None], other=0.0)
        acc = mma(w1, x1, acc, DOT_F32)

    for i in range(PRE, tiles):
        kk = k_lo + i * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_base + kk[None, :] * stride_wk, mask=w_rows[:, None], other=0.0)
            x = tl.load(x_base + kk[:, None] * stride_xk, mask=x_rows[None, :], other=0.0)
        else:
            w = tl.load(w_base + kk[None, :] * stride_wk,
                        mask=w_rows[:, None] & (kk < k_hi)[None, :], other=0.0)
            x = tl.load(x_base + kk[:, None] * stride_xk,
                        mask=x_rows[None, :] & (kk < k_hi)[:, None], other=0.0)
        acc = mma(w, x, acc, DOT_F32)

    store_tile(acc, offs_w, offs_r, w_rows, x_rows, pid_s, pid_r * tl.num_programs(0) + pid_w,
               out_ptr, ws_ptr, sem_ptr, R, N, stride_or, stride_on, SPLIT, FUSED, FENCE)


@triton.jit
def weight_chunk(w_base, i, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K: tl.constexpr):
    """Chunk ``i`` of a GEMV program's weights ``[BLOCK_W, CHUNK_K]``; zeros (and no
    traffic) past ``k_hi``."""
    kk = k_lo + i * CHUNK_K + offs_k
    return tl.load(w_base + kk[None, :] * stride_wk,
                   mask=w_rows[:, None] & (kk < k_hi)[None, :], other=0.0)


@triton.jit
def _x_chunk(x_base, kx, k_hi, stride_xk, stride_xj, SLOTS: tl.constexpr,
             ROUND_BF16: tl.constexpr):
    """One chunk of the row: its values; with ``SLOTS`` > 0 the sum of the row's ``SLOTS``
    float32 expert slots (``stride_xj`` apart) in slot order, rounded to BF16 with
    ``ROUND_BF16`` (where the experts' own sum stores them)."""
    x = tl.load(x_base + kx * stride_xk, mask=kx < k_hi, other=0.0)
    if SLOTS > 0:
        for j in tl.static_range(1, SLOTS):
            x += tl.load(x_base + j * stride_xj + kx * stride_xk, mask=kx < k_hi, other=0.0)
        if ROUND_BF16:
            x = x.to(tl.bfloat16)
    return x


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, sem_ptr,
                 R, N, K, chunks_per_split,
                 stride_xr, stride_xk, stride_wn, stride_wk, stride_or, stride_on,
                 g_ptr, eps, stride_xj,
                 BLOCK_W: tl.constexpr, CHUNK_K: tl.constexpr, DEPTH: tl.constexpr,
                 SPLIT: tl.constexpr, FUSED: tl.constexpr, FENCE: tl.constexpr,
                 USE_PDL: tl.constexpr, NORM: tl.constexpr, SLOTS: tl.constexpr,
                 ROUND_BF16: tl.constexpr):
    """Partial (or whole) ``x[row] @ w.T`` of one weight tile and K split, for one batch row,
    without the MMA: products accumulate in float32 registers, reduced once at the end.

    Weight chunks ``[BLOCK_W, CHUNK_K]`` go straight from HBM to registers, ``DEPTH`` (2..4)
    in flight: the first ``DEPTH - 1`` are loaded before ``gdc_wait()``, and each iteration
    issues the load of chunk ``i + DEPTH - 1`` (and of the activations' next chunk) before
    it multiplies chunk ``i``. The weights never pass through shared memory (only x's chunk,
    broadcast to the tile's layout: two barriers an iteration in the sm_90 code). (Chunks
    through a shared-memory loop pipeline instead, chunk 0 in registers before the wait, or
    loaded as BF16 pairs over unrolled register sets: slower in the step at every depth
    tried, docs/perf.md, eleventh and twelfth sessions.) Each row of a bin re-reads the
    weights (through L2), so tables give this form to one-row bins. ``NORM`` (one split):
    the rows are RMS-normalized with weight ``g`` on the way: each chunk of x is scaled by
    g's chunk and its squares summed, and the dot products are scaled by ``rsqrt(mean square
    + eps)`` at the end. ``SLOTS``
    > 0: the row is the sum of that many routed-expert slots (:func:`_x_chunk`), summed
    chunk by chunk as the weights stream (the fuse pass's input combine)."""
    pid_w = tl.program_id(0)
    pid_s = tl.program_id(1)
    row = tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, CHUNK_K)
    k_lo, k_hi, chunks = k_range(pid_s, chunks_per_split, K, CHUNK_K)
    w_rows = offs_w < N
    w_base = w_ptr + offs_w[:, None] * stride_wn
    x_base = x_ptr + row * stride_xr

    w0 = weight_chunk(w_base, 0, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    w1 = w0  # w1, w2: the later chunks in flight at DEPTH 3 and 4 (else unused)
    w2 = w0
    if DEPTH >= 3:
        w1 = weight_chunk(w_base, 1, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    if DEPTH >= 4:
        w2 = weight_chunk(w_base, 2, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    kx = k_lo + offs_k
    x0 = _x_chunk(x_base, kx, k_hi, stride_xk, stride_xj, SLOTS, ROUND_BF16)
    acc = tl.zeros([BLOCK_W, CHUNK_K], dtype=tl.float32)
    if NORM:
        g0 = tl.load(g_ptr + kx, mask=kx < k_hi, other=0.0)
        squares = tl.zeros([CHUNK_K], dtype=tl.float32)
    for i in range(0, chunks):
        w_new = weight_chunk(w_base, i + DEPTH - 1, k_lo, k_hi, offs_k, w_rows, stride_wk, CHUNK_K)
        kx = k_lo + (i + 1) * CHUNK_K + offs_k
        x_new = _x_chunk(x_base, kx, k_hi, stride_xk, stride_xj, SLOTS, ROUND_BF16)
        xf = x0.to(tl.float32)
        if NORM:
            g_new = tl.load(g_ptr + kx, mask=kx < k_hi, other=0.0)
            squares += xf * xf
            xf = xf * g0.to(tl.float32)
            g0 = g_new
        acc += w0.to(tl.float32) * xf[None, :]
        x0 = x_new
        w0, w1, w2 = next_chunks(w0, w1, w2, w_new, DEPTH)
    offs_r = row + tl.arange(0, 1)
    part = tl.sum(acc, axis=1)[:, None]
    if NORM:
        part = part * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    store_tile(part, offs_w, offs_r, w_rows, offs_r < R, pid_s,
               row * tl.num_programs(0) + pid_w, out_ptr, ws_ptr, sem_ptr, R, N,
               stride_or, stride_on, SPLIT, FUSED, FENCE)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, out_ptr, R, N, stride_or, stride_on,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[r, n] = sum_s ws[s, r, n]`` in split order, cast to the output's dtype."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + (s * R + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row.to(tl.int64) * stride_or + offs * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SplitKTactic:
    """A split-K tactic: ``m_tile`` weight rows and ``n_tile`` batch rows a program,
    ``split`` K splits, ``stages`` pipeline stages; ``k_tile`` (0: 16 KB weight tiles),
    ``warps``, ``pre`` (weight tiles loaded before the PDL wait) and ``fused`` (1: the last
    split of a tile reduces; 0: a reduction launch) refine it. ``n_tile`` 1 is the GEMV form
    (:func:`_gemv_kernel`: one batch row a program, no MMA; ``stages`` 2..4 = weight chunks
    in flight, the first ``stages - 1`` before the PDL wait; ``pre`` unused); ``n_tile`` 2
    or 4 (up to :data:`GEMV_GROUP_ROWS`) the GEMV form over that many rows a program
    (:func:`~stepgraph.runtime.kernels.gemv_rows.gemv_rows_kernel`, each weight chunk loaded
    once for all of them; 3 rounds up to 4)."""

    m_tile: int = 128
    n_tile: int = 16
    split: int = 1
    stages: int = 4
    k_tile: int = 0
    warps: int = 4  # the table's field order: m_tile, n_tile, split, stages, k_tile, warps
    pre: int = 2
    fused: int = 1

    @classmethod
    def from_mapping(cls, tactic: Mapping[str, Any] | None, rows: int) -> SplitKTactic:
        """The tactic of a bin decision (``{m_tile, n_tile, split, stages}``, optional
        ``k_tile``, ``warps``, ``pre``); an empty mapping gives a default for ``rows``: the
        GEMV form at one or two rows (faster than the MMA form at every K3 shape measured at
        one row, and for the MLA q_b at two: see docs/perf.md), else an MMA tile of the
        rows."""
        if not tactic:
            if rows <= 2:
                return cls(m_tile=16, n_tile=rows, stages=2, warps=8)
            return cls(n_tile=min(64, max(16, next_pow2(rows))))
        known = {f: int(tactic[f]) for f in cls.__dataclass_fields__ if f in tactic}
        return cls(**known)


@dataclass(frozen=True)
class SplitKPlan:
    """The launch geometry a tactic gives for one problem."""

    block_w: int
    block_r: int
    block_k: int
    split: int
    k_per_split: int
    stages: int
    warps: int
    pre: int
    grid: tuple[int, int, int]
    gemv: bool = False


def plan_splitk(rows: int, n: int, k: int, tactic: SplitKTactic) -> SplitKPlan:
    """Block sizes, K range per split, pipeline depth (shrunk to the shared-memory budget)
    and grid of ``tactic`` on an ``x[rows, k] @ w[n, k].T`` problem."""
    for name in ("m_tile", "n_tile", "split", "stages"):
        if getattr(tactic, name) < 1:
            raise UserError(f"split-K tactic {tactic}: {name} must be positive")
    gemv = tactic.n_tile <= GEMV_GROUP_ROWS
    if gemv:
        block_w, block_r = next_pow2(tactic.m_tile), next_pow2(tactic.n_tile)
        block_k = next_pow2(tactic.k_tile or max(64, tile_width(block_w)))
        stages = max(2, min(4, tactic.stages))  # chunks in flight, in registers
    else:
        block_w = max(16, next_pow2(tactic.m_tile))
        block_r = max(16, min(next_pow2(tactic.n_tile), next_pow2(rows)))
        block_k = max(16, next_pow2(tactic.k_tile or min(256, max(32, tile_width(block_w)))))
        # Triton's pipeliner keeps stages + 1 tiles of w and x in shared memory (checked on
        # sm_90 compiles of the H200 table's tactics): cap the stages to fit.
        stage_bytes = (block_w + block_r) * block_k * 2
        stages = max(1, min(tactic.stages, SMEM_LIMIT // stage_bytes - 1))
    split = max(1, min(tactic.split, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, block_w), split, triton.cdiv(rows, block_r))
    return SplitKPlan(block_w, block_r, block_k, split, k_per_split, stages,
                      max(1, tactic.warps), max(1, min(2, tactic.pre)), grid, gemv)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or out.dim() != 2:
        raise UserError(f"split-K GEMM wants 2-D x, w, out; got {list(x.shape)}, "
                        f"{list(w.shape)}, {list(out.shape)}")
    rows, k = x.shape
    if w.shape[1] != k or tuple(out.shape) != (rows, w.shape[0]):
        raise UserError(f"split-K GEMM shapes do not chain: x {list(x.shape)} @ "
                        f"w {list(w.shape)}.T -> out {list(out.shape)}")
    if len({x.device, w.device, out.device}) != 1:
        raise UserError("split-K GEMM: x, w and out must be on one device")


@dataclass(frozen=True)
class InputNorm:
    """An RMSNorm of a GEMM's rows before the product (the fuse pass's input norm): its
    ``weight`` [K], ``eps`` and the ``dtype`` the unfused norm stored its output in."""

    weight: torch.Tensor
    eps: float
    dtype: torch.dtype


class SplitKGemm:
    """A prepared ``out = x @ w.T`` (all three bound once); calling it enqueues the launch
    (one kernel, two with split > 1) on the current stream. Capturable. With ``norm``, of
    ``rmsnorm(x)``: inside the GEMV form with one split, else an RMSNorm launch into a
    scratch buffer first. With ``combine`` (the dtype the sum is stored in), ``x`` is
    routed-expert slots ``[R, k, K]`` whose sum over k is the rows: summed inside the GEMV
    form with one split, else by an :class:`Add` launch of the k slots (float32, in slot
    order, as the experts' own combine adds them) into a scratch buffer first."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                 tactic: SplitKTactic, pdl: bool = False, norm: InputNorm | None = None,
                 combine: torch.dtype | None = None) -> None:
        self.plan = plan_splitk(x.shape[0], w.shape[0], x.shape[-1], tactic)
        inside = self.plan.gemv and self.plan.split == 1  # the row transforms run in the GEMV
        self.before: list[Add | RmsNorm] = []  # else launches into scratch rows first
        self.slots = self.slot_stride = 0
        self.round_bf16 = combine == torch.bfloat16  # the slots' sum stored in BF16
        if combine is not None:
            if x.dim() != 3:
                raise UserError(f"split-K GEMM: slots {list(x.shape)} are not [R, k, K]")
            if inside and x.stride(2) == 1:
                self.slots, self.slot_stride = x.shape[1], x.stride(1)
                x = x[:, 0]
            else:
                summed = scratch(out.device, "splitk_sum", x.shape[0] * x.shape[2],
                                 combine).view(x.shape[0], x.shape[2])
                self.before.append(Add([x[:, j] for j in range(x.shape[1])], summed, pdl=pdl))
                x = summed
        _check(x, w, out)
        rows, k = x.shape
        n = w.shape[0]
        self.rows, self.n, self.k = rows, n, k
        self.pdl = pdl_allowed(pdl, out.device)
        self.norm = norm
        if norm is not None and tuple(norm.weight.shape) != (k,):
            raise UserError(f"split-K GEMM: input norm weight {list(norm.weight.shape)} for "
                            f"rows of {k}")
        if norm is not None and not inside:
            normed = scratch(out.device, "splitk_norm", rows * k, norm.dtype).view(rows, k)
            self.before.append(RmsNorm(x, norm.weight, normed, norm.eps, pdl=pdl))
            x, self.norm = normed, None
        self.x, self.w, self.out = x, w, out
        self.dot_f32 = dot_in_f32(w.dtype)
        self.fused = bool(tactic.fused) and self.plan.split > 1
        self.sem = out  # unused unless fused
        if self.plan.split > 1:
            self.ws = scratch(out.device, "splitk", self.plan.split * rows * n, torch.float32)
        else:
            self.ws = out  # unused by the kernel with SPLIT == 1
        if self.fused:
            tiles = self.plan.grid[0] * self.plan.grid[2]
            self.sem = scratch(out.device, "splitk_sem", tiles, torch.int32, zeroed=True)

    def __call__(self) -> None:
        """Enqueue the launch(es)."""
        p, x, w, out = self.plan, self.x, self.w, self.out
        if self.rows == 0:
            return
        args = (x, w, out, self.ws, self.sem, self.rows, self.n, self.k,
                p.k_per_split // p.block_k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                out.stride(0), out.stride(1))
        common = dict(SPLIT=p.split, FUSED=self.fused, FENCE=not interpreting(),
                      USE_PDL=self.pdl, num_warps=p.warps, launch_pdl=self.pdl)
        for launch in self.before:
            launch()
        if p.gemv and p.block_r > 1:
            norm = self.norm
            gemv_rows_kernel[p.grid](*args, norm.weight if norm else w,
                                      norm.eps if norm else 0.0, self.slot_stride,
                                      ROWS=p.block_r, BLOCK_W=p.block_w, CHUNK_K=p.block_k,
                                      DEPTH=p.stages, NORM=norm is not None,
                                      SLOTS=self.slots, ROUND_BF16=self.round_bf16,
                                      num_stages=1, **common)
        elif p.gemv:
            norm = self.norm
            _gemv_kernel[p.grid](*args, norm.weight if norm else w, norm.eps if norm else 0.0,
                                 self.slot_stride,
                                 BLOCK_W=p.block_w, CHUNK_K=p.block_k, DEPTH=p.stages,
                                 NORM=norm is not None, SLOTS=self.slots,
                                 ROUND_BF16=self.round_bf16, num_stages=1,
                                 **common)
        else:
            _splitk_kernel[p.grid](*args, BLOCK_W=p.block_w, BLOCK_R=p.block_r,
                                   BLOCK_K=p.block_k, PRE=p.pre,
                                   EVEN_K=self.k % p.block_k == 0, DOT_F32=self.dot_f32,
                                   num_stages=p.stages, **common)
        if p.split > 1 and not self.fused:
            grid = (triton.cdiv(self.n, REDUCE_BLOCK), self.rows)
            _splitk_reduce_kernel[grid](
                self.ws, out, self.rows, self.n, out.stride(0), out.stride(1),
                SPLIT=p.split, BLOCK=REDUCE_BLOCK, USE_PDL=self.pdl, num_warps=4,
                launch_pdl=self.pdl)


def splitk_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                tactic: SplitKTactic | Mapping[str, Any] | None = None,
                pdl: bool = False) -> torch.Tensor:
    """One-off ``out = x @ w.T`` with ``tactic`` (a :class:`SplitKTactic`, a bin decision's
    mapping, or None for a default); returns ``out``."""
    if not isinstance(tactic, SplitKTactic):
        tactic = SplitKTactic.from_mapping(tactic, x.shape[0])
    SplitKGemm(x, w, out, tactic, pdl)()
    return out
