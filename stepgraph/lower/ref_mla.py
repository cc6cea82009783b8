"""Reference MLA / DSA ops in the absorbed decode form over a paged latent cache.

``mla_query``: q = q_b(RMSNorm(q_a)) (or q_proj(x)) split into nope and rope parts per head;
the nope part is absorbed into the latent space with W_UK (the k rows of kv_b) and the rope
part (rotated at ``positions`` when the model has rope) appended: q_latent [R, H, kv_lora +
rope]. DSA also computes the indexer query wq_b(RMSNorm(q_a)).

``mla_core`` / ``dsa_core``: the new token's latent ``[RMSNorm(kv_a[:kv_lora]) | kv_a[kv_lora:]]``
(rope part rotated when the model has rope) is written to the cache at ``slot_mapping``; each
row then attends over its first ``seq_lens`` cached tokens, found through its block table
(token t of a row lives at block ``block_tables[r, t // BS]``, offset ``t % BS``). In a verify
step every row of a request writes first and row j's ``seq_lens`` counts the request's context
plus its rows 0..j, so attention is causal within the group. DSA scores the cached tokens with
the lightning indexer (relu(q_idx . k_idx / sqrt(d)) weighted per head by weights_proj(x) /
sqrt(heads), k_idx = LayerNorm(wk(x)) cached per token), keeps the top-k and attends only over
those. A negative slot writes nothing; a row with ``seq_lens`` 0 (padding) attends nowhere and
returns zeros.

``mla_value``: W_UV (the v rows of kv_b) maps the attended latent back to v_head_dim per head,
times sigmoid of the output gate when the model has one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepgraph.lower.ref_common import OpCall, linear, rms_norm, rope

INDEXER_NORM_EPS = 1e-6  # the indexer's k LayerNorm (DeepSeek-V3.2 and K3.1 use 1e-6)


def _split_kv_b(kv_b: torch.Tensor, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora] from kv_b [H*(nope+v), kv_lora]."""
    heads, nope, v = attrs["heads"], attrs["qk_nope_head_dim"], attrs["v_head_dim"]
    per_head = kv_b.view(heads, nope + v, -1)
    return per_head[:, :nope], per_head[:, nope:]


def mla_query(call: OpCall) -> list[torch.Tensor]:
    """The absorbed MLA query (and the DSA indexer query)."""
    a = call.attrs
    heads, nope, rope_dim = a["heads"], a["qk_nope_head_dim"], a["qk_rope_head_dim"]
    ins = list(call.ins)
    dsa = len(call.out_dtypes) > 1
    has_rope = a.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    kv_b = ins.pop()
    index_wq_b = ins.pop() if dsa else None
    act = call.out_dtypes[0]
    if a.get("q_lora", True):
        q_a, q_norm, q_b = ins
        q_resid = rms_norm(q_a, q_norm, a["eps"]).to(q_a.dtype)
        q = linear(q_resid, q_b, act)
    else:
        (q,) = ins
        q_resid = q
    rows = q.shape[0]
    q = q.view(rows, heads, nope + rope_dim)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    if has_rope and rope_dim:
        q_pe = rope(q_pe, positions, a["rope_theta"])
    w_uk, _ = _split_kv_b(kv_b, a)
    absorbed = torch.einsum("rhn,hnc->rhc", q_nope.float(), w_uk.float())
    outs = [torch.cat([absorbed, q_pe.float()], dim=-1).to(act)]
    if dsa:
        index_shape = call.out_types[1].shape
        index_q = linear(q_resid, index_wq_b, act).view(rows, index_shape[1], index_shape[2])
        outs.append(index_q.to(call.out_dtypes[1]))
    return outs


def _write_cache(cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    flat = cache.view(-1, cache.shape[-1])
    valid = slots >= 0
    if bool(valid.any()):
        flat[slots[valid].long()] = entries[valid].to(cache.dtype)


def _gather_tokens(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached entries [R, T, width] of each row's first ``seq_lens`` tokens and the mask
    [R, T] of the valid ones (T = the longest row)."""
    block_size = cache.shape[1]
    rows = block_tables.shape[0]
    longest = int(seq_lens.max().item()) if rows else 0
    longest = max(longest, 1)
    t = torch.arange(longest, device=cache.device)
    valid = t[None, :] < seq_lens.long()[:, None]
    table_index = (t // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[:, table_index]  # [R, T]
    flat_index = blocks * block_size + (t % block_size)[None, :]
    flat_index = torch.where(valid & (blocks >= 0), flat_index, torch.zeros_like(flat_index))
    entries = cache.view(-1, cache.shape[-1])[flat_index]
    return entries, valid & (blocks >= 0)


def _latent_entries(call: OpCall, kv_a: torch.Tensor, norm: torch.Tensor,
                    positions: torch.Tensor | None) -> torch.Tensor:
    a = call.attrs
    lora = a["kv_lora_rank"]
    latent = rms_norm(kv_a[:, :lora], norm, a["eps"]).to(kv_a.dtype)
    k_pe = kv_a[:, lora:]
    if positions is not None and k_pe.shape[-1]:
        k_pe = rope(k_pe, positions, a["rope_theta"])
    return torch.cat([latent, k_pe], dim=-1)


def _attend(call: OpCall, q_latent: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor
            ) -> list[torch.Tensor]:
    """Softmax attention of q_latent [R, H, C] over entries [R, T, C] where ``mask``; the
    output is the attended first kv_lora columns [R, H, kv_lora] (and the LSE [R, H])."""
    lora = call.attrs["kv_lora_rank"]
    scores = torch.einsum("rhc,rtc->rht", q_latent.float(), entries.float())
    scores = scores * call.attrs["softmax_scale"]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("rht,rtc->rhc", probs, entries[..., :lora].float())
    outs = [out.to(call.out_dtypes[0])]
    if len(call.out_dtypes) > 1:
        outs.append(lse.to(call.out_dtypes[1]))
    return outs


def mla_core(call: OpCall) -> list[torch.Tensor]:
    """MLA decode attention over the paged latent cache (writes the new tokens first)."""
    ins = list(call.ins)
    has_rope = call.attrs.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    q_latent, kv_a, norm, cache, block_tables, seq_lens, slot_mapping = ins
    _write_cache(cache, slot_mapping, _latent_entries(call, kv_a, norm, positions))
    entries, mask = _gather_tokens(cache, block_tables, seq_lens)
    return _attend(call, q_latent, entries, mask)


def dsa_core(call: OpCall) -> list[torch.Tensor]:
    """DSA: index the cached tokens, keep each row's top-k, sparse MLA over the selection."""
    a = call.attrs
    ins = list(call.ins)
    has_rope = a.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    (q_latent, kv_a, norm, index_q, index_k, index_w, k_norm, k_norm_bias, cache, k_cache,
     block_tables, seq_lens, slot_mapping) = ins
    _write_cache(cache, slot_mapping, _latent_entries(call, kv_a, norm, positions))
    key = F.layer_norm(index_k.float(), (index_k.shape[-1],), k_norm.float(),
                       k_norm_bias.float(), INDEXER_NORM_EPS)
    rope_dim = a["qk_rope_head_dim"]
    if has_rope and rope_dim:
        key = torch.cat([rope(key[:, :rope_dim], positions, a["rope_theta"]), key[:, rope_dim:]],
                        dim=-1)
    _write_cache(k_cache, slot_mapping, key.to(index_k.dtype))
    entries, mask = _gather_tokens(cache, block_tables, seq_lens)
    keys, _ = _gather_tokens(k_cache, block_tables, seq_lens)
    rotate = (positions, a["rope_theta"], rope_dim) if has_rope and rope_dim else None
    top = min(a["index_top_k"], mask.shape[1])
    chosen = indexer_selection(index_q, keys, index_w, mask, top, rotate)
    return _attend(call, q_latent, entries, mask & chosen)


def indexer_selection(index_q: torch.Tensor, keys: torch.Tensor, index_w: torch.Tensor,
                      mask: torch.Tensor, top: int,
                      rotate: tuple[torch.Tensor, float, int] | None) -> torch.Tensor:
    """The lightning indexer's choice [R, T] (bool): relu(q . k) per head, weighted by the
    head weights (x heads^-0.5), summed, masked to the cached tokens, top ``top``.
    ``rotate``: (positions, theta, rope dims) when the indexer query's first dims are rotated."""
    query = index_q.float()
    if rotate is not None:
        positions, theta, rope_dim = rotate
        query = torch.cat([rope(query[..., :rope_dim], positions, theta),
                           query[..., rope_dim:]], dim=-1)
    heads, dim = query.shape[1], query.shape[2]
    scores = F.relu(torch.einsum("rhd,rtd->rht", query, keys.float()) * dim**-0.5)
    weights = index_w.float() * heads**-0.5
    index = torch.einsum("rh,rht->rt", weights, scores).masked_fill(~mask, float("-inf"))
    chosen = torch.zeros_like(mask)
    chosen.scatter_(1, index.topk(top, dim=-1).indices, True)
    return chosen


def mla_value(call: OpCall) -> list[torch.Tensor]:
    """W_UV of the attended latent per head, times sigmoid(gate) when gated."""
    a = call.attrs
    o_latent, kv_b = call.ins[:2]
    _, w_uv = _split_kv_b(kv_b, a)
    out = torch.einsum("rhc,hvc->rhv", o_latent.float(), w_uv.float())
    out = out.reshape(o_latent.shape[0], -1)
    if a.get("gated"):
        out = out * torch.sigmoid(call.ins[2].float())
    return [out.to(call.out_dtypes[0])]


OPS = {
    "mla_query": mla_query,
    "mla_core": mla_core,
    "dsa_core": dsa_core,
    "mla_value": mla_value,
}
