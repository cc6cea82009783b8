"""The routed experts' two launches at one row (or a few) as GEMVs (tactic ``gemv`` of
:class:`stepgraph.runtime.kernels.moe.MoeTactic`, launched by
:class:`~stepgraph.runtime.kernels.moe.RoutedExperts`): per tile of ``BLOCK_W`` weight rows
and expert slot ``j`` (row ``j // k``'s ``j % k``-th expert), the expert ``ids[row, j % k]``,
the weights streamed into registers a 16 KB chunk at a time, the next chunk loading while
this one multiplies (the dense GEMV form's loop,
:func:`stepgraph.runtime.kernels.splitk_gemm.weight_chunk`), no MMA. At one row the MMA
form runs one program per expert and 64 rows (k3-rank-tp8, top-2: 96 gate_up and 112 down
programs on 132 SMs); these run 384 and 448 at 16 rows a program."""

from __future__ import annotations

import triton
import triton.language as tl

from stepgraph.runtime.kernels.activation import gated_act
from stepgraph.runtime.kernels.splitk_gemm import weight_chunk


@triton.jit
def _row_and_slot(j, TOPK: tl.constexpr, ONE_ROW: tl.constexpr):
    """Expert slot ``j`` of the launch: its row and its place among the row's ``TOPK``
    (``ONE_ROW``: row 0, folded at compile time)."""
    if ONE_ROW:
        return 0, j
    return j // TOPK, j % TOPK


@triton.jit
def moe_gemv_gate_up_kernel(x_ptr, ids_ptr, gu_ptr, h_ptr, W, INTER, expert_offset, E,
                             stride_xr, stride_xk, stride_ir, stride_ij, stride_ge, stride_gn,
                             stride_gk, stride_hr, beta, beta_linear,
                             BLOCK_W: tl.constexpr, CHUNK_K: tl.constexpr, TOPK: tl.constexpr,
                             ONE_ROW: tl.constexpr, ACT: tl.constexpr, USE_PDL: tl.constexpr):
    """The GEMV form of the MMA form's gate_up launch
    (:func:`stepgraph.runtime.kernels.moe._moe_gate_up_kernel`): program (n-tile, j)
    streams ``BLOCK_W`` rows of gate and of up of expert slot ``j`` (row ``j // TOPK``'s
    ``j % TOPK``-th expert), the next chunk of each loading while this one multiplies,
    products in float32 registers reduced once at the end (as the dense GEMV form), and
    writes ``act(gate, up)`` to ``h[j]``. The expert is known only once the router's output
    is visible: nothing loads before the wait."""
    nt = tl.program_id(0)
    j = tl.program_id(1)
    row, slot = _row_and_slot(j, TOPK, ONE_ROW)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.load(ids_ptr + row * stride_ir + slot * stride_ij) - expert_offset
    if (e >= 0) & (e < E):
        offs_n = nt * BLOCK_W + tl.arange(0, BLOCK_W)
        n_ok = offs_n < INTER
        offs_k = tl.arange(0, CHUNK_K)
        g_base = gu_ptr + e.to(tl.int64) * stride_ge + offs_n[:, None] * stride_gn
        u_base = g_base + INTER * stride_gn
        g0 = weight_chunk(g_base, 0, 0, W, offs_k, n_ok, stride_gk, CHUNK_K)
        u0 = weight_chunk(u_base, 0, 0, W, offs_k, n_ok, stride_gk, CHUNK_K)
        x_row = x_ptr + row * stride_xr
        x0 = tl.load(x_row + offs_k * stride_xk, mask=offs_k < W, other=0.0)
        acc_g = tl.zeros([BLOCK_W, CHUNK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_W, CHUNK_K], dtype=tl.float32)
        for i in range(0, tl.cdiv(W, CHUNK_K)):
            g1 = weight_chunk(g_base, i + 1, 0, W, offs_k, n_ok, stride_gk, CHUNK_K)
            u1 = weight_chunk(u_base, i + 1, 0, W, offs_k, n_ok, stride_gk, CHUNK_K)
            kx = (i + 1) * CHUNK_K + offs_k
            x1 = tl.load(x_row + kx * stride_xk, mask=kx < W, other=0.0)
            xf = x0.to(tl.float32)[None, :]
            acc_g += g0.to(tl.float32) * xf
            acc_u += u0.to(tl.float32) * xf
            g0, u0, x0 = g1, u1, x1
        h = gated_act(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), beta, beta_linear, ACT)
        tl.store(h_ptr + j * stride_hr + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_gemv_down_kernel(h_ptr, ids_ptr, wts_ptr, dn_ptr, y_ptr, W, INTER, expert_offset, E,
                          stride_hr, stride_ir, stride_ij, stride_wr, stride_wj,
                          stride_de, stride_dn, stride_dk, stride_yr,
                          BLOCK_W: tl.constexpr, CHUNK_K: tl.constexpr, TOPK: tl.constexpr,
                          ONE_ROW: tl.constexpr, PRE: tl.constexpr, USE_PDL: tl.constexpr):
    """The GEMV form of the MMA form's down launch
    (:func:`stepgraph.runtime.kernels.moe._moe_down_kernel`, streamed as
    :func:`moe_gemv_gate_up_kernel`): ``y[j, n-tile] = weight[j] * (h[j] @ down[e].T)``.
    ``PRE``: the routing was written two launches back (as the MMA form's ``PRE``), so the
    expert and the first weight chunk load before the wait."""
    nt = tl.program_id(0)
    j = tl.program_id(1)
    if USE_PDL and not PRE:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, slot = _row_and_slot(j, TOPK, ONE_ROW)
    e = tl.load(ids_ptr + row * stride_ir + slot * stride_ij,
                cache_modifier=".cg") - expert_offset
    held = (e >= 0) & (e < E)
    offs_n = nt * BLOCK_W + tl.arange(0, BLOCK_W)
    n_ok = (offs_n < W) & held
    offs_k = tl.arange(0, CHUNK_K)
    d_base = (dn_ptr + tl.where(held, e, 0).to(tl.int64) * stride_de
              + offs_n[:, None] * stride_dn)
    w0 = weight_chunk(d_base, 0, 0, INTER, offs_k, n_ok, stride_dk, CHUNK_K)
    if USE_PDL and PRE:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if held:
        h_row = h_ptr + j * stride_hr
        x0 = tl.load(h_row + offs_k, mask=offs_k < INTER, other=0.0)
        acc = tl.zeros([BLOCK_W, CHUNK_K], dtype=tl.float32)
        for i in range(0, tl.cdiv(INTER, CHUNK_K)):
            w1 = weight_chunk(d_base, i + 1, 0, INTER, offs_k, n_ok, stride_dk, CHUNK_K)
            kx = (i + 1) * CHUNK_K + offs_k
            x1 = tl.load(h_row + kx, mask=kx < INTER, other=0.0)
            acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
            w0, x0 = w1, x1
        wt = tl.load(wts_ptr + row * stride_wr + slot * stride_wj).to(tl.float32)
        tl.store(y_ptr + j * stride_yr + offs_n, tl.sum(acc, axis=1) * wt, mask=offs_n < W)
