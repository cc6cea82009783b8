"""Triton kernels of the KDA decode / verify core (Kimi Delta Attention): three launches
(four in bins of many rows; one less with the output norm inside the recurrence).

0. :func:`_kda_gate_kernel` (bins of many rows), one program per (head, block of rows): the
   decay gate below as one tensor-core GEMM ``f_a @ f_b[head]^T``, so each head's f_b slab is
   read once per row block instead of once per row (small bins compute it in the prep).
1. :func:`_kda_prep_kernel`, one program per (request, head): the depthwise short conv + SiLU
   of q, k and v over the request's q tokens (the conv window is rebuilt from the input rows
   and the conv state loaded once, so every state write may alias the start slot), the conv
   state after each token written to that token's slot, L2-normalised q and k, ``beta =
   sigmoid(b)`` and (small bins) the decay gate ``f = f_b(f_a)`` (a GEMV over the head's
   channels) in its ``lower_bound`` or ``softplus`` form. Its outputs (q, k, v, g, beta in
   float32, [rows, H, D] / [rows, H]) are also the inputs fla-core's ``fused_recurrent_kda``
   takes.
2. :func:`_kda_recurrent_kernel`, one program per (request, head, V block): the delta rule on
   the float32 state ``[K, V]`` at the request's start slot, ``S *= exp(g); e = beta (v - S^T
   k); S += k e^T; o = S^T (q / sqrt(D))``, the state after token j written to row j's slot.
   With ``out_norm`` (the provider's tactic ``out_norm`` 1) the last V block of each
   (request, head) to finish also runs step 3 for that head's rows, and no launch follows.
3. :func:`_kda_out_norm_kernel`, one program per (row, head): RMSNorm of o times ``o_norm``,
   times sigmoid of the output gate (full rank, or the low-rank ``g_b(g_a)`` GEMV).

:func:`_kda_prep_recurrent_kernel` is steps 1 and 2 as one launch (the provider's tactic
``prep_inside`` 1; small bins, f_b's rank at most ``FB_PRE_RANK``): each (request, head, V
block) program computes the prep of what its update reads (the head's q, k and gate, its
block of v) and runs the delta rule on it, with no float32 scratch and no launch boundary
between the two.

Semantics follow :func:`stepgraph.lower.ref_kda.kda_core` (the numerical ground truth) and
its slot rules: a request starts from the slot of its row ``num_accepted_tokens - 1`` (q > 1)
or its row's slot (q = 1); the state after token j goes to row j's slot; a negative slot
reads zeros and writes nothing. Intermediates stay float32 (the reference in BF16 rounds the
conv output, SiLU, f and o to BF16; here only the inputs, the conv states and the output are
BF16), so a BF16 run is closer to the float32 reference than the BF16 reference is.

Every kernel takes ``USE_PDL``: when set it waits on the predecessor grid
(``griddepcontrol.wait``) before it reads anything a predecessor writes or writes anything,
then lets its dependents launch; it is off under the Triton interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepgraph.runtime.kernels.launch_utils import interpreting, scratch
from stepgraph.runtime.kernels.sync import arrive, reset

FB_PRE_RANK = 128  # the widest f_b slab the prep kernels hold whole (loaded before the wait)


def pdl_flag(requested: bool) -> bool:
    """PDL on when the launch asks for it (the caller checked the device) and a real GPU
    runs the kernel, not the interpreter."""
    return bool(requested) and not interpreting()


# ---------------------------------------------------------------------------- helpers


@triton.jit
def _start_slot(slots_ptr, accepted_ptr, row0, Q: tl.constexpr):
    """The slot a request's state starts from: its row ``accepted - 1`` (q > 1) or its row
    (q = 1); negative (nothing to read) when the request's first slot is negative."""
    first = tl.load(slots_ptr + row0).to(tl.int64)
    if Q > 1:
        accepted = tl.load(accepted_ptr + row0).to(tl.int64)
        pick = tl.minimum(tl.maximum(accepted - 1, 0), Q - 1)
        start = tl.load(slots_ptr + row0 + pick).to(tl.int64)
        start = tl.where(first >= 0, start, first)
    else:
        start = first
    return start


@triton.jit
def _conv_tap(x_ptr, x_stride, init, cols, row0, chan, mask_c,
              J: tl.constexpr, T: tl.constexpr, KS: tl.constexpr):
    """Tap ``T`` (0 the oldest, KS-1 the newest) of token ``J``'s conv window: input row
    ``J - (KS-1) + T`` of the request, or column ``T + J`` of the initial conv state."""
    if J - (KS - 1) + T >= 0:
        offset = (row0 + (J - (KS - 1) + T)) * x_stride
        value = tl.load(x_ptr + offset + chan, mask=mask_c, other=0.0).to(tl.float32)
    else:
        value = tl.sum(tl.where(cols[None, :] == T + J, init, 0.0), axis=1)
    return value


@triton.jit
def _load_conv_weight(w_ptr, chan, mask_c, taps, KS: tl.constexpr):
    """The conv weight [BD, KSP] of the channels (taps past KS zero), float32."""
    mask = mask_c[:, None] & (taps[None, :] < KS)
    return tl.load(w_ptr + chan[:, None] * KS + taps[None, :], mask=mask, other=0.0
                   ).to(tl.float32)


@triton.jit
def _conv_silu(x_ptr, x_stride, weight, taps, init, cols, row0, chan, mask_c,
               J: tl.constexpr, KS: tl.constexpr, BD: tl.constexpr):
    """SiLU of the depthwise conv of token ``J`` (float32) with the loaded ``weight``."""
    acc = tl.zeros([BD], dtype=tl.float32)
    for t in tl.static_range(KS):
        w_t = tl.sum(tl.where(taps[None, :] == t, weight, 0.0), axis=1)
        acc += w_t * _conv_tap(x_ptr, x_stride, init, cols, row0, chan, mask_c, J, t, KS)
    return acc * tl.sigmoid(acc)


@triton.jit
def _load_conv_state(state_ptr, slot_stride, start, chan, mask_c, cols, KS: tl.constexpr):
    """The conv state [BD, KW] (KS-1 used columns) of slot ``start``; zeros when negative."""
    mask = mask_c[:, None] & (cols[None, :] < KS - 1) & (start >= 0)
    offs = start * slot_stride + chan[:, None] * (KS - 1) + cols[None, :]
    return tl.load(state_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_conv_operands(qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, vw_ptr, slot_stride, start,
                        chan_qk, mask_qk, chan_v, mask_v, cols, taps, KS: tl.constexpr):
    """The conv states of slot ``start`` and the conv weights of q and k (channels
    ``chan_qk``) and v (``chan_v``): (q, k, v states, q, k, v weights), float32."""
    q_init = _load_conv_state(qs_ptr, slot_stride, start, chan_qk, mask_qk, cols, KS)
    k_init = _load_conv_state(ks_ptr, slot_stride, start, chan_qk, mask_qk, cols, KS)
    v_init = _load_conv_state(vs_ptr, slot_stride, start, chan_v, mask_v, cols, KS)
    q_w = _load_conv_weight(qw_ptr, chan_qk, mask_qk, taps, KS)
    k_w = _load_conv_weight(kw_ptr, chan_qk, mask_qk, taps, KS)
    v_w = _load_conv_weight(vw_ptr, chan_v, mask_v, taps, KS)
    return q_init, k_init, v_init, q_w, k_w, v_w


@triton.jit
def _store_conv_state(x_ptr, x_stride, state_ptr, slot_stride, init, cols, row0, chan, mask_c,
                      slot, J: tl.constexpr, KS: tl.constexpr):
    """Write the conv state after token ``J`` (its window's taps 1..KS-1) to ``slot``."""
    mask = mask_c & (slot >= 0)
    base = state_ptr + slot * slot_stride + chan * (KS - 1)
    for u in tl.static_range(KS - 1):
        value = _conv_tap(x_ptr, x_stride, init, cols, row0, chan, mask_c, J, u + 1, KS)
        tl.store(base + u, value.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2_normalized(x):
    """``x / sqrt(sum x^2 + 1e-6)``: KDA's L2 norm of q and k over a head."""
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _decay_gate(x, rate, lower_bound, LOWER_BOUND: tl.constexpr):
    """The log-space decay of ``x = f + dt_bias``: ``lb * sigmoid(rate x)`` or ``-rate *
    softplus(x)`` (softplus linear above 20, as the reference)."""
    if LOWER_BOUND:
        gate = lower_bound * tl.sigmoid(rate * x)
    else:
        gate = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return gate


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _kda_prep_kernel(
    q_ptr, k_ptr, v_ptr, fa_ptr, b_ptr,
    q_stride, k_stride, v_stride, fa_stride, b_stride,
    qw_ptr, kw_ptr, vw_ptr,
    qs_ptr, ks_ptr, vs_ptr, conv_slot_stride,
    fb_ptr, dt_ptr, alog_ptr,
    slots_ptr, accepted_ptr,
    qn_ptr, kn_ptr, vo_ptr, g_ptr, beta_ptr,
    fla_slots_ptr, fla_accepted_ptr, scratch_slot,
    lower_bound,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, KS: tl.constexpr,
    KW: tl.constexpr, KSP: tl.constexpr, RANK: tl.constexpr, BR: tl.constexpr,
    Q: tl.constexpr, LOWER_BOUND: tl.constexpr, GATE: tl.constexpr, FB_PRE: tl.constexpr,
    FLA: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Conv + SiLU + L2 norm of q, k, v, beta and (``GATE``) the decay gate of one (request,
    head); without ``GATE`` the gate kernel computes the decay for all rows at once.

    Before the PDL wait it loads what no earlier launch of the step writes: the weights (the
    whole f_b slab with ``FB_PRE``, RANK <= BR), the slots (step inputs) and the conv states
    (only this op writes them)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    row0 = n * Q
    d = tl.arange(0, BD)
    mask_c = d < D
    chan = h * D + d
    cols = tl.arange(0, KW)
    taps = tl.arange(0, KSP)
    start = _start_slot(slots_ptr, accepted_ptr, row0, Q)
    q_init, k_init, v_init, q_w, k_w, v_w = _load_conv_operands(
        qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, vw_ptr, conv_slot_stride, start, chan, mask_c,
        chan, mask_c, cols, taps, KS)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt = tl.load(dt_ptr + chan, mask=mask_c, other=0.0).to(tl.float32)
    if GATE and FB_PRE:
        r_all = tl.arange(0, BR)
        fb_all = tl.load(fb_ptr + chan[:, None] * RANK + r_all[None, :],
                         mask=mask_c[:, None] & (r_all < RANK)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # fla-core's slot table: negative slots to the scratch slot, accepted per request (the
    # constexpr test stays apart from the runtime one: Triton folds it at compile time)
    if FLA:  # noqa: SIM102
        if h == 0:
            for j in tl.static_range(Q):
                slot = tl.load(slots_ptr + row0 + j)
                tl.store(fla_slots_ptr + row0 + j, tl.where(slot >= 0, slot, scratch_slot))
            if Q > 1:
                tl.store(fla_accepted_ptr + n, tl.load(accepted_ptr + row0))
    for j in tl.static_range(Q):
        row = row0 + j
        out = (row * H + h) * D + d
        q = _conv_silu(q_ptr, q_stride, q_w, taps, q_init, cols, row0, chan, mask_c, j, KS, BD)
        k = _conv_silu(k_ptr, k_stride, k_w, taps, k_init, cols, row0, chan, mask_c, j, KS, BD)
        v = _conv_silu(v_ptr, v_stride, v_w, taps, v_init, cols, row0, chan, mask_c, j, KS, BD)
        q = _l2_normalized(q)
        k = _l2_normalized(k)
        tl.store(qn_ptr + out, q, mask=mask_c)
        tl.store(kn_ptr + out, k, mask=mask_c)
        tl.store(vo_ptr + out, v, mask=mask_c)
        if GATE:  # f = f_b(f_a) over the head's channels, then the decay
            f = tl.zeros([BD], dtype=tl.float32)
            if FB_PRE:
                fa = tl.load(fa_ptr + row * fa_stride + r_all, mask=r_all < RANK,
                             other=0.0).to(tl.float32)
                f += tl.sum(fb_all.to(tl.float32) * fa[None, :], axis=1)
            else:
                for r0 in tl.static_range(0, RANK, BR):
                    r = r0 + tl.arange(0, BR)
                    mask_r = r < RANK
                    fa = tl.load(fa_ptr + row * fa_stride + r, mask=mask_r,
                                 other=0.0).to(tl.float32)
                    fb = tl.load(fb_ptr + chan[:, None] * RANK + r[None, :],
                                 mask=mask_c[:, None] & mask_r[None, :],
                                 other=0.0).to(tl.float32)
                    f += tl.sum(fb * fa[None, :], axis=1)
            gate = _decay_gate(f + dt, rate, lower_bound, LOWER_BOUND)
            tl.store(g_ptr + out, gate, mask=mask_c)
        b = tl.load(b_ptr + row * b_stride + h).to(tl.float32)
        tl.store(beta_ptr + row * H + h, tl.sigmoid(b))
        slot = tl.load(slots_ptr + row).to(tl.int64)
        _store_conv_state(q_ptr, q_stride, qs_ptr, conv_slot_stride, q_init, cols, row0, chan,
                          mask_c, slot, j, KS)
        _store_conv_state(k_ptr, k_stride, ks_ptr, conv_slot_stride, k_init, cols, row0, chan,
                          mask_c, slot, j, KS)
        _store_conv_state(v_ptr, v_stride, vs_ptr, conv_slot_stride, v_init, cols, row0, chan,
                          mask_c, slot, j, KS)


@triton.jit
def _kda_gate_kernel(
    fa_ptr, fa_stride, fb_ptr, dt_ptr, alog_ptr, g_ptr, rows, lower_bound,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, RANK: tl.constexpr, BR: tl.constexpr,
    BM: tl.constexpr, LOWER_BOUND: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The decay gate of one (head, block of BM rows): ``f = f_a @ f_b[head]^T`` as one
    tensor-core GEMM (the head's f_b slab read once per row block, not once per row)."""
    h = tl.program_id(0)
    rb = tl.program_id(1)
    d = tl.arange(0, BD)
    mask_c = d < D
    chan = h * D + d
    dt = tl.load(dt_ptr + chan, mask=mask_c, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m = rb * BM + tl.arange(0, BM)
    mask_m = m < rows
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for r0 in tl.static_range(0, RANK, BR):
        r = r0 + tl.arange(0, BR)
        mask_r = r < RANK
        fa = tl.load(fa_ptr + m[:, None] * fa_stride + r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        fb = tl.load(fb_ptr + chan[:, None] * RANK + r[None, :],
                     mask=mask_c[:, None] & mask_r[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(fa.to(tl.float32), tl.trans(fb.to(tl.float32)),
                          input_precision="ieee")
        else:
            acc += tl.dot(fa, tl.trans(fb))
    gate = _decay_gate(acc + dt[None, :], rate, lower_bound, LOWER_BOUND)
    tl.store(g_ptr + (m[:, None] * H + h) * D + d[None, :], gate,
             mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def _load_o_norm(onorm_ptr, D: tl.constexpr, BD: tl.constexpr):
    """The output norm's weight [BD] in float32 (zeros past D)."""
    d = tl.arange(0, BD)
    return tl.load(onorm_ptr + d, mask=d < D, other=0.0).to(tl.float32)


@triton.jit
def _gated_out_norm(o_ptr, gate_ptr, gate_stride, gb_ptr, weight, out_ptr, out_stride, eps,
                    row, h, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    GRANK: tl.constexpr, BR: tl.constexpr, LOW_RANK: tl.constexpr,
                    CG: tl.constexpr):
    """Per-head RMSNorm of o times the o_norm ``weight`` (loaded: :func:`_load_o_norm`),
    times sigmoid of the output gate, of one (row, head). ``CG``: o was written by other
    programs of this launch (read through L2)."""
    d = tl.arange(0, BD)
    mask = d < D
    chan = h * D + d
    if CG:
        o = tl.load(o_ptr + (row * H + h) * D + d, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        o = tl.load(o_ptr + (row * H + h) * D + d, mask=mask, other=0.0)
    o = o.to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps) * weight
    if LOW_RANK:
        gate = tl.zeros([BD], dtype=tl.float32)
        for r0 in tl.static_range(0, GRANK, BR):
            r = r0 + tl.arange(0, BR)
            mask_r = r < GRANK
            ga = tl.load(gate_ptr + row * gate_stride + r, mask=mask_r, other=0.0)
            gb = tl.load(gb_ptr + chan[:, None] * GRANK + r[None, :],
                         mask=mask[:, None] & mask_r[None, :], other=0.0)
            gate += tl.sum(gb.to(tl.float32) * ga.to(tl.float32)[None, :], axis=1)
    else:
        gate = tl.load(gate_ptr + row * gate_stride + chan, mask=mask, other=0.0).to(tl.float32)
    out = o * tl.sigmoid(gate)
    tl.store(out_ptr + row * out_stride + chan, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_rule_token(state, q, k, v, g, beta, o_ptrs, mask_v, state_ptr, state_slot_stride,
                      within, mask_s, slots_ptr, row):
    """One token of the delta rule on a [K, V block] state: decay by ``exp(g)``, the update
    ``S += k ((v - S^T k) beta)^T``, ``o = S^T q`` stored at ``o_ptrs``, the state stored to
    the token's row slot (nothing for a negative slot); returns the new state."""
    state = state * tl.exp(g)[:, None]
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=mask_v)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tl.store(state_ptr + slot * state_slot_stride + within, state, mask=mask_s & (slot >= 0))
    return state


@triton.jit
def _kda_recurrent_kernel(
    qn_ptr, kn_ptr, vo_ptr, g_ptr, beta_ptr,
    state_ptr, state_slot_stride,
    slots_ptr, accepted_ptr, o_ptr, scale,
    gate_ptr, gate_stride, gb_ptr, onorm_ptr, out_ptr, out_stride, eps, sem_ptr,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, Q: tl.constexpr,
    USE_PDL: tl.constexpr, OUT_NORM: tl.constexpr, GRANK: tl.constexpr, BR: tl.constexpr,
    LOW_RANK: tl.constexpr, FENCE: tl.constexpr,
):
    """The delta rule of one (request, head, V block) on the float32 state [K, V]. The
    state (only this op writes it) and the slots (step inputs) load before the PDL wait.

    ``OUT_NORM``: each V block of a (request, head) counts itself done once its o is stored
    (counter ``request * H + head`` in ``sem_ptr``); the last one runs the gated output
    norm of the request's rows for that head (:func:`_gated_out_norm`), so no norm launch
    follows, and leaves the counter at zero. ``FENCE``: a GPU fence orders o's stores
    before the counter (off under the interpreter, which runs programs one at a time)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    row0 = n * Q
    dk = tl.arange(0, BD)
    dv = vb * BV + tl.arange(0, BV)
    mask_k = dk < D
    mask_v = dv < D
    mask_s = mask_k[:, None] & mask_v[None, :]
    within = h * D * D + dk[:, None] * D + dv[None, :]
    start = _start_slot(slots_ptr, accepted_ptr, row0, Q)
    state = tl.load(state_ptr + start * state_slot_stride + within, mask=mask_s & (start >= 0),
                    other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for j in tl.static_range(Q):
        row = row0 + j
        base = (row * H + h) * D
        q = tl.load(qn_ptr + base + dk, mask=mask_k, other=0.0).to(tl.float32) * scale
        k = tl.load(kn_ptr + base + dk, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(vo_ptr + base + dv, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + dk, mask=mask_k, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row * H + h).to(tl.float32)
        state = _delta_rule_token(state, q, k, v, g, beta, o_ptr + base + dv, mask_v,
                                  state_ptr, state_slot_stride, within, mask_s, slots_ptr, row)
    if OUT_NORM:  # noqa: SIM102 (a constexpr test apart: Triton folds it at compile time)
        # the last V block of this head to arrive: every other has stored its o
        if arrive(sem_ptr + n * H + h, dv, FENCE) == tl.num_programs(2) - 1:
            weight = _load_o_norm(onorm_ptr, D, BD)
            for j in tl.static_range(Q):
                _gated_out_norm(o_ptr, gate_ptr, gate_stride, gb_ptr, weight, out_ptr,
                                out_stride, eps, row0 + j, h, H, D, BD, GRANK, BR, LOW_RANK,
                                True)
            reset(sem_ptr + n * H + h)


@triton.jit
def _fb_chunk(fb_ptr, chan, mask_c, r, RANK: tl.constexpr):
    """Columns ``r`` of the f_b slab's rows ``chan`` (zeros past RANK)."""
    return tl.load(fb_ptr + chan[:, None] * RANK + r[None, :],
                   mask=mask_c[:, None] & (r < RANK)[None, :], other=0.0)


@triton.jit
def _fb_times_fa(fb, fa_row, r, RANK: tl.constexpr):
    """A loaded f_b chunk (columns ``r``) times the same columns of the f_a row, float32."""
    fa = tl.load(fa_row + r, mask=r < RANK, other=0.0).to(tl.float32)
    return fb.to(tl.float32) * fa[None, :]


@triton.jit
def _kda_prep_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, fa_ptr, b_ptr,
    q_stride, k_stride, v_stride, fa_stride, b_stride,
    qw_ptr, kw_ptr, vw_ptr,
    qs_ptr, ks_ptr, vs_ptr, conv_slot_stride,
    fb_ptr, dt_ptr, alog_ptr,
    state_ptr, state_slot_stride, slots_ptr, o_ptr, scale, lower_bound,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr,
    KW: tl.constexpr, KSP: tl.constexpr, RANK: tl.constexpr, FBC: tl.constexpr,
    LOWER_BOUND: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The prep and the delta rule of one (row, head, V block) of a decode step (q = 1) in
    one program: the work of :func:`_kda_prep_kernel` (q and k of the whole head, v of the
    V block, the head's decay gate from its f_b slab, beta) straight into
    :func:`_kda_recurrent_kernel`'s update, without the float32 scratch between them. Each V
    block of a head recomputes the head's q, k and gate. The conv states are only read here
    (every V block reads the head's q and k states, so none may write them before all have
    read): the output norm launch after writes them (``CONV``). Before the PDL wait: the
    state, the conv states and weights, the f_b slab (RANK <= FB_PRE_RANK), the slot."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, BD)
    dv = vb * BV + tl.arange(0, BV)
    mask_k = dk < D
    mask_v = dv < D
    mask_s = mask_k[:, None] & mask_v[None, :]
    chan_k = h * D + dk
    chan_v = h * D + dv
    within = h * D * D + dk[:, None] * D + dv[None, :]
    cols = tl.arange(0, KW)
    taps = tl.arange(0, KSP)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    state = tl.load(state_ptr + slot * state_slot_stride + within, mask=mask_s & (slot >= 0),
                    other=0.0).to(tl.float32)
    q_init, k_init, v_init, q_w, k_w, v_w = _load_conv_operands(
        qs_ptr, ks_ptr, vs_ptr, qw_ptr, kw_ptr, vw_ptr, conv_slot_stride, slot, chan_k, mask_k,
        chan_v, mask_v, cols, taps, KS)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt = tl.load(dt_ptr + chan_k, mask=mask_k, other=0.0).to(tl.float32)
    # the f_b slab as four [D, FBC] column chunks (4 FBC = FB_PRE_RANK >= RANK): one slab
    # tile would give the state its layout, four times wider than a 32-wide V block
    r_c = tl.arange(0, FBC)
    fb0 = _fb_chunk(fb_ptr, chan_k, mask_k, r_c, RANK)
    fb1 = _fb_chunk(fb_ptr, chan_k, mask_k, FBC + r_c, RANK)
    fb2 = _fb_chunk(fb_ptr, chan_k, mask_k, 2 * FBC + r_c, RANK)
    fb3 = _fb_chunk(fb_ptr, chan_k, mask_k, 3 * FBC + r_c, RANK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = _conv_silu(q_ptr, q_stride, q_w, taps, q_init, cols, row, chan_k, mask_k, 0, KS, BD)
    k = _conv_silu(k_ptr, k_stride, k_w, taps, k_init, cols, row, chan_k, mask_k, 0, KS, BD)
    v = _conv_silu(v_ptr, v_stride, v_w, taps, v_init, cols, row, chan_v, mask_v, 0, KS, BV)
    q = _l2_normalized(q) * scale
    k = _l2_normalized(k)
    fa_row = fa_ptr + row * fa_stride
    f = tl.sum(_fb_times_fa(fb0, fa_row, r_c, RANK)
               + _fb_times_fa(fb1, fa_row, FBC + r_c, RANK)
               + _fb_times_fa(fb2, fa_row, 2 * FBC + r_c, RANK)
               + _fb_times_fa(fb3, fa_row, 3 * FBC + r_c, RANK), axis=1)
    g = _decay_gate(f + dt, rate, lower_bound, LOWER_BOUND)
    beta = tl.sigmoid(tl.load(b_ptr + row * b_stride + h).to(tl.float32))
    _delta_rule_token(state, q, k, v, g, beta, o_ptr + (row * H + h) * D + dv, mask_v,
                      state_ptr, state_slot_stride, within, mask_s, slots_ptr, row)


@triton.jit
def _kda_out_norm_kernel(
    o_ptr, gate_ptr, gate_stride, gb_ptr, onorm_ptr, out_ptr, out_stride, eps,
    q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, qs_ptr, ks_ptr, vs_ptr,
    conv_slot_stride, slots_ptr,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, GRANK: tl.constexpr,
    BR: tl.constexpr, LOW_RANK: tl.constexpr, CONV: tl.constexpr, KS: tl.constexpr,
    KW: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The gated output norm (:func:`_gated_out_norm`) of one (row, head); its weight
    loads before the PDL wait. ``CONV`` (after :func:`_kda_prep_recurrent_kernel`, one row a
    request): also the conv states of the row's slot after its token, for the head's q, k
    and v channels, read before the wait (the inputs and the old states: the launch before
    only reads them) and written after it (once that launch is done with them)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    weight = _load_o_norm(onorm_ptr, D, BD)
    if CONV:
        d = tl.arange(0, BD)
        mask_c = d < D
        chan = h * D + d
        cols = tl.arange(0, KW)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        q_init = _load_conv_state(qs_ptr, conv_slot_stride, slot, chan, mask_c, cols, KS)
        k_init = _load_conv_state(ks_ptr, conv_slot_stride, slot, chan, mask_c, cols, KS)
        v_init = _load_conv_state(vs_ptr, conv_slot_stride, slot, chan, mask_c, cols, KS)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _gated_out_norm(o_ptr, gate_ptr, gate_stride, gb_ptr, weight, out_ptr, out_stride, eps,
                    row, h, H, D, BD, GRANK, BR, LOW_RANK, False)
    if CONV:
        _store_conv_state(q_ptr, q_stride, qs_ptr, conv_slot_stride, q_init, cols, row, chan,
                          mask_c, slot, 0, KS)
        _store_conv_state(k_ptr, k_stride, ks_ptr, conv_slot_stride, k_init, cols, row, chan,
                          mask_c, slot, 0, KS)
        _store_conv_state(v_ptr, v_stride, vs_ptr, conv_slot_stride, v_init, cols, row, chan,
                          mask_c, slot, 0, KS)


# ---------------------------------------------------------------------------- launchers


def launch_prep(q, k, v, f_a, b, conv_weights, conv_states, f_b, dt_bias, a_log, slots,
                accepted, outs, *, heads: int, head_dim: int, q_len: int, gate_form: str,
                lower_bound: float | None, fla_slots=None, fla_accepted=None,
                gate: bool = True, pdl: bool = False) -> None:
    """Enqueue the prep kernel. ``q, k, v, f_a, b``: [rows, width] with unit column stride;
    ``outs``: (q, k, v, g [rows, H, D], beta [rows, H]) float32 contiguous; ``fla_slots`` /
    ``fla_accepted``: also write fla-core's slot table (negative slots -> the last slot);
    ``gate``: compute the decay gate here (else :func:`launch_gate` does)."""
    rows = q.shape[0]
    kernel_size = conv_weights[0].shape[1]
    rank = f_b.shape[1]
    qn, kn, vo, g, beta = outs
    fla = fla_slots is not None
    scratch = conv_states[0].shape[0] - 1
    use_pdl = pdl_flag(pdl)
    fb_pre = rank <= FB_PRE_RANK
    _kda_prep_kernel[(rows // q_len, heads)](
        q, k, v, f_a, b,
        q.stride(0), k.stride(0), v.stride(0), f_a.stride(0), b.stride(0),
        *conv_weights, *conv_states, conv_states[0].stride(0),
        f_b, dt_bias, a_log,
        slots, accepted if accepted is not None else slots,
        qn, kn, vo, g, beta,
        fla_slots if fla else slots, fla_accepted if fla_accepted is not None else slots,
        scratch,
        float(lower_bound) if lower_bound is not None else 0.0,
        H=heads, D=head_dim, BD=triton.next_power_of_2(head_dim), KS=kernel_size,
        KW=triton.next_power_of_2(max(kernel_size - 1, 1)),
        KSP=triton.next_power_of_2(kernel_size), RANK=rank,
        BR=triton.next_power_of_2(rank) if fb_pre else min(32, triton.next_power_of_2(rank)),
        Q=q_len, LOWER_BOUND=gate_form == "lower_bound", GATE=gate, FB_PRE=fb_pre, FLA=fla,
        USE_PDL=use_pdl,
        num_warps=8 if fb_pre else 4, launch_pdl=use_pdl,  # 8: the f_b slab without spills
    )


def launch_gate(f_a, f_b, dt_bias, a_log, g, *, heads: int, head_dim: int, gate_form: str,
                lower_bound: float | None, dot_f32: bool, block_m: int = 64,
                pdl: bool = False) -> None:
    """Enqueue the gate kernel: ``f_a`` [rows, rank] with unit column stride, ``f_b``
    [H*D, rank] contiguous, ``g`` [rows, H, D] float32 contiguous."""
    rows, rank = f_a.shape
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    use_pdl = pdl_flag(pdl)
    _kda_gate_kernel[(heads, triton.cdiv(rows, block_m))](
        f_a, f_a.stride(0), f_b, dt_bias, a_log, g, rows,
        float(lower_bound) if lower_bound is not None else 0.0,
        H=heads, D=head_dim, BD=triton.next_power_of_2(head_dim), RANK=rank,
        BR=min(32, max(16, triton.next_power_of_2(rank))), BM=block_m,
        LOWER_BOUND=gate_form == "lower_bound", DOT_F32=dot_f32, USE_PDL=use_pdl,
        num_warps=4, launch_pdl=use_pdl,
    )


def launch_recurrent(qn, kn, vo, g, beta, state, slots, accepted, o, *, heads: int,
                     head_dim: int, q_len: int, block_v: int = 32, num_warps: int = 4,
                     out_norm: OutNorm | None = None, pdl: bool = False) -> None:
    """Enqueue the delta-rule kernel: ``state`` [S, H, D, D] float32 contiguous, updated in
    place; ``o`` [rows, H, D] contiguous (float32 keeps the most precision). With
    ``out_norm`` the kernel's last V block of each head also writes the gated output norm
    (see :func:`launch_out_norm` for its tensors)."""
    rows = qn.shape[0]
    block_v = min(block_v, triton.next_power_of_2(head_dim))
    use_pdl = pdl_flag(pdl)
    grid = (rows // q_len, heads, triton.cdiv(head_dim, block_v))
    if out_norm is None:  # stand-ins the kernel never reads
        norm_args, norm_shape = _norm_operands(o, None, o, o, 0.0)
        sem = slots
    else:
        norm_args, norm_shape = _norm_operands(out_norm.gate, out_norm.g_b, out_norm.o_norm,
                                               out_norm.out, out_norm.eps)
        sem = out_norm.sem
    _kda_recurrent_kernel[grid](
        qn, kn, vo, g, beta, state, state.stride(0),
        slots, accepted if accepted is not None else slots, o, head_dim**-0.5,
        *norm_args, sem,
        H=heads, D=head_dim, BD=triton.next_power_of_2(head_dim), BV=block_v, Q=q_len,
        USE_PDL=use_pdl, OUT_NORM=out_norm is not None, FENCE=not interpreting(),
        num_warps=num_warps, launch_pdl=use_pdl, **norm_shape,
    )


def launch_prep_recurrent(q, k, v, f_a, b, conv_weights, conv_states, f_b, dt_bias, a_log,
                          state, slots, o, *, heads: int, head_dim: int, gate_form: str,
                          lower_bound: float | None, block_v: int = 32, num_warps: int = 4,
                          pdl: bool = False) -> None:
    """Enqueue the prep and the recurrence of a decode step (one row a request) as one
    kernel (:func:`_kda_prep_recurrent_kernel`; f_b's rank at most ``FB_PRE_RANK``):
    operands as :func:`launch_prep` and :func:`launch_recurrent` take them. It leaves the
    conv states as they were: :func:`launch_out_norm` with ``conv`` writes them after."""
    rank = f_b.shape[1]
    if rank > FB_PRE_RANK:
        raise ValueError(f"the one-launch prep holds f_b's rank whole: {rank} > {FB_PRE_RANK}")
    kernel_size = conv_weights[0].shape[1]
    block_v = min(block_v, triton.next_power_of_2(head_dim))
    use_pdl = pdl_flag(pdl)
    _kda_prep_recurrent_kernel[(q.shape[0], heads, triton.cdiv(head_dim, block_v))](
        q, k, v, f_a, b,
        q.stride(0), k.stride(0), v.stride(0), f_a.stride(0), b.stride(0),
        *conv_weights, *conv_states, conv_states[0].stride(0),
        f_b, dt_bias, a_log, state, state.stride(0), slots, o, head_dim**-0.5,
        float(lower_bound) if lower_bound is not None else 0.0,
        H=heads, D=head_dim, BD=triton.next_power_of_2(head_dim), BV=block_v, KS=kernel_size,
        KW=triton.next_power_of_2(max(kernel_size - 1, 1)),
        KSP=triton.next_power_of_2(kernel_size), RANK=rank, FBC=FB_PRE_RANK // 4,
        LOWER_BOUND=gate_form == "lower_bound", USE_PDL=use_pdl,
        num_warps=num_warps, launch_pdl=use_pdl,
    )

def _norm_operands(gate, g_b, o_norm, out, eps: float) -> tuple[tuple, dict]:
    """The gated output norm's kernel arguments after ``o`` (gate, its row stride, g_b or
    a stand-in, o_norm, out, its row stride, eps) and its constants (GRANK, BR,
    LOW_RANK)."""
    low_rank = g_b is not None
    grank = g_b.shape[1] if low_rank else 1
    return ((gate, gate.stride(0), g_b if low_rank else o_norm, o_norm, out, out.stride(0),
             float(eps)),
            dict(GRANK=grank, BR=min(32, triton.next_power_of_2(grank)), LOW_RANK=low_rank))


class OutNorm:
    """The gated output norm's tensors when the recurrence runs it (see
    :func:`launch_out_norm`), with the per-(request, head) counters it needs (zeroed
    scratch, left at zero by every launch)."""

    def __init__(self, gate, g_b, o_norm, out, *, requests: int, heads: int,
                 eps: float) -> None:
        self.gate, self.g_b, self.o_norm, self.out = gate, g_b, o_norm, out
        self.eps = float(eps)
        self.sem = scratch(out.device, "kda.out_norm_sem", requests * heads, torch.int32,
                           zeroed=True)


def launch_out_norm(o, gate, g_b, o_norm, out, *, heads: int, head_dim: int, eps: float,
                    conv: ConvUpdate | None = None, pdl: bool = False) -> None:
    """Enqueue the gated RMSNorm: ``o`` [rows, H, D] contiguous; ``gate`` [rows, H*D] (full)
    or [rows, rank] with ``g_b`` [H*D, rank] (low rank), unit column stride; ``out`` [rows,
    H*D] with unit column stride. ``conv``: also write the conv states after each row's
    token (after :func:`launch_prep_recurrent`, one row a request)."""
    use_pdl = pdl_flag(pdl)
    norm_args, norm_shape = _norm_operands(gate, g_b, o_norm, out, eps)
    conv_args, conv_shape = ConvUpdate.kernel_args(conv, o)
    _kda_out_norm_kernel[(o.shape[0], heads)](
        o, *norm_args, *conv_args, H=heads, D=head_dim, BD=triton.next_power_of_2(head_dim),
        USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl, **norm_shape, **conv_shape,
    )


class ConvUpdate:
    """The conv-state update :func:`launch_out_norm` runs after the one-launch prep: the
    raw q, k, v rows [rows, width] (unit column stride), the three conv states [S, width,
    KS - 1], the rows' slots."""

    def __init__(self, inputs, states, slots) -> None:
        self.inputs = tuple(inputs)
        self.states = tuple(states)
        self.slots = slots

    @staticmethod
    def kernel_args(update: ConvUpdate | None, stand_in) -> tuple[tuple, dict]:
        """The norm kernel's conv arguments after its norm operands (q, k, v, their row
        strides, the three states, their slot stride, the slots) and its constants (CONV,
        KS, KW); without an update, stand-ins (``stand_in``) the kernel never reads."""
        if update is None:
            return (stand_in,) * 3 + (0,) * 3 + (stand_in,) * 3 + (0, stand_in), dict(
                CONV=False, KS=2, KW=1)
        q, k, v = update.inputs
        kernel_size = int(update.states[0].shape[2]) + 1
        args = (q, k, v, q.stride(0), k.stride(0), v.stride(0), *update.states,
                update.states[0].stride(0), update.slots)
        return args, dict(CONV=True, KS=kernel_size,
                          KW=triton.next_power_of_2(max(kernel_size - 1, 1)))
