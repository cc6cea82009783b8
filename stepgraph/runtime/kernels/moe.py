"""Triton kernels of the MoE for decode row counts: the routed experts as two or three grouped
launches (the router is :mod:`stepgraph.runtime.kernels.routing`).

Routed experts (``x [R, W]``, ``ids``/``weights [R, k]``, ``gate_up [E, 2I, W]``,
``down [E, W, I]`` -> ``out [R, W]``), all capturable (fixed grids, no host sync):

1. ``_moe_gate_up_kernel``: one program per (active expert ``u``, tile of I, chunk of rows).
   The program finds its expert itself: the ``u``-th smallest local expert id any row
   selected (a histogram of the ids), then the rows that selected it (a prefix sum over
   rows), ``BLOCK_M`` rows a chunk. It reads the expert's gate and up tiles once for all
   those rows and writes ``act(gate, up)`` (SiTU or SiLU, float32) to ``h[r * k + j]``.
2. ``_moe_down_kernel``: the same selection over tiles of W; ``h @ down[e].T`` times the
   row's routing weight into ``y[r * k + j]`` (float32).
3. ``_moe_combine_kernel``: ``out[r] = sum_j y[r * k + j]`` over the row's experts held
   here (ids in ``[offset, offset + E)``), in the output's dtype; other ids add nothing.
   With tactic ``combine`` 1 (default 0: measured ~4 us slower at one row on the H200,
   docs/perf.md, tenth session) no third launch runs: every down program counts itself done
   on its column tile (:func:`stepgraph.runtime.kernels.sync.arrive`), and the tile's last
   one sums the tile's columns of every row the same way (:func:`combined_rows`), in the
   same order, so the two forms write the same bits. With ``slots`` (the fuse pass's form:
   its consumer, routed_expert_up, sums them) the down launch writes ``y`` into the output
   ``[R, k, W]`` and no combine runs.

At up to :data:`GEMV_ROWS` rows, tactic ``gemv`` swaps 1 and 2 for their GEMV forms
(:mod:`stepgraph.runtime.kernels.moe_gemv`: a program per tile of ``gemv`` weight rows
and expert slot ``j``, row ``j // k``'s ``j % k``-th expert, weights streamed into
registers as the dense GEMV form does, no MMA; two rows that pick one expert read it
twice); more programs than the MMA form's one per expert and 64 rows (k3-rank-tp8 at one
row, 16 rows a program: 384 and 448 instead of 96 and 112).

The grid covers ``min(E, R * k)`` experts x tiles x ``ceil(R / BLOCK_M)`` chunks; programs
past the active experts or rows return at once. A row's ids must be distinct (top-k).
The gate_up launch waits on its predecessor (``gdc_wait``) before reading the routing;
every launch lets its dependents launch right after its wait, so the down launch (tactic
``pre``) may read the routing and its first weight tiles before its own wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.activation import gated_act
from stepgraph.runtime.kernels.launch_utils import (
    dot_in_f32,
    interpreting,
    next_pow2,
    pdl_allowed,
    scratch,
    tile_width,
)
from stepgraph.runtime.kernels.moe_gemv import moe_gemv_down_kernel, moe_gemv_gate_up_kernel
from stepgraph.runtime.kernels.splitk_gemm import SMEM_LIMIT, mma
from stepgraph.runtime.kernels.sync import arrive, reset

ACTIVATIONS = {"silu": 0, "situ": 1}
MAX_ROWS = 512  # rows one launch routes (checked: sm_90 compiles without spills up to 512)
COMBINE_BLOCK = 256
GEMV_ROWS = 4  # rows the GEMV form serves (tested 1-4; the H200 table gives it bins 1, 2)


# ----------------------------------------------------------------------------- helpers


@triton.jit
def expert_rows(ids_ptr, stride_ir, stride_ij, R, TOPK, expert_offset, E, u, c,
                R_PAD: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, CG: tl.constexpr = 0):
    """The ``u``-th smallest local expert any row selected (``e``) and chunk ``c`` of the
    rows that selected it: their row index, top-k position, a valid mask [BLOCK_M], and
    whether this (expert, chunk) has any row."""
    # Which local experts are used: a histogram of the ids held here.
    slots = tl.arange(0, R_PAD * K_PAD)
    slot_r = slots // K_PAD
    slot_j = slots % K_PAD
    flat_ok = (slot_r < R) & (slot_j < TOPK)
    if CG:
        flat = tl.load(ids_ptr + slot_r * stride_ir + slot_j * stride_ij, mask=flat_ok,
                       other=-1, cache_modifier=".cg")
    else:
        flat = tl.load(ids_ptr + slot_r * stride_ir + slot_j * stride_ij, mask=flat_ok,
                       other=-1)
    flat = flat - expert_offset
    flat_ok = flat_ok & (flat >= 0) & (flat < E)
    counts = tl.histogram(tl.where(flat_ok, flat, 0), E_PAD, mask=flat_ok)
    present = (counts > 0).to(tl.int32)
    rank = tl.cumsum(present, 0) - 1
    experts = tl.arange(0, E_PAD)
    pick = (present > 0) & (rank == u)
    e = tl.sum(tl.where(pick, experts, 0), 0)
    found = tl.sum(pick.to(tl.int32), 0) > 0

    # The rows that selected e (a row selects an expert at most once), compacted.
    rows = tl.arange(0, R_PAD)
    js = tl.arange(0, K_PAD)
    ok = (rows < R)[:, None] & (js < TOPK)[None, :]
    if CG:
        ids = tl.load(ids_ptr + rows[:, None] * stride_ir + js[None, :] * stride_ij, mask=ok,
                      other=-1, cache_modifier=".cg")
    else:
        ids = tl.load(ids_ptr + rows[:, None] * stride_ir + js[None, :] * stride_ij, mask=ok,
                      other=-1)
    hit = ok & (ids - expert_offset == e)
    row_has = tl.max(hit.to(tl.int32), 1)
    j_of_row = tl.sum(tl.where(hit, js[None, :], 0), 1)
    pos = tl.cumsum(row_has, 0) - 1
    count = tl.sum(row_has, 0)
    want = c * BLOCK_M + tl.arange(0, BLOCK_M)
    sel = (row_has[None, :] > 0) & (pos[None, :] == want[:, None])
    row_m = tl.sum(tl.where(sel, rows[None, :], 0), 1)
    j_m = tl.sum(tl.where(sel, j_of_row[None, :], 0), 1)
    valid_m = tl.sum(sel.to(tl.int32), 1) > 0
    active = found & (c * BLOCK_M < count)
    return e, row_m, j_m, valid_m, active


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _moe_gate_up_kernel(x_ptr, ids_ptr, gu_ptr, h_ptr,
                        R, W, INTER, TOPK, expert_offset, E, n_tiles, k_tiles,
                        stride_xr, stride_xk, stride_ir, stride_ij,
                        stride_ge, stride_gn, stride_gk, stride_hr,
                        beta, beta_linear,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        CHUNKS: tl.constexpr, R_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        E_PAD: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
                        USE_PDL: tl.constexpr, DOT_F32: tl.constexpr):
    """h[r*k + j, n-tile] = act(x[r] @ gate[e].T, x[r] @ up[e].T) for the chunk's rows."""
    pid = tl.program_id(0)
    c = pid % CHUNKS
    t = pid // CHUNKS
    nt = t % n_tiles
    u = t // n_tiles
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e, row_m, j_m, valid_m, active = expert_rows(
        ids_ptr, stride_ir, stride_ij, R, TOPK, expert_offset, E, u, c,
        R_PAD, K_PAD, E_PAD, BLOCK_M)
    if active:
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < INTER
        g_base = gu_ptr + e.to(tl.int64) * stride_ge + offs_n[:, None] * stride_gn
        u_base = g_base + INTER * stride_gn
        x_base = x_ptr + row_m[None, :] * stride_xr
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for i in range(0, k_tiles):
            kk = i * BLOCK_K + offs_k
            if EVEN_K:
                wg = tl.load(g_base + kk[None, :] * stride_gk, mask=n_ok[:, None], other=0.0)
                wu = tl.load(u_base + kk[None, :] * stride_gk, mask=n_ok[:, None], other=0.0)
                xt = tl.load(x_base + kk[:, None] * stride_xk, mask=valid_m[None, :],
                             other=0.0)
            else:
                k_ok = kk < W
                wg = tl.load(g_base + kk[None, :] * stride_gk,
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_base + kk[None, :] * stride_gk,
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_base + kk[:, None] * stride_xk,
                             mask=valid_m[None, :] & k_ok[:, None], other=0.0)
            acc_g = mma(wg, xt, acc_g, DOT_F32)
            acc_u = mma(wu, xt, acc_u, DOT_F32)
        h = gated_act(acc_g, acc_u, beta, beta_linear, ACT)
        slot = row_m * TOPK + j_m
        tl.store(h_ptr + slot[None, :].to(tl.int64) * stride_hr + offs_n[:, None],
                 h.to(h_ptr.dtype.element_ty), mask=n_ok[:, None] & valid_m[None, :])


@triton.jit
def combined_rows(y_ptr, ids_ptr, rows, offs, W, TOPK, expert_offset, E, stride_yr,
                  stride_ir, stride_ij, K_PAD: tl.constexpr, CG: tl.constexpr):
    """``sum_j y[rows * k + j, offs]`` (float32 ``[len(rows), len(offs)]``) over each row's
    experts held here, added one slot after another in slot order (a tree reduction's order
    would follow the tile's layout, which differs between the two combine forms; this one
    does not), ``rows`` a vector of row indices, negative ones masked out. ``CG``: y was
    written by other programs of this launch, so it is read through L2 (``.cg``), never
    from a stale L1 line."""
    row_ok = rows >= 0
    col_ok = offs < W
    total = _expert_slot(y_ptr, ids_ptr, rows, row_ok, col_ok, offs, 0, TOPK, expert_offset,
                         E, stride_yr, stride_ir, stride_ij, CG)
    for j in tl.static_range(1, K_PAD):
        total += _expert_slot(y_ptr, ids_ptr, rows, row_ok, col_ok, offs, j, TOPK,
                              expert_offset, E, stride_yr, stride_ir, stride_ij, CG)
    return total


@triton.jit
def _expert_slot(y_ptr, ids_ptr, rows, row_ok, col_ok, offs, j, TOPK, expert_offset, E,
                 stride_yr, stride_ir, stride_ij, CG: tl.constexpr):
    """y[rows * k + j, offs] as float32, zero where slot j's expert is not held here."""
    ids = tl.load(ids_ptr + rows * stride_ir + j * stride_ij, mask=row_ok & (j < TOPK),
                  other=-1)
    local = ids - expert_offset
    ok = row_ok & (j < TOPK) & (local >= 0) & (local < E)
    slots = (rows * TOPK + j).to(tl.int64)
    ptrs = y_ptr + slots[:, None] * stride_yr + offs[None, :]
    mask = ok[:, None] & col_ok[None, :]
    if CG:
        y = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        y = tl.load(ptrs, mask=mask, other=0.0)
    return y.to(tl.float32)


@triton.jit
def _moe_down_kernel(h_ptr, ids_ptr, wts_ptr, dn_ptr, y_ptr, out_ptr, sem_ptr,
                     R, W, INTER, TOPK, expert_offset, E, n_tiles, k_tiles,
                     stride_hr, stride_ir, stride_ij, stride_wr, stride_wj,
                     stride_de, stride_dn, stride_dk, stride_yr, stride_or, stride_on,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     CHUNKS: tl.constexpr, R_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     E_PAD: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                     DOT_F32: tl.constexpr, PRE: tl.constexpr, COMBINE: tl.constexpr,
                     ACTIVE: tl.constexpr, COMBINE_ROWS: tl.constexpr, FENCE: tl.constexpr):
    """y[r*k + j, n-tile] = weight[r, j] * (h[r*k + j] @ down[e].T) for the chunk's rows.

    ``PRE`` > 0: the routing was written at least two launches back (the gate_up launch
    lets this one start only once its own wait has returned), so the expert, its rows and
    its first ``PRE`` weight tiles load before this launch's wait (the routing through L2:
    ``.cg``, never a stale L1 line). ``COMBINE``: each of the ``ACTIVE`` x ``CHUNKS``
    programs of a column tile counts itself done (counter ``n-tile`` in ``sem_ptr``); the
    last sums the tile of every row into ``out`` (``COMBINE_ROWS`` rows at a time) and
    leaves the counter at zero. ``FENCE``: order y's stores before the counter with a GPU
    fence (off under the interpreter, which runs programs one at a time)."""
    pid = tl.program_id(0)
    c = pid % CHUNKS
    t = pid // CHUNKS
    nt = t % n_tiles
    u = t // n_tiles
    if USE_PDL and not PRE:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e, row_m, j_m, valid_m, active = expert_rows(
        ids_ptr, stride_ir, stride_ij, R, TOPK, expert_offset, E, u, c,
        R_PAD, K_PAD, E_PAD, BLOCK_M, PRE)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < W
    d_base = dn_ptr + e.to(tl.int64) * stride_de + offs_n[:, None] * stride_dn
    if PRE:
        kp = tl.arange(0, PRE * BLOCK_K)
        wd_pre = tl.load(d_base + kp[None, :] * stride_dk,
                         mask=(n_ok[:, None] & (kp < INTER)[None, :]) & active, other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    if active:
        offs_k = tl.arange(0, BLOCK_K)
        slot = row_m * TOPK + j_m
        h_base = h_ptr + slot[None, :].to(tl.int64) * stride_hr
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if PRE:
            ht_pre = tl.load(h_base + kp[:, None], mask=valid_m[None, :] & (kp < INTER)[:, None],
                             other=0.0)
            acc = mma(wd_pre, ht_pre, acc, DOT_F32)
        for i in range(PRE, k_tiles):
            kk = i * BLOCK_K + offs_k
            if EVEN_K:
                wd = tl.load(d_base + kk[None, :] * stride_dk, mask=n_ok[:, None], other=0.0)
                ht = tl.load(h_base + kk[:, None], mask=valid_m[None, :], other=0.0)
            else:
                k_ok = kk < INTER
                wd = tl.load(d_base + kk[None, :] * stride_dk,
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                ht = tl.load(h_base + kk[:, None], mask=valid_m[None, :] & k_ok[:, None],
                             other=0.0)
            acc = mma(wd, ht, acc, DOT_F32)
        wt = tl.load(wts_ptr + row_m * stride_wr + j_m * stride_wj, mask=valid_m, other=0.0)
        y = acc * wt.to(tl.float32)[None, :]
        tl.store(y_ptr + slot[None, :].to(tl.int64) * stride_yr + offs_n[:, None], y,
                 mask=n_ok[:, None] & valid_m[None, :])
    if COMBINE:  # noqa: SIM102 (a constexpr test apart: Triton folds it at compile time)
        # the last program of this column tile to arrive: every other has stored its y
        if arrive(sem_ptr + nt, offs_n, FENCE) == ACTIVE * CHUNKS - 1:
            for r0 in range(0, R, COMBINE_ROWS):
                rows = r0 + tl.arange(0, COMBINE_ROWS)
                total = combined_rows(y_ptr, ids_ptr, tl.where(rows < R, rows, -1), offs_n, W,
                                      TOPK, expert_offset, E, stride_yr, stride_ir, stride_ij,
                                      K_PAD, True)
                tl.store(out_ptr + rows[:, None] * stride_or + offs_n[None, :] * stride_on,
                         total.to(out_ptr.dtype.element_ty),
                         mask=(rows < R)[:, None] & n_ok[None, :])
            reset(sem_ptr + nt)


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, out_ptr, W, TOPK, expert_offset, E,
                        stride_yr, stride_ir, stride_ij, stride_or, stride_on,
                        BLOCK: tl.constexpr, K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """out[r, cols] = sum over the row's experts held here of y[r*k + j, cols]."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    total = combined_rows(y_ptr, ids_ptr, row + tl.arange(0, 1), offs, W, TOPK, expert_offset,
                          E, stride_yr, stride_ir, stride_ij, K_PAD, False)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * stride_or + offs[None, :] * stride_on,
             total.to(out_ptr.dtype.element_ty), mask=(offs < W)[None, :])


# ----------------------------------------------------------------------------- wrappers


@dataclass(frozen=True)
class MoeTactic:
    """Block sizes of the routed-expert launches: ``block_m`` rows a chunk (0: 16 or 32 from
    the rows), ``block_n_gate_up`` columns of each of gate and up a program,
    ``block_n_down`` output columns a down program, ``block_k``, ``stages``, ``warps``, and
    ``pre``: K tiles of down's weights each down program loads before its PDL wait (0: none;
    rounded down to a power of two); ``combine``: 1, the down launch's last program of each
    column tile sums the experts' outputs; 0, a third launch does. ``gemv`` > 0: at up to
    :data:`GEMV_ROWS` rows, the GEMV form instead of the MMA tiles
    (:mod:`stepgraph.runtime.kernels.moe_gemv`): ``gemv`` weight rows a program,
    ``gemv_warps`` warps, ``pre`` > 0 lets the down launch load its expert and first chunk
    before its wait, and the experts' outputs are summed by the combine launch (or by the
    slots' consumer)."""

    block_m: int = 0
    block_n_gate_up: int = 64
    block_n_down: int = 64
    block_k: int = 128
    stages: int = 3
    warps: int = 4
    pre: int = 0
    combine: int = 0
    gemv: int = 0
    gemv_warps: int = 8

    @classmethod
    def from_mapping(cls, tactic: Mapping[str, Any] | None) -> MoeTactic:
        """The tactic of a bin decision (any of the field names; others are ignored)."""
        known = {f: int(tactic[f]) for f in cls.__dataclass_fields__ if tactic and f in tactic}
        return cls(**known)


def _pow2_floor(value: int) -> int:
    """The largest power of two <= ``value`` (0 for values below 1)."""
    return 0 if value < 1 else 1 << (int(value).bit_length() - 1)


def _stages(stages: int, stage_bytes: int) -> int:
    return max(1, min(stages, SMEM_LIMIT // stage_bytes - 1))


class RoutedExperts:
    """A prepared routed-experts launch (two kernels, three with tactic ``combine`` 0) over
    bound tensors: ``x [R, W]``, ``ids [R, k]`` int32, ``weights [R, k]`` float32,
    ``gate_up [E, 2I, W]``, ``down [E, W, I]``, ``out [R, W]``; experts
    ``[expert_offset, expert_offset + E)`` are held here. With ``slots``, ``out`` is
    float32 ``[R, k, W]``: the down launch writes each row's weighted expert outputs there
    and no combine runs (the fuse pass's form: the consumer sums them; every slot must
    name an expert held here). Calling it enqueues the launches. Capturable."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor, *,
                 activation: str, beta: float = 1.0, beta_linear: float = 1.0,
                 expert_offset: int = 0, tactic: MoeTactic | None = None,
                 pdl: bool = False, slots: bool = False) -> None:
        rows, width = x.shape
        experts, two_i, w_in = gate_up.shape
        inter = two_i // 2
        top_k = ids.shape[1]
        out_shape = (rows, top_k, width) if slots else (rows, width)
        if (w_in != width or two_i % 2 or tuple(down.shape) != (experts, width, inter)
                or tuple(ids.shape) != (rows, top_k) or tuple(weights.shape) != (rows, top_k)
                or tuple(out.shape) != out_shape):
            raise UserError(f"routed experts: shapes do not fit: x {list(x.shape)}, ids "
                            f"{list(ids.shape)}, weights {list(weights.shape)}, gate_up "
                            f"{list(gate_up.shape)}, down {list(down.shape)}, out "
                            f"{list(out.shape)}")
        if rows > MAX_ROWS:
            raise NotImplementedError(f"routed experts: {rows} rows > {MAX_ROWS}")
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"routed experts: activation {activation!r} is not one of "
                            f"{sorted(ACTIVATIONS)}")
        if gate_up.stride(2) != 1 or down.stride(2) != 1:
            raise NotImplementedError("routed experts: expert weights must be contiguous in their "
                            "last dim")
        t = tactic or MoeTactic()
        self.x, self.ids, self.weights, self.gate_up, self.down, self.out = (
            x, ids, weights, gate_up, down, out)
        self.rows, self.width, self.inter, self.top_k = rows, width, inter, top_k
        self.experts, self.offset = experts, int(expert_offset)
        self.act = ACTIVATIONS[activation]
        self.beta, self.beta_linear = float(beta), float(beta_linear)
        self.pdl = pdl_allowed(pdl, out.device)
        self.dot_f32 = dot_in_f32(gate_up.dtype)
        self.r_pad = max(2, next_pow2(rows))
        self.k_pad = max(2, next_pow2(top_k))
        self.e_pad = max(2, next_pow2(experts))
        self.block_m = t.block_m or min(32, max(16, next_pow2(rows)))
        self.chunks = triton.cdiv(rows, self.block_m)
        self.active = min(experts, rows * top_k)
        self.block_k = max(16, next_pow2(t.block_k))
        self.bn_gu = max(16, next_pow2(t.block_n_gate_up))
        self.bn_dn = max(16, next_pow2(t.block_n_down))
        self.warps = t.warps
        self.stages_gu = _stages(t.stages, (2 * self.bn_gu + self.block_m) * self.block_k * 2)
        self.stages_dn = _stages(t.stages, (self.bn_dn + self.block_m) * self.block_k * 2)
        self.tiles_gu = triton.cdiv(inter, self.bn_gu)
        self.tiles_dn = triton.cdiv(width, self.bn_dn)
        # whole tiles of K, a power of two of them (one [block_n, pre * block_k] load)
        self.pre = _pow2_floor(min(t.pre, triton.cdiv(inter, self.block_k)))
        count = rows * top_k
        self.h = scratch(out.device, "moe_h", count * inter, torch.bfloat16).view(count, inter)
        self.slots = slots
        if slots:
            if out.dtype != torch.float32 or not out.is_contiguous():
                raise NotImplementedError("routed experts: slots must be contiguous float32")
            self.y = out.view(count, width)
        else:
            self.y = scratch(out.device, "moe_y", count * width,
                             torch.float32).view(count, width)
        # rows a program of the GEMV form (any power of two: no MMA tile minimum)
        self.gemv = next_pow2(t.gemv) if t.gemv and rows <= GEMV_ROWS else 0
        self.gemv_warps = t.gemv_warps
        self.combine = bool(t.combine) and not slots and not self.gemv
        # rows the fused combine sums at a time: [rows, k, block_n] float32, 16 K elements
        self.combine_rows = max(1, min(next_pow2(rows), 16384 // (self.k_pad * self.bn_dn)))
        self.sem = (scratch(out.device, "moe_sem", self.tiles_dn, torch.int32, zeroed=True)
                    if self.combine else self.ids)

    def __call__(self) -> None:
        """Enqueue gate_up + activation, down + routing weight (+ combine)."""
        if self.rows == 0:
            return
        if self.gemv:
            self._gemv_launches()
        else:
            self._mma_launches()
        if self.combine or self.slots:
            return
        y, ids, out = self.y, self.ids, self.out
        _moe_combine_kernel[(self.rows, triton.cdiv(self.width, COMBINE_BLOCK))](
            y, ids, out, self.width, self.top_k, self.offset, self.experts,
            y.stride(0), ids.stride(0), ids.stride(1), out.stride(0), out.stride(1),
            BLOCK=COMBINE_BLOCK, K_PAD=self.k_pad, USE_PDL=self.pdl, num_warps=4,
            launch_pdl=self.pdl)

    def _gemv_launches(self) -> None:
        """gate_up + activation and down + routing weight, GEMV form (16 KB of
        weights a chunk: gate_up's chunk holds gate's and up's rows)."""
        x, ids, wts, gu, dn, h, y = (self.x, self.ids, self.weights, self.gate_up, self.down,
                                     self.h, self.y)
        common = dict(BLOCK_W=self.gemv, TOPK=self.top_k, ONE_ROW=self.rows == 1,
                      USE_PDL=self.pdl,
                      num_warps=self.gemv_warps, launch_pdl=self.pdl)
        count = self.rows * self.top_k  # expert slots: a program column each
        moe_gemv_gate_up_kernel[(triton.cdiv(self.inter, self.gemv), count)](
            x, ids, gu, h, self.width, self.inter, self.offset, self.experts,
            x.stride(0), x.stride(1), ids.stride(0), ids.stride(1), gu.stride(0),
            gu.stride(1), gu.stride(2), h.stride(0), self.beta, self.beta_linear, ACT=self.act,
            CHUNK_K=tile_width(2 * self.gemv), **common)
        moe_gemv_down_kernel[(triton.cdiv(self.width, self.gemv), count)](
            h, ids, wts, dn, y, self.width, self.inter, self.offset, self.experts,
            h.stride(0), ids.stride(0), ids.stride(1), wts.stride(0), wts.stride(1),
            dn.stride(0), dn.stride(1), dn.stride(2), y.stride(0), PRE=self.pre > 0,
            CHUNK_K=tile_width(self.gemv), **common)

    def _mma_launches(self) -> None:
        """gate_up + activation and down + routing weight (+ fused combine), MMA tiles."""
        x, ids, wts, gu, dn, out, h, y = (self.x, self.ids, self.weights, self.gate_up,
                                          self.down, self.out, self.h, self.y)
        common = dict(CHUNKS=self.chunks, R_PAD=self.r_pad, K_PAD=self.k_pad,
                      E_PAD=self.e_pad, BLOCK_M=self.block_m, BLOCK_K=self.block_k,
                      USE_PDL=self.pdl, DOT_F32=self.dot_f32, num_warps=self.warps,
                      launch_pdl=self.pdl)
        _moe_gate_up_kernel[(self.active * self.tiles_gu * self.chunks,)](
            x, ids, gu, h, self.rows, self.width, self.inter, self.top_k, self.offset,
            self.experts, self.tiles_gu, triton.cdiv(self.width, self.block_k),
            x.stride(0), x.stride(1), ids.stride(0), ids.stride(1),
            gu.stride(0), gu.stride(1), gu.stride(2), h.stride(0),
            self.beta, self.beta_linear,
            BLOCK_N=self.bn_gu, ACT=self.act, EVEN_K=self.width % self.block_k == 0,
            num_stages=self.stages_gu, **common)
        _moe_down_kernel[(self.active * self.tiles_dn * self.chunks,)](
            h, ids, wts, dn, y, out, self.sem, self.rows, self.width, self.inter, self.top_k,
            self.offset, self.experts, self.tiles_dn, triton.cdiv(self.inter, self.block_k),
            h.stride(0), ids.stride(0), ids.stride(1), wts.stride(0), wts.stride(1),
            dn.stride(0), dn.stride(1), dn.stride(2), y.stride(0), out.stride(0),
            out.stride(1),
            BLOCK_N=self.bn_dn, EVEN_K=self.inter % self.block_k == 0, PRE=self.pre,
            COMBINE=self.combine, ACTIVE=self.active, COMBINE_ROWS=self.combine_rows,
            FENCE=not interpreting(), num_stages=self.stages_dn, **common)
