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
so the fused reference equals the two nodes'). At one row the GEMV form normalizes while
it streams (:mod:`stepgraph.runtime.kernels.splitk_gemm`): one launch less. A sharded norm
(``ways`` > 1: an all-reduced mean square), a projection split along its inputs (a
rank's columns of ``y``) or a viewed ``y`` is left alone.

Third rewrite, where the target's tables ask for it (``fuse.mix_epilogue``): an
``attn_res_norm`` with a row (a delta, or a source: a block's first) that a ``projection``
or ``o_proj`` writes (o_proj before the MLP's step, routed_expert_up before the next
layer's) becomes that projection's epilogue: one node writing [product, normed, prefix sum
where the step has deltas] at the step's place (when no launch between the two reads the
product) or else at the projection's (when the step's other inputs are all written before
it), with attrs ``mix_sources``, ``mix_deltas``, ``mix_at`` (the product's place among the
sources and then deltas, which sum in order), ``mix_eps`` and ``mix_norm_eps``; the step's
other inputs follow the projection's own. At one row the GEMV's last program of a row runs
the step (one launch less a sublayer); other forms launch it after the product. The
reference computes the product, then the step, so it equals the two nodes'. A product that
is not a replicated projection's only output, or viewed, is left alone.

Fourth rewrite, where the tables ask for it (``fuse.router_epilogue``): a ``router`` whose
logits are a plain column view of a projection's only output (the MoE front's
``router_logits``), read by nothing else, becomes that projection's epilogue: the node
writes [product, ids, weights], with attr ``router`` (the router's attrs and the view's
``columns``) and the router's bias after the projection's inputs; the view goes. At one
row the GEMV's last program of a row routes it; other forms launch the router after.

``enabled`` off (the ablation) returns the graph unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage
from stepgraph.passes.bin import tables_for
from stepgraph.passes.manager import CompileContext, PassResult

NORM_READERS = ("projection", "o_proj", "lm_head")
MIX_PRODUCERS = ("projection", "o_proj")  # the ops an AttnRes step may become the epilogue of
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
    """One rewrite: the fused node, the nodes and values it replaces, and the replaced node
    whose place it takes (the one of its own name unless ``at`` says otherwise)."""

    node: Node
    dropped_nodes: tuple[str, ...]
    dropped_values: tuple[str, ...]
    at: str | None = None


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

    def mix_epilogue(self, mix: Node) -> _Fusion | None:
        """``mix`` (an ``attn_res_norm``) as the epilogue of a projection writing one of its
        rows (the deltas tried last first, then the sources), where one may stand (see
        :meth:`_epilogue_place`); else None."""
        g = self.g
        count, deltas = int(mix.attrs["sources"]), int(mix.attrs["deltas"])
        rows = list(mix.inputs[:count + deltas])
        here = g.position(mix.name)
        place = None
        for value in reversed(rows):  # the deltas first, then the latest source
            writer = g.node(self.producers[value]) if value in self.producers else None
            if (writer is None or writer.op not in MIX_PRODUCERS or writer.name in self.taken
                    or "mix_sources" in writer.attrs or writer.outputs != (value,)
                    or rows.count(value) != 1 or not self._private_temp(value)
                    or writer.placement != mix.placement):
                continue
            place = self._epilogue_place(writer, mix, value, here)
            if place is not None:
                break
        if place is None:
            return None
        at = rows.index(value)
        others = [*rows[:at], *rows[at + 1:], *mix.inputs[count + deltas:]]
        fused = Node(
            name=writer.name, op=writer.op, inputs=(*writer.inputs, *others),
            outputs=(value, *mix.outputs),
            attrs={**writer.attrs, "mix_sources": count, "mix_deltas": deltas, "mix_at": at,
                   "mix_eps": mix.attrs["eps"], "mix_norm_eps": mix.attrs["norm_eps"]},
            placement=writer.placement, layer=writer.layer, unit=writer.unit,
        )
        self.taken.update((writer.name, mix.name))
        return _Fusion(fused, (writer.name, mix.name), (), place)

    def _epilogue_place(self, writer: Node, mix: Node, value: str, here: int) -> str | None:
        """Where the projection with ``mix`` as its epilogue may stand: at the mix when no
        launch between them reads the product; else at the projection when the mix's other
        inputs are all written before it; else nowhere (None)."""
        g = self.g
        there = g.position(writer.name)
        if all(not there < g.position(user) < here for user in self.users[value]):
            return mix.name
        written = [g.position(self.producers[v]) for v in mix.inputs
                   if v != value and v in self.producers]
        return writer.name if all(p < there for p in written) else None

    def router_epilogue(self, router: Node) -> _Fusion | None:
        """``router`` as the epilogue of the projection whose output its logits view, or
        None."""
        g = self.g
        logits = router.inputs[0]
        view = g.values[logits].view
        if (view is None or view.groups != 1 or self.users.get(logits) != [router.name]
                or logits in self.viewed or view.base not in self.producers):
            return None
        writer = g.node(self.producers[view.base])
        if (writer.op not in MIX_PRODUCERS or writer.outputs != (view.base,)
                or "mix_sources" in writer.attrs or "router" in writer.attrs
                or writer.name in self.taken or writer.placement != router.placement):
            return None
        fused = Node(
            name=writer.name, op=writer.op, inputs=(*writer.inputs, *router.inputs[1:]),
            outputs=(view.base, *router.outputs),
            attrs={**writer.attrs, "router": {**router.attrs,
                                              "columns": [view.start, view.stop]}},
            placement=writer.placement, layer=writer.layer, unit=writer.unit,
        )
        self.taken.update((writer.name, router.name))
        return _Fusion(fused, (writer.name, router.name), (logits,))


def _apply(graph: Graph, fusions: list[_Fusion]) -> Graph:
    """A copy of ``graph`` with each fusion's node in the place of the dropped node it names
    (``at``, else its own name) and its other dropped nodes and values removed."""
    g = graph.copy()
    replace = {f.at or f.node.name: f.node for f in fusions}
    dropped = {name for f in fusions for name in f.dropped_nodes} - set(replace)
    g.set_nodes(replace.get(n.name, n) for n in graph if n.name not in dropped)
    for f in fusions:
        for value in f.dropped_values:
            g.remove_value(value)
    return g


def _rewrite(graph: Graph, op: str, rewrite: Callable[[_Finder, Node], _Fusion | None]
             ) -> tuple[Graph, list[_Fusion]]:
    """``graph`` with ``rewrite`` (a :class:`_Finder` method) made of every ``op`` node it
    takes, and those fusions."""
    finder = _Finder(graph)
    fusions = [f for node in graph if node.op == op if (f := rewrite(finder, node)) is not None]
    return _apply(graph, fusions), fusions


@dataclass(frozen=True)
class Fuse:
    """Fuse each AttnRes prefix-sum add, mix and norm into one ``attn_res_norm`` node, each
    lone norm into its projection and, where the target's tables ask, the AttnRes steps and
    routers into the projections before them (see the module docstring); ``enabled`` off
    leaves the graph as it is."""

    name: ClassVar[str] = "fuse"
    enabled: bool = True

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return the graph with every fusable residual path fused."""
        if not self.enabled:
            return PassResult(graph.copy(), False, "disabled")
        finder = _Finder(graph)
        fusions = [f for node in graph if node.op == "attn_res_mix"
                   if (f := finder.fusion(node)) is not None]
        norms = [f for node in graph if node.op == "rmsnorm"
                 if (f := finder.norm_fusion(node)) is not None]
        g = _apply(graph, [*fusions, *norms])
        rule = tables_for(g, ctx).fuse
        epilogues: list[_Fusion] = []
        routers: list[_Fusion] = []
        if rule.mix_epilogue:
            g, epilogues = _rewrite(g, "attn_res_norm", _Finder.mix_epilogue)
        if rule.router_epilogue:
            g, routers = _rewrite(g, "router", _Finder.router_epilogue)
        if not fusions and not norms and not epilogues and not routers:
            return PassResult(g, False, "no AttnRes mix or projection norm to fuse")
        adds = sum(len(f.dropped_nodes) - 2 for f in fusions)
        mixes = sum(1 for n in graph if n.op == "attn_res_mix")
        summary = (f"fused {len(fusions)} of {mixes} AttnRes mixes with their norms and "
                   f"{adds} adds, {len(norms)} norms into their projections"
                   + (f", {len(epilogues)} AttnRes steps into the projections before them"
                      if epilogues else "")
                   + (f", {len(routers)} routers into their logits' projections"
                      if routers else "") + f": {len(graph)} -> {len(g)} nodes")
        return PassResult(g, True, summary)
