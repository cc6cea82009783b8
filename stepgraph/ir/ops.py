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


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise TypeRuleError(message)


def _same_rows(node: Node, types: list[TensorType]) -> None:
    rows = {t.shape[0] for t in types if t.shape}
    _expect(len(rows) <= 1, f"row dims differ: {sorted(map(str, rows))}")


def _shape(t: TensorType) -> str:
    return "x".join(map(str, t.shape))


def _matmul(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, w = ins[0], ins[1]
    (out,) = outs
    _expect(len(x.shape) == 2 and len(w.shape) == 2, "projection takes x[R,K] and w[N,K]")
    _expect(x.shape[1] == w.shape[1], f"x is {_shape(x)} but weight is {_shape(w)} (K differs)")
    _expect(out.shape == (x.shape[0], w.shape[0]),
            f"out is {_shape(out)}, expected {x.shape[0]}x{w.shape[0]}")


def _elementwise(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    (out,) = outs
    for t in ins:
        _expect(t.shape == out.shape, f"operand {_shape(t)} differs from out {_shape(out)}")
        _expect(t.dtype == out.dtype, f"operand dtype {t.dtype} differs from out {out.dtype}")


def _rmsnorm(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, w = ins
    (out,) = outs
    _expect(w.shape == (x.shape[-1],), f"norm weight {_shape(w)} vs x {_shape(x)}")
    _expect(out.shape == x.shape, f"out {_shape(out)} vs x {_shape(x)}")


def _embed(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    tokens, table = ins
    (out,) = outs
    _expect(tokens.dtype in ("int32", "int64"), "tokens must be integer")
    _expect(out.shape == (tokens.shape[0], table.shape[1]), f"out {_shape(out)}")


def _mix(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    count = node.attrs["sources"]
    _expect(len(ins) == count + 2, f"expected {count} sources + query + norm, got {len(ins)}")
    (out,) = outs
    for source in ins[:count]:
        _expect(source.shape == out.shape, f"source {_shape(source)} vs out {_shape(out)}")
    for weight in ins[count:]:
        _expect(weight.shape == (out.shape[-1],), f"mix weight {_shape(weight)}")


def _kda(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads, dim = node.attrs["heads"], node.attrs["head_dim"]
    q, k, v, g, f_a, b = ins[:6]
    width = heads * dim
    for name, t in (("q", q), ("k", k), ("v", v)):
        _expect(t.shape[1:] == (width,), f"{name} is {_shape(t)}, expected [R,{width}]")
    if node.attrs["output_gate"] == "full":
        _expect(g.shape[1:] == (width,), f"gate is {_shape(g)}, expected [R,{width}]")
    _expect(b.shape[1:] == (heads,), f"beta is {_shape(b)}, expected [R,{heads}]")
    _expect(f_a.shape[1] == ins[9].shape[1], "f_a width differs from f_b_proj's K")
    (out,) = outs
    _expect(out.shape == (q.shape[0], width), f"out {_shape(out)}")


def _mla_query(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads = node.attrs["heads"]
    latent = node.attrs["kv_lora_rank"] + node.attrs["qk_rope_head_dim"]
    out = outs[0]
    _expect(out.shape[1:] == (heads, latent), f"q_latent {_shape(out)}, expected [R,{heads},"
            f"{latent}]")


def _attention_core(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    q = ins[0]
    out = outs[0]
    _expect(len(q.shape) == 3, "the core's query is [R, heads, latent]")
    _expect(out.shape == (q.shape[0], q.shape[1], node.attrs["kv_lora_rank"]),
            f"out {_shape(out)} vs query {_shape(q)}")
    if len(outs) > 1:
        _expect(outs[1].shape == (q.shape[0], q.shape[1]), "lse is [R, heads]")


def _mla_value(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    heads, v = node.attrs["heads"], node.attrs["v_head_dim"]
    o = ins[0]
    _expect(o.shape[1:] == (heads, node.attrs["kv_lora_rank"]), f"o_latent {_shape(o)}")
    _expect(outs[0].shape == (o.shape[0], heads * v), f"out {_shape(outs[0])}")


def _router(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    logits = ins[0]
    ids, weights = outs
    _expect(logits.shape[1] == node.attrs["experts"],
            f"logits {_shape(logits)} vs {node.attrs['experts']} experts")
    k = node.attrs["top_k"]
    _expect(ids.shape == (logits.shape[0], k) and weights.shape == ids.shape, "top-k shapes")
    _expect(ids.dtype == "int32", "expert ids are int32")


def _experts(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, ids, weights, gate_up, down = ins
    local, width = node.attrs["local_experts"], node.attrs["width"]
    _expect(gate_up.shape == (local, 2 * width, x.shape[1]),
            f"gate_up {_shape(gate_up)}, expected {local}x{2 * width}x{x.shape[1]}")
    _expect(down.shape == (local, x.shape[1], width), f"down {_shape(down)}")
    _expect(outs[0].shape == x.shape, f"out {_shape(outs[0])} vs x {_shape(x)}")
    _expect(ids.shape[0] == x.shape[0] == weights.shape[0], "rows of x, ids, weights differ")


def _gated_mlp(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, gate_up, down = ins
    width = node.attrs["width"]
    _expect(gate_up.shape == (2 * width, x.shape[1]), f"gate_up {_shape(gate_up)}")
    _expect(down.shape == (x.shape[1], width), f"down {_shape(down)}")
    _expect(outs[0].shape == x.shape, f"out {_shape(outs[0])}")


def _same_as_input(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    _expect(outs[0].shape == ins[0].shape and outs[0].dtype == ins[0].dtype,
            f"out {outs[0]} differs from in {ins[0]}")


def _gather(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    _expect(out.shape[:-1] == x.shape[:-1] and out.shape[-1] == x.shape[-1] * ways,
            f"all_gather of {_shape(x)} over {ways} is {_shape(out)}")


def _scatter(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    _expect(x.shape[-1] % ways == 0 and out.shape[-1] * ways == x.shape[-1],
            f"reduce_scatter of {_shape(x)} over {ways} is {_shape(out)}")


def _dcp_gather(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    x, out = ins[0], outs[0]
    _expect(out.shape == (x.shape[0], x.shape[1] * ways, x.shape[2]),
            f"dcp_gather of {_shape(x)} over {ways} is {_shape(out)}")


def _lse_merge(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    ways = node.attrs["ways"]
    o, lse = ins
    out = outs[0]
    _expect(lse.shape == o.shape[:2], "lse is [R, heads]")
    _expect(out.shape == (o.shape[0], o.shape[1] // ways, o.shape[2]),
            f"lse_merge of {_shape(o)} over {ways} is {_shape(out)}")


def _rows_scaled(dim: Dim, base: Dim) -> bool:
    return is_rows_dim(dim) and is_rows_dim(base)


def _dispatch(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    x, ids, weights = ins
    rx, rids, rweights = outs
    _expect(rx.shape[1:] == x.shape[1:] and rids.shape[1:] == ids.shape[1:]
            and rweights.shape[1:] == weights.shape[1:], "dispatch keeps row widths")
    _expect(_rows_scaled(rx.shape[0], x.shape[0]), "dispatched rows scale B")


def _combine(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    y = ins[0]
    out = outs[0]
    _expect(out.shape[1:] == y.shape[1:], "combine keeps the row width")


def _prefetch(node: Node, ins: list[TensorType], outs: list[TensorType]) -> None:
    _expect(not outs, "a prefetch writes nothing")


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
