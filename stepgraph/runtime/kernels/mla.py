"""Triton kernels of MLA decode in the absorbed form over a paged latent cache, in three
launches.

1. :func:`_mla_cache_write_kernel`, one program per row: the row's new latent
   ``[RMSNorm(kv_a[:lora]) * w | kv_a[lora:]]`` (the rope part rotated at ``positions`` when
   the model has rope; raw for NoPE) written to the cache at ``slot_mapping`` (block ``slot //
   BS``, offset ``slot % BS``); a negative slot writes nothing. It runs before the attention so
   that every row of a verify step sees the rows of its request written before it.
2. :func:`_mla_partial_kernel`, one program per (head block, row, split): the split's share of
   the row's first ``seq_lens`` tokens (token t at block ``block_tables[r, t // BS]``; a
   negative block is skipped), ``q . k`` over the whole 576-wide latent (nope + rope parts),
   an online softmax in base 2, the attended first ``lora`` columns; writes the partial
   output [R, H, splits, lora] (float32) and its LSE [R, H, splits] (-inf when empty).
3. :func:`_mla_merge_kernel`, one program per (row, head): the LSE merge of the splits into
   ``o_latent`` [R, H, lora] (zeros for a row with no token), and with ``lse`` (DCP) the
   merged LSE of this rank's tokens (-inf when none), which the cross-rank merge needs.

The query and value sides (provider ``triton`` of ``mla_query`` / ``mla_value``):
:class:`~stepgraph.runtime.kernels.elementwise.RmsNorm` (q_a's RMSNorm, where its rows are
stored), :func:`_mla_absorb_kernel` (``q_nope @ W_UK`` per head, and the rope part, rotated
when the model has rope, into q_latent) and :func:`_mla_value_kernel` (``o_latent @ W_UV^T``
per head times sigmoid of the output gate).

DSA (provider ``triton_sparse`` of ``dsa_core``): :func:`_dsa_key_write_kernel` (the indexer
key: LayerNorm, rope, written to the key cache), :func:`_dsa_index_kernel` (the lightning
indexer's scores over the row's tokens), a torch top-k, then the partial kernel in its
``SPARSE`` form over the selected tokens and the same merge.

Semantics follow :mod:`stepgraph.lower.ref_mla` (the numerical ground truth).
``DOT_F32`` feeds ``tl.dot`` float32 operands at IEEE precision (the interpreter's BF16 dot is
wrong in Triton 3.6, and float32 caches want full precision, not TF32); on the GPU with BF16
caches the dots run in BF16 with float32 accumulation. ``USE_PDL``: wait on the predecessor
grid before touching anything a predecessor writes, then let dependents launch (off under the
interpreter).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from stepgraph.runtime.kernels.launch_utils import interpreting, next_pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MERGE_TILE = 4096  # float32 partials one merge program loads at once (splits x columns)
# W_UV in one slab before the PDL wait up to this row block (a [16, lora] row tile and a
# [16, lora] slab: 88 registers at 4 warps for K3's 512-wide latent); V rows a program
# then. k3-rank-tp8 B=1 (scripts/ab_replay.py, 2026-12-01, sixteenth session): the chunk
# loop after the wait 1473.6-1476.4 us, the slab with 32 V rows 1471.3-1473.5, with 16
# 1471.9-1472.2.
ONE_SHOT_ROWS = 16
ONE_SHOT_BLOCK_V = 16
ONE_SHOT_LATENT = 512  # widest latent the slab form takes (registers measured at 512)


def pdl_flag(requested: bool) -> bool:
    """PDL on when the launch asks for it (the caller checked the device) and a real GPU
    runs the kernel, not the interpreter."""
    return bool(requested) and not interpreting()


@triton.jit
def _mma(a, b, DOT_F32: tl.constexpr):
    """``tl.dot(a, b)``: float32 operands at full (IEEE) precision when ``DOT_F32``, else
    the operands as they are (BF16 on the tensor cores, float32 accumulation)."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _slot_address(slot_ptr, row, cache_ptr, block_stride, token_stride, block_size):
    """Where row ``row`` writes in a paged cache: the start of its slot's entry, and
    whether it writes at all (a negative slot, a padded row, writes nothing; its address is
    slot 0's, masked off)."""
    slot = tl.load(slot_ptr + row).to(tl.int64)
    keep = slot >= 0
    safe = tl.where(keep, slot, 0)
    return (cache_ptr + (safe // block_size) * block_stride
            + (safe % block_size) * token_stride), keep


@triton.jit
def _mla_cache_write_kernel(
    kv_ptr, kv_stride, norm_ptr, cache_ptr, cache_block_stride, cache_token_stride,
    slot_ptr, pos_ptr, block_size, eps, log_theta,
    LORA: tl.constexpr, BL: tl.constexpr, ROPE: tl.constexpr, BP: tl.constexpr,
    HAS_ROPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Normalize one row's kv_a latent and write it with its rope part at its slot."""
    row = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base, keep = _slot_address(slot_ptr, row, cache_ptr, cache_block_stride,
                               cache_token_stride, block_size)
    d = tl.arange(0, BL)
    mask = d < LORA
    x = tl.load(kv_ptr + row * kv_stride + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / LORA + eps) * w
    tl.store(base + d, y.to(cache_ptr.dtype.element_ty), mask=mask & keep)
    if ROPE > 0:
        p = tl.arange(0, BP)
        mask_p = p < ROPE
        pe = tl.load(kv_ptr + row * kv_stride + LORA + p, mask=mask_p, other=0.0).to(tl.float32)
        if HAS_ROPE:
            half = ROPE // 2
            partner = tl.load(kv_ptr + row * kv_stride + LORA + (p + half) % ROPE, mask=mask_p,
                              other=0.0).to(tl.float32)
            rotated = tl.where(p < half, -partner, partner)
            position = tl.load(pos_ptr + row).to(tl.float32)
            inv_freq = tl.exp(-((2 * (p % half)).to(tl.float32) / ROPE) * log_theta)
            angle = position * inv_freq
            pe = pe * tl.cos(angle) + rotated * tl.sin(angle)
        tl.store(base + LORA + p, pe.to(cache_ptr.dtype.element_ty), mask=mask_p & keep)


@triton.jit
def _mla_partial_kernel(
    q_ptr, q_row_stride, q_head_stride,
    cache_ptr, cache_block_stride, cache_token_stride,
    table_ptr, table_stride, table_width, seq_ptr,
    po_ptr, plse_ptr, scale_log2, block_size, pick_ptr, pick_stride, picks,
    H: tl.constexpr, LORA: tl.constexpr, BL: tl.constexpr, ROPE: tl.constexpr,
    BP: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
    SPARSE: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Attention of one (head block, row) over one split of the row's cached tokens (the
    head blocks of a row and split are adjacent programs: they share the row's K tiles in
    L2). ``SPARSE``: the tokens are the row's ``picks`` entries of ``pick_ptr`` (DSA's top-k
    selection, any order), each kept when it is one of the row's first ``seq_lens``."""
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.load(seq_ptr + b)
    items = picks if SPARSE else seq
    per = tl.cdiv(tl.cdiv(items, SPLITS), BN) * BN
    lo = split * per
    hi = tl.minimum(lo + per, items)
    heads = hb * BH + tl.arange(0, BH)
    mask_h = heads < H
    dl = tl.arange(0, BL)
    mask_l = dl < LORA
    q_rows = q_ptr + b.to(tl.int64) * q_row_stride + heads[:, None] * q_head_stride
    q = tl.load(q_rows + dl[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    if ROPE > 0:
        dp = tl.arange(0, BP)
        mask_p = dp < ROPE
        q_pe = tl.load(q_rows + LORA + dp[None, :], mask=mask_h[:, None] & mask_p[None, :],
                       other=0.0)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BL], dtype=tl.float32)
    table = table_ptr + b.to(tl.int64) * table_stride
    for start in range(lo, hi, BN):
        item = start + tl.arange(0, BN)
        if SPARSE:
            t = tl.load(pick_ptr + b.to(tl.int64) * pick_stride + item, mask=item < hi,
                        other=-1).to(tl.int32)
            mask_t = (item < hi) & (t >= 0) & (t < seq)
            t = tl.where(mask_t, t, 0)
        else:
            t = item
            mask_t = t < hi
        entry = tl.minimum(t // block_size, table_width - 1)
        block = tl.load(table + entry, mask=mask_t, other=-1).to(tl.int64)
        valid = mask_t & (block >= 0)
        token = (tl.where(valid, block, 0) * cache_block_stride
                 + (t % block_size).to(tl.int64) * cache_token_stride)
        kv = tl.load(cache_ptr + token[:, None] + dl[None, :],
                     mask=valid[:, None] & mask_l[None, :], other=0.0)
        scores = _mma(q, tl.trans(kv), DOT_F32)
        if ROPE > 0:
            k_pe = tl.load(cache_ptr + token[:, None] + LORA + dp[None, :],
                           mask=valid[:, None] & mask_p[None, :], other=0.0)
            scores += _mma(q_pe, tl.trans(k_pe), DOT_F32)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mma(p.to(kv.dtype), kv, DOT_F32)
        m_i = m_new
    filled = l_i > 0.0
    denom = tl.where(filled, l_i, 1.0)
    out = acc / denom[:, None]
    lse = tl.where(filled, (m_i + tl.log2(denom)) * 0.6931471805599453, float("-inf"))
    slot = (b.to(tl.int64) * H + heads) * SPLITS + split
    tl.store(po_ptr + slot[:, None] * LORA + dl[None, :], out,
             mask=mask_h[:, None] & mask_l[None, :])
    tl.store(plse_ptr + slot, lse, mask=mask_h)


@triton.jit
def _mla_merge_kernel(
    po_ptr, plse_ptr, out_ptr, out_row_stride, out_head_stride, lse_ptr, lse_row_stride,
    H: tl.constexpr, LORA: tl.constexpr, BLC: tl.constexpr, SPLITS: tl.constexpr,
    BSP: tl.constexpr, HAS_LSE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The LSE merge of one (row, head)'s splits over ``BLC`` latent columns (and its merged
    LSE when asked, by the first column block): every split's partial is one [BSP, BLC]
    tile load, so the splits' loads are all in flight at once."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    lb = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    first = (b.to(tl.int64) * H + h) * SPLITS
    sp = tl.arange(0, BSP)
    dl = lb * BLC + tl.arange(0, BLC)
    mask_l = dl < LORA
    mask_s = sp < SPLITS
    lses = tl.load(plse_ptr + first + sp, mask=mask_s, other=float("-inf"))
    parts = tl.load(po_ptr + (first + sp)[:, None] * LORA + dl[None, :],
                    mask=mask_s[:, None] & mask_l[None, :], other=0.0)
    m = tl.max(lses, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.exp(lses - m_safe)
    total = tl.sum(weights, axis=0)
    acc = tl.sum(parts * weights[:, None], axis=0)
    filled = total > 0.0
    out = acc / tl.where(filled, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * out_row_stride + h * out_head_stride + dl,
             out.to(out_ptr.dtype.element_ty), mask=mask_l)
    if HAS_LSE:  # noqa: SIM102 (the constexpr test apart: Triton folds it at compile time)
        if lb == 0:
            lse = tl.where(filled, m_safe + tl.log(tl.where(filled, total, 1.0)),
                           float("-inf"))
            tl.store(lse_ptr + b.to(tl.int64) * lse_row_stride + h, lse)


# ---------------------------------------------------------------------------- DSA indexer


@triton.jit
def _rope_pairs(x, partner, lane, position, log_theta, ROPE: tl.constexpr):
    """Rotate-half rope of the lanes below ``ROPE`` (``partner``: the value at lane ``(lane +
    ROPE/2) % ROPE``); lanes at or above ``ROPE`` pass through. ``position`` broadcasts."""
    half = ROPE // 2
    rotated = tl.where(lane < half, -partner, partner)
    inv_freq = tl.exp(-((2 * (lane % half)).to(tl.float32) / ROPE) * log_theta)
    angle = position * inv_freq
    return tl.where(lane < ROPE, x * tl.cos(angle) + rotated * tl.sin(angle), x)


@triton.jit
def _dsa_key_write_kernel(
    k_ptr, k_stride, w_ptr, bias_ptr, kc_ptr, kc_block_stride, kc_token_stride, slot_ptr,
    pos_ptr, block_size, log_theta,
    ID: tl.constexpr, BID: tl.constexpr, ROPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The indexer key of one row: LayerNorm(index_k) (eps 1e-6), its first ``ROPE`` dims
    rotated, written to the key cache at the row's slot (nothing for a negative slot)."""
    row = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base, keep = _slot_address(slot_ptr, row, kc_ptr, kc_block_stride, kc_token_stride,
                               block_size)
    d = tl.arange(0, BID)
    mask = d < ID
    x = tl.load(k_ptr + row * k_stride + d, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / ID
    rstd = tl.rsqrt(tl.sum(tl.where(mask, (x - mean) * (x - mean), 0.0), axis=0) / ID + 1e-6)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=mask, other=0.0).to(tl.float32)
    y = (x - mean) * rstd * w + bias
    if ROPE > 0:
        pd = tl.where(d < ROPE, (d + ROPE // 2) % ROPE, d)
        xp = tl.load(k_ptr + row * k_stride + pd, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + pd, mask=mask, other=0.0).to(tl.float32)
        bp = tl.load(bias_ptr + pd, mask=mask, other=0.0).to(tl.float32)
        partner = (xp - mean) * rstd * wp + bp
        position = tl.load(pos_ptr + row).to(tl.float32)
        y = _rope_pairs(y, partner, d, position, log_theta, ROPE)
    tl.store(base + d, y.to(kc_ptr.dtype.element_ty), mask=mask & keep)


@triton.jit
def _dsa_index_kernel(
    iq_ptr, iq_row_stride, iq_head_stride, iw_ptr, iw_stride,
    kc_ptr, kc_block_stride, kc_token_stride, table_ptr, table_stride, table_width, seq_ptr,
    pos_ptr, scores_ptr, scores_stride, block_size, capacity, log_theta, key_scale,
    weight_scale,
    IH: tl.constexpr, BIH: tl.constexpr, ID: tl.constexpr, BID: tl.constexpr,
    ROPE: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Lightning-indexer scores of one (token block, row): ``sum_h w_h relu(q_h . k_t /
    sqrt(d))`` with ``w = index_w / sqrt(heads)``, -inf beyond the row's tokens. The query
    (float32 after rope) enters the BF16 dot as a high + low pair, so the scores keep float32
    precision (they decide the top-k)."""
    tb = tl.program_id(0)
    b = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.load(seq_ptr + b)
    t = tb * BN + tl.arange(0, BN)
    in_row = t < seq
    h = tl.arange(0, BIH)
    mask_h = h < IH
    d = tl.arange(0, BID)
    mask_d = d < ID
    q_rows = iq_ptr + b.to(tl.int64) * iq_row_stride + h[:, None] * iq_head_stride
    mask_q = mask_h[:, None] & mask_d[None, :]
    q = tl.load(q_rows + d[None, :], mask=mask_q, other=0.0).to(tl.float32)
    if ROPE > 0:
        pd = tl.where(d < ROPE, (d + ROPE // 2) % ROPE, d)
        partner = tl.load(q_rows + pd[None, :], mask=mask_q, other=0.0).to(tl.float32)
        position = tl.load(pos_ptr + b).to(tl.float32)
        q = _rope_pairs(q, partner, d[None, :], position, log_theta, ROPE)
    entry = tl.minimum(t // block_size, table_width - 1)
    block = tl.load(table_ptr + b.to(tl.int64) * table_stride + entry, mask=in_row,
                    other=-1).to(tl.int64)
    valid = in_row & (block >= 0)
    token = (tl.where(valid, block, 0) * kc_block_stride
             + (t % block_size).to(tl.int64) * kc_token_stride)
    keys = tl.load(kc_ptr + token[:, None] + d[None, :], mask=valid[:, None] & mask_d[None, :],
                   other=0.0)
    if DOT_F32:
        dots = _mma(q, tl.trans(keys), DOT_F32)
    else:
        q_hi = q.to(keys.dtype)
        q_lo = (q - q_hi.to(tl.float32)).to(keys.dtype)
        dots = tl.dot(q_hi, tl.trans(keys)) + tl.dot(q_lo, tl.trans(keys))
    weight = tl.load(iw_ptr + b.to(tl.int64) * iw_stride + h, mask=mask_h,
                     other=0.0).to(tl.float32) * weight_scale
    scores = tl.sum(tl.maximum(dots * key_scale, 0.0) * weight[:, None], axis=0)
    scores = tl.where(valid, scores, float("-inf"))
    tl.store(scores_ptr + b.to(tl.int64) * scores_stride + t, scores, mask=t < capacity)


# ---------------------------------------------------------------------------- launchers


def launch_cache_write(kv_a, norm, cache, slot_mapping, positions, *, lora: int, eps: float,
                       rope_theta: float | None, pdl: bool = False) -> None:
    """Enqueue the cache write: ``kv_a`` [rows, lora + rope] with unit column stride,
    ``cache`` [NB, BS, lora + rope] with unit last stride, ``slot_mapping`` [rows] int64."""
    rows = kv_a.shape[0]
    rope = cache.shape[2] - lora
    use_pdl = pdl_flag(pdl)
    has_rope = rope_theta is not None and rope > 0
    _mla_cache_write_kernel[(rows,)](
        kv_a, kv_a.stride(0), norm, cache, cache.stride(0), cache.stride(1), slot_mapping,
        positions if positions is not None else slot_mapping, cache.shape[1], float(eps),
        math.log(rope_theta) if has_rope else 0.0,
        LORA=lora, BL=next_pow2(lora), ROPE=rope, BP=next_pow2(max(rope, 1)),
        HAS_ROPE=has_rope, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )


def launch_partial(q_latent, cache, block_tables, seq_lens, partial_o, partial_lse, *,
                   lora: int, softmax_scale: float, splits: int, block_h: int = 16,
                   block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
                   dot_f32: bool = False, picks=None, pdl: bool = False) -> None:
    """Enqueue the split-KV partial attention: ``q_latent`` [rows, H, lora + rope] with unit
    last stride; ``partial_o`` [rows, H, splits, lora] and ``partial_lse`` [rows, H, splits]
    float32 contiguous; ``picks`` [rows, k] (unit last stride): attend only over those
    token indices (DSA)."""
    rows, heads, width = q_latent.shape
    rope = width - lora
    use_pdl = pdl_flag(pdl)
    grid = (triton.cdiv(heads, block_h), rows, splits)
    _mla_partial_kernel[grid](
        q_latent, q_latent.stride(0), q_latent.stride(1),
        cache, cache.stride(0), cache.stride(1),
        block_tables, block_tables.stride(0), block_tables.shape[1], seq_lens,
        partial_o, partial_lse, float(softmax_scale) * LOG2E, cache.shape[1],
        picks if picks is not None else seq_lens, picks.stride(0) if picks is not None else 0,
        picks.shape[1] if picks is not None else 0,
        H=heads, LORA=lora, BL=max(16, next_pow2(lora)), ROPE=rope,
        BP=max(16, next_pow2(rope)), BH=block_h, BN=block_n, SPLITS=splits,
        SPARSE=picks is not None, DOT_F32=dot_f32, USE_PDL=use_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
    )


def launch_merge(partial_o, partial_lse, out, lse, *, pdl: bool = False) -> None:
    """Enqueue the LSE merge into ``out`` [rows, H, lora] (unit last stride) and, when given,
    ``lse`` [rows, H] float32 (unit last stride)."""
    rows, heads, splits, lora = partial_o.shape
    use_pdl = pdl_flag(pdl)
    bsp = next_pow2(splits)
    block_l = min(next_pow2(lora), max(16, MERGE_TILE // bsp))
    _mla_merge_kernel[(rows, heads, triton.cdiv(lora, block_l))](
        partial_o, partial_lse, out, out.stride(0), out.stride(1),
        lse if lse is not None else partial_lse, lse.stride(0) if lse is not None else 0,
        H=heads, LORA=lora, BLC=block_l, SPLITS=splits, BSP=bsp,
        HAS_LSE=lse is not None, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )


# ---------------------------------------------------------------------------- query / value


@triton.jit
def _mla_absorb_kernel(
    q_ptr, q_stride, kvb_ptr, pos_ptr, out_ptr, out_row_stride, out_head_stride, rows,
    log_theta,
    NOPE: tl.constexpr, BNOPE: tl.constexpr, ROPE: tl.constexpr, BP: tl.constexpr,
    V: tl.constexpr, LORA: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
    HAS_ROPE: tl.constexpr, DOT_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """q_latent[r, h] = [q_nope[r, h] @ W_UK[h] | q_pe[r, h] (rotated when rope)] for one
    (head, latent column block, row block); the rope part by the column block 0."""
    h = tl.program_id(0)
    cb = tl.program_id(1)
    rb = tl.program_id(2)
    c = cb * BC + tl.arange(0, BC)
    mask_c = c < LORA
    n = tl.arange(0, BNOPE)
    mask_n = n < NOPE
    w = tl.load(kvb_ptr + (h * (NOPE + V) + n[:, None]).to(tl.int64) * LORA + c[None, :],
                mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # W_UK[h] [nope, BC]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = rb * BR + tl.arange(0, BR)
    mask_r = r < rows
    q_head = q_ptr + r[:, None].to(tl.int64) * q_stride + h * (NOPE + ROPE)
    q_nope = tl.load(q_head + n[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    absorbed = _mma(q_nope, w, DOT_F32)
    out_rows = out_ptr + r[:, None].to(tl.int64) * out_row_stride + h * out_head_stride
    tl.store(out_rows + c[None, :], absorbed.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_c[None, :])
    if ROPE > 0:  # written by the programs of column block 0 (the mask)
        p = tl.arange(0, BP)
        mask_p = p < ROPE
        mask = mask_r[:, None] & mask_p[None, :] & (cb == 0)
        pe = tl.load(q_head + NOPE + p[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            half = ROPE // 2
            partner = tl.load(q_head + NOPE + ((p + half) % ROPE)[None, :], mask=mask,
                              other=0.0).to(tl.float32)
            rotated = tl.where(p[None, :] < half, -partner, partner)
            position = tl.load(pos_ptr + r, mask=mask_r, other=0).to(tl.float32)
            inv_freq = tl.exp(-((2 * (p % half)).to(tl.float32) / ROPE) * log_theta)
            angle = position[:, None] * inv_freq[None, :]
            pe = pe * tl.cos(angle) + rotated * tl.sin(angle)
        tl.store(out_rows + LORA + p[None, :], pe.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_value_kernel(
    o_ptr, o_row_stride, o_head_stride, kvb_ptr, gate_ptr, gate_stride, out_ptr, out_stride,
    rows,
    NOPE: tl.constexpr, V: tl.constexpr, LORA: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, BR: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr, ONE_SHOT: tl.constexpr,
):
    """out[r, h*V + v] = (o_latent[r, h] @ W_UV[h]^T)[v] (times sigmoid(gate)) for one
    (head, V block, row block). ``ONE_SHOT`` (``BC`` covers the latent): the block's whole
    W_UV slab loads before the PDL wait and one dot takes it; else the latent in ``BC``
    chunks after the wait (too many rows for the slab and the rows in registers)."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rb = tl.program_id(2)
    v = vb * BV + tl.arange(0, BV)
    mask_v = v < V
    r = rb * BR + tl.arange(0, BR)
    mask_r = r < rows
    w_rows = kvb_ptr + (h * (NOPE + V) + NOPE + v[:, None]).to(tl.int64) * LORA
    o_rows = o_ptr + r[:, None].to(tl.int64) * o_row_stride + h * o_head_stride
    if ONE_SHOT:
        c = tl.arange(0, BC)
        mask_c = c < LORA
        w = tl.load(w_rows + c[None, :], mask=mask_v[:, None] & mask_c[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        o = tl.load(o_rows + c[None, :], mask=mask_r[:, None] & mask_c[None, :], other=0.0)
        acc = _mma(o, tl.trans(w), DOT_F32)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BR, BV], dtype=tl.float32)
        for c0 in range(0, LORA, BC):
            c = c0 + tl.arange(0, BC)
            mask_c = c < LORA
            w = tl.load(w_rows + c[None, :], mask=mask_v[:, None] & mask_c[None, :],
                        other=0.0)
            o = tl.load(o_rows + c[None, :], mask=mask_r[:, None] & mask_c[None, :],
                        other=0.0)
            acc += _mma(o, tl.trans(w), DOT_F32)
    cols = h * V + v
    mask = mask_r[:, None] & mask_v[None, :]
    if GATED:
        gate = tl.load(gate_ptr + r[:, None].to(tl.int64) * gate_stride + cols[None, :],
                       mask=mask, other=0.0).to(tl.float32)
        acc = acc * tl.sigmoid(gate)
    tl.store(out_ptr + r[:, None].to(tl.int64) * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def _row_block(rows: int) -> int:
    """Rows per program of the per-head GEMMs (tl.dot needs at least 16)."""
    return min(64, max(16, next_pow2(rows)))


def launch_absorb(q, kv_b, positions, out, *, heads: int, nope: int, rope: int, v_dim: int,
                  rope_theta: float | None, dot_f32: bool, block_c: int = 64,
                  pdl: bool = False) -> None:
    """Enqueue the query absorption: ``q`` [rows, H*(nope+rope)] with unit column stride,
    ``kv_b`` [H*(nope+v), lora] contiguous, ``out`` q_latent [rows, H, lora+rope] with unit
    last stride."""
    rows = q.shape[0]
    lora = kv_b.shape[1]
    block_c = min(block_c, max(16, next_pow2(lora)))
    block_r = _row_block(rows)
    has_rope = rope_theta is not None and rope > 0
    use_pdl = pdl_flag(pdl)
    grid = (heads, triton.cdiv(lora, block_c), triton.cdiv(rows, block_r))
    _mla_absorb_kernel[grid](
        q, q.stride(0), kv_b, positions if positions is not None else q, out, out.stride(0),
        out.stride(1), rows, math.log(rope_theta) if has_rope else 0.0,
        NOPE=nope, BNOPE=max(16, next_pow2(nope)), ROPE=rope, BP=next_pow2(max(rope, 1)),
        V=v_dim, LORA=lora, BC=block_c, BR=block_r, HAS_ROPE=has_rope, DOT_F32=dot_f32,
        USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )


def launch_value(o_latent, kv_b, gate, out, *, heads: int, nope: int, v_dim: int,
                 dot_f32: bool, block_v: int = 32, block_c: int = 128,
                 pdl: bool = False) -> None:
    """Enqueue W_UV (and the output gate): ``o_latent`` [rows, H, lora] with unit last
    stride, ``kv_b`` contiguous, ``gate`` / ``out`` [rows, H*v] with unit column stride.
    Up to :data:`ONE_SHOT_ROWS` rows a program and a latent of up to
    :data:`ONE_SHOT_LATENT`, the W_UV slab of a program loads before the PDL wait
    (``block_c`` is then the whole latent)."""
    rows = o_latent.shape[0]
    lora = kv_b.shape[1]
    block_v = min(block_v, max(16, next_pow2(v_dim)))
    block_c = min(block_c, max(16, next_pow2(lora)))
    block_r = _row_block(rows)
    use_pdl = pdl_flag(pdl)
    one_shot = block_r <= ONE_SHOT_ROWS and next_pow2(lora) <= ONE_SHOT_LATENT
    if one_shot:
        block_v, block_c = min(ONE_SHOT_BLOCK_V, block_v), next_pow2(lora)
    grid = (heads, triton.cdiv(v_dim, block_v), triton.cdiv(rows, block_r))
    _mla_value_kernel[grid](
        o_latent, o_latent.stride(0), o_latent.stride(1), kv_b,
        gate if gate is not None else out, gate.stride(0) if gate is not None else 0,
        out, out.stride(0), rows,
        NOPE=nope, V=v_dim, LORA=lora, BV=block_v, BC=block_c, BR=block_r,
        GATED=gate is not None, DOT_F32=dot_f32, USE_PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl, ONE_SHOT=one_shot,
    )


def launch_dsa_key_write(index_k, k_norm, k_norm_bias, k_cache, slot_mapping, positions, *,
                         rope: int, rope_theta: float | None, pdl: bool = False) -> None:
    """Enqueue the indexer key write: ``index_k`` [rows, d] with unit column stride,
    ``k_cache`` [NB, BS, d] with unit last stride; ``rope`` leading dims rotated when the
    model has rope."""
    rows, dim = index_k.shape
    rope = rope if rope_theta is not None else 0
    use_pdl = pdl_flag(pdl)
    _dsa_key_write_kernel[(rows,)](
        index_k, index_k.stride(0), k_norm, k_norm_bias, k_cache, k_cache.stride(0),
        k_cache.stride(1), slot_mapping, positions if positions is not None else slot_mapping,
        k_cache.shape[1], math.log(rope_theta) if rope else 0.0,
        ID=dim, BID=next_pow2(dim), ROPE=rope, USE_PDL=use_pdl, num_warps=4,
        launch_pdl=use_pdl,
    )


def launch_dsa_index(index_q, index_w, k_cache, block_tables, seq_lens, positions, scores, *,
                     rope: int, rope_theta: float | None, dot_f32: bool, block_n: int = 64,
                     pdl: bool = False) -> None:
    """Enqueue the indexer scores into ``scores`` [rows, capacity] float32 (unit last
    stride), capacity = the block table's tokens: ``index_q`` [rows, IH, d] and ``index_w``
    [rows, IH] with unit last strides."""
    rows, heads, dim = index_q.shape
    capacity = scores.shape[1]
    rope = rope if rope_theta is not None else 0
    use_pdl = pdl_flag(pdl)
    grid = (triton.cdiv(capacity, block_n), rows)
    _dsa_index_kernel[grid](
        index_q, index_q.stride(0), index_q.stride(1), index_w, index_w.stride(0),
        k_cache, k_cache.stride(0), k_cache.stride(1), block_tables, block_tables.stride(0),
        block_tables.shape[1], seq_lens, positions if positions is not None else seq_lens,
        scores, scores.stride(0), k_cache.shape[1], capacity,
        math.log(rope_theta) if rope else 0.0, dim**-0.5, heads**-0.5,
        IH=heads, BIH=max(16, next_pow2(heads)), ID=dim, BID=max(16, next_pow2(dim)),
        ROPE=rope, BN=block_n, DOT_F32=dot_f32, USE_PDL=use_pdl, num_warps=8,
        launch_pdl=use_pdl,
    )
