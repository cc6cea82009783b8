"""Reference ops of the dense units: embed, norms, residual adds, the AttnRes mix,
projections, the MoE router and experts, gated MLPs, lm_head and the collectives of a world
of one (identities)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stepgraph.errors import UserError
from stepgraph.lower.ref_common import OpCall, OpFn, gated_activation, linear, rms_norm
from stepgraph.lower.tensors import storage_dtype


def embed(call: OpCall) -> list[torch.Tensor]:
    """Rows of the embedding table for the step's token ids."""
    tokens, table = call.ins
    return [table[tokens.long()].to(call.out_dtypes[0])]


def rmsnorm(call: OpCall) -> list[torch.Tensor]:
    """RMSNorm over the last dim."""
    x, weight = call.ins
    return [rms_norm(x, weight, call.attrs["eps"]).to(call.out_dtypes[0])]


def add(call: OpCall) -> list[torch.Tensor]:
    """Elementwise sum of the operands."""
    total = call.ins[0]
    for other in call.ins[1:]:
        total = total + other
    return [total.to(call.out_dtypes[0])]


def _mix(rows: list[torch.Tensor], query: torch.Tensor, norm: torch.Tensor,
         eps: float) -> torch.Tensor:
    """The AttnRes mix of the source rows in float32."""
    sources = torch.stack([s.float() for s in rows], dim=1)  # [R, n, H]
    keys = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps)
    logits = (keys * (norm.float() * query.float())).sum(-1)  # [R, n]
    probs = logits.softmax(-1)
    return torch.matmul(probs.unsqueeze(1), sources).squeeze(1)


def attn_res_mix(call: OpCall) -> list[torch.Tensor]:
    """AttnRes: logit_i = sum_d (norm_d * query_d) * RMSNorm(v_i)_d; softmax over the sources;
    the output is the softmax-weighted sum of the raw source values (all in float32)."""
    count = call.attrs["sources"]
    query, norm = call.ins[count], call.ins[count + 1]
    mixed = _mix(list(call.ins[:count]), query, norm, call.attrs["eps"])
    return [mixed.to(call.out_dtypes[0])]


def attn_res_norm(call: OpCall) -> list[torch.Tensor]:
    """The fuse pass's node: the prefix sum (last source + the deltas, summed in float32 and
    stored in the prefix's dtype), the AttnRes mix of the sources with it (rounded to the
    normed rows' dtype, where the unfused mix stored it), then RMSNorm; returns [normed,
    prefix sum] (or [normed] without deltas)."""
    count, deltas = call.attrs["sources"], call.attrs["deltas"]
    rows = list(call.ins[:count])
    extra = call.ins[count:count + deltas]
    query, norm, weight = call.ins[count + deltas:]
    results: list[torch.Tensor] = []
    if deltas:
        total = rows[-1].float()
        for other in extra:
            total = total + other.float()
        rows[-1] = total.to(call.out_dtypes[1])
        results.append(rows[-1])
    mixed = _mix(rows, query, norm, call.attrs["eps"]).to(call.out_dtypes[0])
    normed = rms_norm(mixed, weight, call.attrs["norm_eps"]).to(call.out_dtypes[0])
    return [normed, *results]


def combined_slots(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of expert slots ``[R, k, W]`` summed in float32 slot after slot, rounded to
    ``dtype`` (where the routed experts' own sum stored them)."""
    total = slots[:, 0].float()
    for j in range(1, slots.shape[1]):
        total = total + slots[:, j].float()
    return total.to(dtype)


def projection(call: OpCall) -> list[torch.Tensor]:
    """``x @ W.T`` (also o_proj and lm_head); with the fuse pass's input norm, of
    ``rmsnorm(x)`` rounded to ``input_norm_dtype`` (where the unfused norm stored it); with
    its input combine, ``x`` are the routed experts' slots ``[R, k, K]``, summed first
    (:func:`combined_slots`)."""
    x, weight = call.ins[:2]
    if "input_combine_top_k" in call.attrs:
        x = combined_slots(x, storage_dtype(call.attrs["input_combine_dtype"], call.compute))
    if "input_norm_eps" in call.attrs:
        dtype = storage_dtype(call.attrs["input_norm_dtype"], call.compute)
        x = rms_norm(x, call.ins[2], call.attrs["input_norm_eps"]).to(dtype)
    return [linear(x, weight, call.out_dtypes[0])]


def router_scores(logits: torch.Tensor, attrs: dict) -> torch.Tensor:
    """A router's scores of its logits (``attrs``: sigmoid or softmax), in float32."""
    logits = logits.float()
    return logits.sigmoid() if attrs["score"] == "sigmoid" else logits.softmax(-1)


def route_weights(scores: torch.Tensor, ids: torch.Tensor, attrs: dict) -> torch.Tensor:
    """The routing weights of ``ids`` (a router's ``attrs``): the unbiased ``scores``
    (:func:`router_scores`) at the chosen experts, renormalised and scaled (float32)."""
    weights = scores.gather(1, ids.long())
    if attrs.get("renormalize"):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * float(attrs.get("scaling_factor", 1.0))


def router(call: OpCall) -> list[torch.Tensor]:
    """Top-k routing: sigmoid or softmax scores; the correction bias enters the selection
    only; the selected (unbiased) scores are renormalised and scaled."""
    attrs = call.attrs
    scores = router_scores(call.ins[0], attrs)
    choice = scores
    if attrs.get("correction_bias"):
        choice = scores + call.ins[1].float()
    ids = torch.topk(choice, k=attrs["top_k"], dim=-1, sorted=False).indices
    return [ids.to(torch.int32), route_weights(scores, ids, attrs).to(call.out_dtypes[1])]


def _weighted_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, attrs: dict
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each expert held here (ids in [offset, offset + local)), in ascending id: the rows
    that chose it, the top-k position they chose it at, and ``down(act(gate, up))`` of those
    rows weighted by their router weight."""
    width, local = attrs["width"], attrs["local_experts"]
    local_ids = ids.long() - attrs["expert_offset"]
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < local:
            continue
        rows, slot = torch.where(local_ids == expert)
        h = linear(x[rows], gate_up[expert], x.dtype)
        act = gated_activation(h[:, :width], h[:, width:], attrs)
        yield rows, slot, linear(act, down[expert], act.dtype) * weights[rows, slot, None]


def routed_experts(call: OpCall) -> list[torch.Tensor]:
    """Each row's top-k experts (those held here): ``down(act(gate, up))`` weighted by the
    router weight, summed; experts run in ascending id with their rows gathered, and
    accumulate with ``index_add_`` (the order HF uses). With the fuse pass's ``slots``
    (every expert held here), row r's slot j holds its j-th expert's weighted output instead,
    rounded to ``slot_dtype`` (where the sum adds each expert's rows), in float32
    ``[R, k, W]``, for the consumer to sum."""
    x, ids, weights, gate_up, down = call.ins
    experts = _weighted_experts(x, ids, weights, gate_up, down, call.attrs)
    if call.attrs.get("slots"):
        dtype = storage_dtype(call.attrs["slot_dtype"], call.compute)
        slots = torch.zeros(x.shape[0], ids.shape[1], x.shape[1], dtype=torch.float32,
                            device=x.device)
        for rows, slot, y in experts:
            slots[rows, slot] = y.to(dtype).float()
        return [slots]
    out = torch.zeros(x.shape, dtype=call.out_dtypes[0], device=x.device)
    for rows, _, y in experts:
        out.index_add_(0, rows, y.to(out.dtype))
    return [out]


def gated_mlp(call: OpCall) -> list[torch.Tensor]:
    """A gated MLP (dense layer or shared expert) over a [gate | up] weight."""
    x, gate_up, down = call.ins
    width = call.attrs["width"]
    h = linear(x, gate_up, call.out_dtypes[0])
    act = gated_activation(h[:, :width], h[:, width:], call.attrs)
    return [linear(act, down, call.out_dtypes[0])]


def _one_way(call: OpCall) -> None:
    ways = call.attrs.get("ways", 1)
    if ways != 1:
        raise UserError(f"node {call.node.name}: {call.node.op} over {ways} ranks; the reference "
                        "executor runs a world of one")


def identity_collective(call: OpCall) -> list[torch.Tensor]:
    """all_reduce / all_gather / reduce_scatter / dcp_gather / ep_combine over one rank."""
    _one_way(call)
    return [call.ins[0].to(call.out_dtypes[0])]


def lse_merge(call: OpCall) -> list[torch.Tensor]:
    """Merging the partial attention of one rank is the partial itself."""
    _one_way(call)
    return [call.ins[0].to(call.out_dtypes[0])]


def ep_dispatch(call: OpCall) -> list[torch.Tensor]:
    """Dispatch to a single expert-parallel rank sends every row to itself."""
    _one_way(call)
    return [t.to(d) for t, d in zip(call.ins, call.out_dtypes, strict=True)]


def prefetch(call: OpCall) -> list[torch.Tensor]:
    """An L2 prefetch has no numerical effect."""
    return []


OPS: dict[str, OpFn] = {
    "embed": embed,
    "rmsnorm": rmsnorm,
    "add": add,
    "attn_res_mix": attn_res_mix,
    "attn_res_norm": attn_res_norm,
    "projection": projection,
    "o_proj": projection,
    "lm_head": projection,
    "router": router,
    "routed_experts": routed_experts,
    "shared_expert": gated_mlp,
    "dense_mlp": gated_mlp,
    "all_reduce": identity_collective,
    "all_gather": identity_collective,
    "reduce_scatter": identity_collective,
    "dcp_gather": identity_collective,
    "ep_combine": identity_collective,
    "lse_merge": lse_merge,
    "ep_dispatch": ep_dispatch,
    "prefetch": prefetch,
}
