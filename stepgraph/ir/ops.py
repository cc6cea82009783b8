"""The op set of the IR: what each op is for and the type rule the verifier checks.

A type rule receives the node and the types of its inputs and outputs and raises
:class:`TypeRuleError` with a message naming the mismatch. Rules see per-rank shapes
after the shard pass (attributes such as ``heads`` are the rank's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Dim, TensorType, is_rows_dim


class TypeRuleError(Exception):
    """A node whose operand types disagree with its op's rule."""


Rule = Callable[[Node, list[TensorType], list[TensorType]], None]


@dataclass(frozen=True)
class OpDef:
    """An op: its category (``compute``, ``collective``, ``memory``), what it does, its rule,
    and how many inputs / outputs it takes (None: variadic)."""

    name: str
    category: str
    doc: str
    rule: Rule
    min_inputs: int
    num_outputs: int | None


def _same_rows(node: Node, types: list[TensorType]) -> None:
    rows = {t.shape[0] for t in types if t.shape}
    if not (len(rows) <= 1):
        raise TypeRuleError(f"row dims differ: {sorted(map(str, rows))}")


def _shape(t: TensorType) -> str:
    return "x".join(map(str, t.shape))


def _matmul(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, w = ins[0], ins[1]
    (out,) = outs
    if "input_combine_top_k" in node.attrs:  # the fuse pass's combine: x[R, k, K] slots
        if not (len(x.shape) == 3 and x.shape[1] == node.attrs["input_combine_top_k"]):
            raise TypeRuleError(f"combined rows {_shape(x)}: expected [R, "
                                f"{node.attrs['input_combine_top_k']}, K] expert slots")
        x = TensorType((x.shape[0], x.shape[2]), x.dtype)
    if not (len(x.shape) == 2 and len(w.shape) == 2):
        raise TypeRuleError("projection takes x[R,K] and w[N,K]")
    if x.shape[1] != w.shape[1]:
        raise TypeRuleError(f"x is {_shape(x)} but weight is {_shape(w)} (K differs)")
    if out.shape != (x.shape[0], w.shape[0]):
        raise TypeRuleError(f"out is {_shape(out)}, expected {x.shape[0]}x{w.shape[0]}")
    if "input_norm_eps" in node.attrs:
        if len(ins) != 3:
            raise TypeRuleError(f"{len(ins)} inputs: x, the weight and the input norm's weight")
        if ins[2].shape != (x.shape[1],):
            raise TypeRuleError(f"input norm weight {_shape(ins[2])} vs x {_shape(x)}")


def _elementwise(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    (out,) = outs
    for t in ins:
        if t.shape != out.shape:
            raise TypeRuleError(f"operand {_shape(t)} differs from out {_shape(out)}")
        if t.dtype != out.dtype:
            raise TypeRuleError(f"operand dtype {t.dtype} differs from out {out.dtype}")


def _rmsnorm(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, w = ins
    (out,) = outs
    if w.shape != (x.shape[-1],):
        raise TypeRuleError(f"norm weight {_shape(w)} vs x {_shape(x)}")
    if out.shape != x.shape:
        raise TypeRuleError(f"out {_shape(out)} vs x {_shape(x)}")


def _embed(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    tokens, table = ins
    (out,) = outs
    if tokens.dtype not in ("int32", "int64"):
        raise TypeRuleError("tokens must be integer")
    if out.shape != (tokens.shape[0], table.shape[1]):
        raise TypeRuleError(f"out {_shape(out)}")


def _mix(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    count = node.attrs["sources"]
    if len(ins) != count + 2:
        raise TypeRuleError(f"expected {count} sources + query + norm, got {len(ins)}")
    (out,) = outs
    for source in ins[:count]:
        if source.shape != out.shape:
            raise TypeRuleError(f"source {_shape(source)} vs out {_shape(out)}")
    for weight in ins[count:]:
        if weight.shape != (out.shape[-1],):
            raise TypeRuleError(f"mix weight {_shape(weight)}")


def _mix_norm(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    count, deltas = node.attrs["sources"], node.attrs["deltas"]
    if len(ins) != count + deltas + 3:
        raise TypeRuleError(f"expected {count} sources + {deltas} deltas + query + mix norm + "
                            f"norm weight, got {len(ins)}")
    if len(outs) != (2 if deltas else 1):
        raise TypeRuleError(f"{len(outs)} outputs: normed rows, and the prefix sum where "
                            "there are deltas")
    normed = outs[0]
    for row in (*ins[:count + deltas], *outs):
        if row.shape != normed.shape:
            raise TypeRuleError(f"rows {_shape(row)} vs normed rows {_shape(normed)}")
    if deltas and outs[1].dtype != ins[count - 1].dtype:
        raise TypeRuleError(f"prefix sum dtype {outs[1].dtype} differs from the prefix's "
                            f"{ins[count - 1].dtype}")
    for weight in ins[count + deltas:]:
        if weight.shape != (normed.shape[-1],):
            raise TypeRuleError(f"mix or norm weight {_shape(weight)}")


def _kda(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads, dim = node.attrs["heads"], node.attrs["head_dim"]
    q, k, v, g, f_a, b = ins[:6]
    width = heads * dim
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1:] != (width,):
            raise TypeRuleError(f"{name} is {_shape(t)}, expected [R,{width}]")
    if node.attrs["output_gate"] == "full" and not (g.shape[1:] == (width,)):
        raise TypeRuleError(f"gate is {_shape(g)}, expected [R,{width}]")
    if b.shape[1:] != (heads,):
        raise TypeRuleError(f"beta is {_shape(b)}, expected [R,{heads}]")
    if f_a.shape[1] != ins[9].shape[1]:
        raise TypeRuleError("f_a width differs from f_b_proj's K")
    (out,) = outs
    if out.shape != (q.shape[0], width):
        raise TypeRuleError(f"out {_shape(out)}")


def _mla_query(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads = node.attrs["heads"]
    latent = node.attrs["kv_lora_rank"] + node.attrs["qk_rope_head_dim"]
    out = outs[0]
    if out.shape[1:] != (heads, latent):
        raise TypeRuleError(f"q_latent {_shape(out)}, expected [R,{heads},{latent}]")


def _attention_core(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    q = ins[0]
    out = outs[0]
    if len(q.shape) != 3:
        raise TypeRuleError("the core's query is [R, heads, latent]")
    if out.shape != (q.shape[0], q.shape[1], node.attrs["kv_lora_rank"]):
        raise TypeRuleError(f"out {_shape(out)} vs query {_shape(q)}")
    if len(outs) > 1 and not (outs[1].shape == (q.shape[0], q.shape[1])):
        raise TypeRuleError("lse is [R, heads]")


def _mla_value(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads, v = node.attrs["heads"], node.attrs["v_head_dim"]
    o = ins[0]
    if o.shape[1:] != (heads, node.attrs["kv_lora_rank"]):
        raise TypeRuleError(f"o_latent {_shape(o)}")
    if outs[0].shape != (o.shape[0], heads * v):
        raise TypeRuleError(f"out {_shape(outs[0])}")


def _router(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    logits = ins[0]
    ids, weights = outs
    if logits.shape[1] != node.attrs["experts"]:
        raise TypeRuleError(f"logits {_shape(logits)} vs {node.attrs['experts']} experts")
    k = node.attrs["top_k"]
    if not (ids.shape == (logits.shape[0], k) and weights.shape == ids.shape):
        raise TypeRuleError("top-k shapes")
    if ids.dtype != "int32":
        raise TypeRuleError("expert ids are int32")


def _experts(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, ids, weights, gate_up, down = ins
    local, width = node.attrs["local_experts"], node.attrs["width"]
    if gate_up.shape != (local, 2 * width, x.shape[1]):
        raise TypeRuleError(f"gate_up {_shape(gate_up)}, expected {local}x{2 * width}x{x.shape[1]}")
    if down.shape != (local, x.shape[1], width):
        raise TypeRuleError(f"down {_shape(down)}")
    if node.attrs.get("slots"):  # the fuse pass's form: each slot's weighted expert output
        want = (x.shape[0], ids.shape[1], x.shape[1])
        if outs[0].shape != want or outs[0].dtype != "float32":
            raise TypeRuleError(f"slots {outs[0]}: expected float32[{'x'.join(map(str, want))}]")
    elif outs[0].shape != x.shape:
        raise TypeRuleError(f"out {_shape(outs[0])} vs x {_shape(x)}")
    if not (ids.shape[0] == x.shape[0] == weights.shape[0]):
        raise TypeRuleError("rows of x, ids, weights differ")


def _gated_mlp(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, gate_up, down = ins
    width = node.attrs["width"]
    if gate_up.shape != (2 * width, x.shape[1]):
        raise TypeRuleError(f"gate_up {_shape(gate_up)}")
    if down.shape != (x.shape[1], width):
        raise TypeRuleError(f"down {_shape(down)}")
    if outs[0].shape != x.shape:
        raise TypeRuleError(f"out {_shape(outs[0])}")


def _same_as_input(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    if not (outs[0].shape == ins[0].shape and outs[0].dtype == ins[0].dtype):
        raise TypeRuleError(f"out {outs[0]} differs from in {ins[0]}")


def _gather(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    if not (out.shape[:-1] == x.shape[:-1] and out.shape[-1] == x.shape[-1] * ways):
        raise TypeRuleError(f"all_gather of {_shape(x)} over {ways} is {_shape(out)}")


def _scatter(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    if not (x.shape[-1] % ways == 0 and out.shape[-1] * ways == x.shape[-1]):
        raise TypeRuleError(f"reduce_scatter of {_shape(x)} over {ways} is {_shape(out)}")


def _dcp_gather(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    if out.shape != (x.shape[0], x.shape[1] * ways, x.shape[2]):
        raise TypeRuleError(f"dcp_gather of {_shape(x)} over {ways} is {_shape(out)}")


def _lse_merge(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    o, lse = ins
    out = outs[0]
    if lse.shape != o.shape[:2]:
        raise TypeRuleError("lse is [R, heads]")
    if out.shape != (o.shape[0], o.shape[1] // ways, o.shape[2]):
        raise TypeRuleError(f"lse_merge of {_shape(o)} over {ways} is {_shape(out)}")


def _rows_scaled(dim: Dim, base: Dim) -> bool:
    return is_rows_dim(dim) and is_rows_dim(base)


def _dispatch(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, ids, weights = ins
    rx, rids, rweights = outs
    widths = (rx.shape[1:], rids.shape[1:], rweights.shape[1:])
    if widths != (x.shape[1:], ids.shape[1:], weights.shape[1:]):
        raise TypeRuleError("dispatch keeps row widths")
    if not (_rows_scaled(rx.shape[0], x.shape[0])):
        raise TypeRuleError("dispatched rows scale B")


def _combine(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    y = ins[0]
    out = outs[0]
    if out.shape[1:] != y.shape[1:]:
        raise TypeRuleError("combine keeps the row width")


def _prefetch(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    if outs:
        raise TypeRuleError("a prefetch writes nothing")


def _op(name: str, category: str, doc: str, rule: Rule, min_inputs: int,
        outputs: int | None = 1) -> OpDef:
    return OpDef(name, category, doc, rule, min_inputs, outputs)


OPS: dict[str, OpDef] = {
    d.name: d
    for d in (
        _op("embed", "compute", "token ids -> rows of the embedding table", _embed, 2),
        _op("rmsnorm", "compute", "RMSNorm over the last dim", _rmsnorm, 2),
        _op("add", "compute", "elementwise sum (residual, prefix sum, MoE paths)", _elementwise,
            2),
        _op("attn_res_mix", "compute",
            "AttnRes: softmax over sources of a pseudo-query . RMSNorm(source)", _mix, 3),
        _op("attn_res_norm", "compute",
            "fused: prefix sum += deltas, the AttnRes mix, then RMSNorm (the fuse pass)",
            _mix_norm, 4, None),
        _op("projection", "compute", "x @ W.T over a (possibly packed) weight", _matmul, 2),
        _op("o_proj", "compute", "the attention output projection (row-parallel at TP)",
            _matmul, 2),
        _op("kda_core", "compute",
            "KDA: short conv + SiLU, decay gate, L2 norm, delta rule, gated RMSNorm", _kda, 6),
        _op("mla_query", "compute",
            "MLA query: q_a norm, q_b, absorb q_nope with W_UK -> [R, heads, latent]",
            _mla_query, 2, None),
        _op("mla_core", "compute", "MLA decode attention over the paged latent cache",
            _attention_core, 3, None),
        _op("dsa_core", "compute",
            "DSA: indexer scores, top-k cached tokens, sparse MLA over the selection",
            _attention_core, 3, None),
        _op("mla_value", "compute", "W_UV of the attended latent, output gate", _mla_value, 2),
        _op("router", "compute", "scores, correction bias (selection only), top-k, renormalize",
            _router, 1, 2),
        _op("routed_experts", "compute",
            "the top-k experts of each row (gate_up, activation, down), weighted sum",
            _experts, 5),
        _op("shared_expert", "compute", "the shared expert: a gated MLP", _gated_mlp, 3),
        _op("dense_mlp", "compute", "a dense gated MLP", _gated_mlp, 3),
        _op("lm_head", "compute", "final rows -> vocabulary logits", _matmul, 2),
        _op("all_reduce", "collective", "sum over the group", _same_as_input, 1),
        _op("all_gather", "collective", "concatenate the group's last dims", _gather, 1),
        _op("reduce_scatter", "collective", "sum, then keep this rank's part", _scatter, 1),
        _op("dcp_gather", "collective", "gather the DCP group's query heads", _dcp_gather, 1),
        _op("lse_merge", "collective",
            "exchange partial attention and merge by log-sum-exp", _lse_merge, 2),
        _op("ep_dispatch", "collective", "send rows to the ranks owning their experts",
            _dispatch, 3, 3),
        _op("ep_combine", "collective", "return expert outputs to the rows' ranks and sum",
            _combine, 1),
        _op("prefetch", "memory", "warm the L2 with weights the next unit reads first",
            _prefetch, 1, 0),
    )
}
