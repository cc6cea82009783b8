"""The ``fuse`` pass: the AttnRes residual path of each sublayer becomes one node, and an
RMSNorm read only by a projection becomes that projection's input norm.

Without it, every sublayer boundary of an AttnRes model is four launches over rows of the
hidden size: the prefix-sum ``add`` (often fed by the MoE's own ``add`` of its routed and
shared paths), the ``attn_res_mix`` of the blocks and the new prefix, and the ``rmsnorm``
in front of the next projection. At one row each of them is a few microseconds of launch
and latency for a few kilobytes. This pass rewrites every

    p = add(prefix, d1, ...)            (optional; inner adds read only here flatten in)
    m = attn_res_mix(b1, ..., bk, p, query, mix_norm)
    x = rmsnorm(m, weight)              (the only reader of m)

into ``x[, p] = attn_res_norm(b1, ..., bk, prefix, d1, ..., query, mix_norm, weight)``
(attrs ``sources`` = k + 1, ``deltas`` = the number of d's, ``eps``, ``norm_eps``), placed
where the mix was. The values keep their names, so their readers do not change; the
mix's output and the inner adds' outputs disappear. The fused op rounds where the unfused
nodes store (the prefix sum and the mix output in their dtypes), so its reference equals
the three nodes'.

A pattern is left alone when fusing would change what it computes or reorder a read: the
mix output read by anything but one replicated rmsnorm, or viewed; an add whose output is
read between the add and the mix; an inner add read twice.

Second rewrite: ``y = rmsnorm(x, weight)`` whose only reader is a ``projection``,
``o_proj`` or ``lm_head`` taking ``y`` as its rows (the MoE's latent norm before
routed_expert_up, the final norm before the lm_head) becomes that node with ``x`` as its
rows, the norm weight as a third input and attrs ``input_norm_eps`` and
``input_norm_dtype`` (the norm output's dtype, where the reference rounds the normed rows,
so the fused reference equals the two nodes'). At one to four rows the GEMV forms normalize
while they stream (:mod:`stepgraph.runtime.kernels.splitk_gemm`): one launch less. A sharded norm
(``ways`` > 1: an all-reduced mean square), a projection split along its inputs (a
rank's columns of ``y``) or a viewed ``y`` is left alone.

Third rewrite: ``y = routed_experts(...)`` holding every expert (``local_experts`` =
``experts``), top-k at most ``combine_top_k``, whose only reader is such a projection taking
``y`` as its rows (the MoE's routed_expert_up, usually with its latent norm already fused
in), leaves the weighted sum to that projection: the experts node gets attr ``slots`` (and
``slot_dtype``, y's dtype) and writes ``<y>.slots``, float32 ``[R, k, W]``, each row's
expert outputs side by side; the projection reads the slots as its rows with attrs
``input_combine_top_k`` and ``input_combine_dtype`` and sums them first, in slot order
(the experts kernels' own combine order), rounded where y was stored. At one to four rows
the GEMV forms sum them while they stream (one launch less a layer); the MMA tiles run the
sum as a launch first. With more slots a row the GEMV's programs would each reread k x W float32
values, so top-k above ``combine_top_k`` keeps its combine.

``enabled`` off (the ablation) returns the graph unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Value
from stepgraph.passes.manager import CompileContext, PassResult

NORM_READERS = ("projection", "o_proj", "lm_head")
OUTPUT_SPLITS = ("heads", "rows", "vocab")  # a projection split along these reads whole rows


def _whole_rows(norm: Node, reader: Node) -> bool:
    """Whether ``reader`` reads the rows ``norm`` normalizes whole, placed alike (a
    replicated norm before a projection split along its outputs also qualifies; one split
    along its inputs reads a rank's columns, whose norm needs the other ranks')."""
    if reader.placement == norm.placement:
        return True
    return (norm.placement.kind == "replicated" and reader.placement.kind == "sharded"
            and reader.placement.dim in OUTPUT_SPLITS)


@dataclass(frozen=True)
class _Fusion:
    """One rewrite: the fused node and the nodes and values it replaces."""

    node: Node
    dropped_nodes: tuple[str, ...]
    dropped_values: tuple[str, ...]
    also: tuple[Node, ...] = ()  # further nodes it rewrites in place
    added_values: tuple[Value, ...] = ()  # values its nodes write that the graph lacks


class _Finder:
    """The graph's readers, writers and views, and the fusions they allow."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.users = graph.users()
        self.producers = graph.producers()
        self.viewed = {v.view.base for v in graph.values.values() if v.view is not None}
        self.taken: set[str] = set()

    def _private_temp(self, value: str) -> bool:
        """A temp nothing views (so its readers are exactly ``users``)."""
        v = self.g.values[value]
        return v.storage is Storage.TEMP and v.view is None and value not in self.viewed

    def _add_of(self, value: str) -> Node | None:
        """The add node writing ``value``, if it is one this pass may absorb."""
        writer = self.producers.get(value)
        if writer is None or writer in self.taken:
            return None
        node = self.g.node(writer)
        if node.op != "add" or node.outputs != (value,) or not self._private_temp(value):
            return None
        return node

    def _terms(self, add: Node, reader: str) -> tuple[list[str], list[str]]:
        """The add's operands with inner adds (read only by ``reader``) flattened in; and the
        inner adds' names."""
        terms: list[str] = []
        inner: list[str] = []
        for operand in add.inputs:
            sub = self._add_of(operand)
            if sub is not None and self.users.get(operand) == [reader]:
                more, deeper = self._terms(sub, sub.name)
                terms += more
                inner += [sub.name, *deeper]
            else:
                terms.append(operand)
        return terms, inner

    def fusion(self, mix: Node) -> _Fusion | None:
        """The fusion of ``mix`` with its norm (and the add of its last source), or None."""
        g = self.g
        (mixed,) = mix.outputs
        readers = self.users.get(mixed, [])
        if len(readers) != 1 or not self._private_temp(mixed):
            return None
        norm = g.node(readers[0])
        if (norm.op != "rmsnorm" or norm.inputs[0] != mixed
                or int(norm.attrs.get("ways", 1)) != 1 or norm.placement != mix.placement):
            return None
        count = int(mix.attrs["sources"])
        sources, weights = list(mix.inputs[:count]), list(mix.inputs[count:])
        last = sources[-1]
        add = self._add_of(last)
        deltas: list[str] = []
        inner: list[str] = []
        dropped = [mix.name, norm.name]
        outputs = [norm.outputs[0]]
        here = g.position(mix.name)
        if add is not None and all(g.position(user) >= here for user in self.users[last]):
            terms, inner = self._terms(add, add.name)
            sources[-1], deltas = terms[0], terms[1:]
            dropped += [add.name, *inner]
            outputs.append(last)
        fused = Node(
            name=mix.name,
            op="attn_res_norm",
            inputs=(*sources, *deltas, *weights, norm.inputs[1]),
            outputs=tuple(outputs),
            attrs={"sources": count, "deltas": len(deltas), "eps": mix.attrs["eps"],
                   "norm_eps": norm.attrs["eps"]},
            placement=mix.placement,
            layer=mix.layer,
            unit=mix.unit,
        )
        self.taken.update(dropped)
        inner_values = [g.node(name).outputs[0] for name in inner]
        return _Fusion(fused, tuple(dropped), (mixed, *inner_values))

    def norm_fusion(self, norm: Node) -> _Fusion | None:
        """The projection reading ``norm``'s output, with the norm as its input norm, or
        None."""
        g = self.g
        (normed,) = norm.outputs
        readers = self.users.get(normed, [])
        if (norm.name in self.taken or len(readers) != 1 or not self._private_temp(normed)
                or int(norm.attrs.get("ways", 1)) != 1):
            return None
        reader = g.node(readers[0])
        if (reader.op not in NORM_READERS or reader.inputs[0] != normed
                or normed in reader.inputs[1:] or len(reader.inputs) != 2
                or reader.name in self.taken or not _whole_rows(norm, reader)):
            return None
        fused = Node(
            name=reader.name, op=reader.op,
            inputs=(norm.inputs[0], reader.inputs[1], norm.inputs[1]),
            outputs=reader.outputs,
            attrs={**reader.attrs, "input_norm_eps": norm.attrs["eps"],
                   "input_norm_dtype": g.values[normed].type.dtype},
            placement=reader.placement, layer=reader.layer, unit=reader.unit,
        )
        self.taken.update((norm.name, reader.name))
        return _Fusion(fused, (norm.name, reader.name), (normed,))

    def combine_fusion(self, experts: Node, max_top_k: int) -> _Fusion | None:
        """The experts node writing slots and its projection summing them, or None."""
        g = self.g
        (routed,) = experts.outputs
        readers = self.users.get(routed, [])
        attrs = experts.attrs
        top_k = int(g.values[experts.inputs[1]].type.shape[1])
        if (experts.name in self.taken or len(readers) != 1 or not self._private_temp(routed)
                or attrs.get("slots") or top_k > max_top_k
                or int(attrs["local_experts"]) != int(attrs["experts"])):
            return None
        reader = g.node(readers[0])
        if (reader.op not in NORM_READERS or reader.inputs[0] != routed
                or routed in reader.inputs[1:] or reader.name in self.taken
                or reader.placement != experts.placement):
            return None
        value = g.values[routed]
        rows, width = value.type.shape
        slots = Value(f"{routed}.slots", TensorType((rows, top_k, width), "float32"),
                      Storage.TEMP)
        producer = Node(name=experts.name, op=experts.op, inputs=experts.inputs,
                        outputs=(slots.name,),
                        attrs={**attrs, "slots": True, "slot_dtype": value.type.dtype},
                        placement=experts.placement, layer=experts.layer, unit=experts.unit)
        consumer = Node(name=reader.name, op=reader.op,
                        inputs=(slots.name, *reader.inputs[1:]), outputs=reader.outputs,
                        attrs={**reader.attrs, "input_combine_top_k": top_k,
                               "input_combine_dtype": value.type.dtype},
                        placement=reader.placement, layer=reader.layer, unit=reader.unit)
        self.taken.update((experts.name, reader.name))
        return _Fusion(consumer, (reader.name,), (routed,), (producer,), (slots,))


@dataclass(frozen=True)
class Fuse:
    """Fuse each AttnRes prefix-sum add, mix and norm into one ``attn_res_norm`` node, norms
    into the projections they feed, and the routed experts' sum into routed_expert_up at
    top-k up to ``combine_top_k`` (2: measured on the H200, docs/perf.md, twelfth session;
    0 keeps every sum). See the module docstring; ``enabled`` off leaves the graph as it
    is."""

    name: ClassVar[str] = "fuse"
    enabled: bool = True
    combine_top_k: int = 2

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return the graph with every fusable residual path, projection norm and expert sum
        fused."""
        if not self.enabled:
            return PassResult(graph.copy(), False, "disabled")
        finder = _Finder(graph)
        fusions = [f for node in graph if node.op == "attn_res_mix"
                   if (f := finder.fusion(node)) is not None]
        norms = [f for node in graph if node.op == "rmsnorm"
                 if (f := finder.norm_fusion(node)) is not None]
        g = _apply(graph, (*fusions, *norms))
        finder = _Finder(g)
        combines = [f for node in g if node.op == "routed_experts"
                    if (f := finder.combine_fusion(node, self.combine_top_k)) is not None]
        g = _apply(g, combines)
        if not fusions and not norms and not combines:
            return PassResult(g, False, "no AttnRes mix, projection norm or expert sum to fuse")
        adds = sum(len(f.dropped_nodes) - 2 for f in fusions)
        mixes = sum(1 for n in graph if n.op == "attn_res_mix")
        summary = (f"fused {len(fusions)} of {mixes} AttnRes mixes with their norms and "
                   f"{adds} adds, {len(norms)} norms and {len(combines)} expert sums into "
                   f"their projections: {len(graph)} -> {len(g)} nodes")
        return PassResult(g, True, summary)


def _apply(graph: Graph, fusions: Sequence[_Fusion]) -> Graph:
    """A copy of ``graph`` rewritten with ``fusions``: their new values added, fused nodes
    where the replaced node of their name was, the other nodes and values they replace
    gone."""
    g = graph.copy()
    for f in fusions:
        for value in f.added_values:
            g.add_value(value)
    replace = {n.name: n for f in fusions for n in (f.node, *f.also)}
    dropped = {name for f in fusions for name in f.dropped_nodes} - set(replace)
    g.set_nodes(replace.get(n.name, n) for n in graph if n.name not in dropped)
    for f in fusions:
        for value in f.dropped_values:
            g.remove_value(value)
    return g
