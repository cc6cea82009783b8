"""The ``pdl`` pass: programmatic dependent launch marks, pre-wait weight bytes, and L2
prefetch forks.

PDL lets a launch start while its predecessor in the stream finishes; it must wait
(griddepcontrol.wait) before reading what the predecessor wrote, but may load its weights
before the wait, since weights never depend on the predecessor. The rules, per launch in
program order (prefetch forks run on a side stream and are not in the chain):

* a launch's predecessor is the launch before it on its own stream (the streams pass's side
  branches form their own);
* the first launch of the step cannot: it follows the host's input copy (the first on the
  side stream may: it follows the fork's event wait, and PDL chains its node's launches);
* a collective cannot: NCCL launches it, without the PDL attribute;
* a launch right after a collective or a host-side operation (a provider the tables mark
  ``host``, or a node with ``attrs["host_side"]``) cannot: its predecessor never triggers an
  early launch;
* per bin (when ``bin`` ran): a launch whose provider cannot wait on griddepcontrol (the
  tables' ``pdl: false``), one after such a launch, and every launch of a bin on the stock
  path cannot; those bins are listed in ``off_bins``.

Pre-wait bytes (``prefetch_bytes``): the launch's weight bytes, excluding weights selected by
the routing (routed experts: which experts is known only after the router), capped at
``sms x tiles_before_wait x tile_bytes`` from the tables (the first tiles each SM streams
before its wait); 0 for a launch that cannot use PDL.

Prefetch forks (the seeds' fork points): ``attention_moe`` beside the attention core (before
a KDA core, after an MLA/DSA core, as the seeds fork) and ``oproj_down`` right after the
o-projection. Both warm the same layer's MLP weights (the next unit): the MLP's matrix
weights in launch order, routed-expert weights skipped, vectors (norms, biases) skipped as
negligible; ``attention_moe`` takes the first ``fork_budget_bytes``, ``oproj_down`` the next
(a weight that does not fit whole is warmed from its first rows). Each fork is an op
``prefetch`` node: inputs the weights, no outputs, attrs ``bytes`` (total),
``weight_offsets`` / ``weight_bytes`` (per input: the byte range warmed), ``target`` (the
first node reading them) and ``fork``. The tables' ``prefetch.rule: next_weights`` forks
instead after every weight-streaming launch that small launches follow (``streaming``),
warming the next streaming launch's first ``fork_budget_bytes``. The runtime runs a fork on a
side stream, outside the PDL chain; the H200 table sets the budget to 0 (no forks): they
measured slower there.

Pre-wait inputs (``pre_wait_inputs``, :func:`pre_wait_inputs`): the inputs a PDL launch may
read before its wait besides weights, e.g. an AttnRes mix's earlier sources.

``meta["pdl"][node] = {"pdl", "reason", "prefetch_bytes"}`` (+ ``off_bins``: {rows: why};
``pre_wait_inputs`` on PDL launches);
``meta["pdl_config"]`` records the options. With ``enabled=False`` (ablation) no node uses
PDL, no fork is inserted, and every entry says the pass is disabled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.ops import OPS
from stepgraph.ir.types import Storage
from stepgraph.passes.bin import STOCK, tables_for
from stepgraph.passes.manager import CompileContext, PassResult
from stepgraph.tactics import TacticTables

CORE_OPS = ("kda_core", "mla_core", "dsa_core")
FORK_ATTENTION = "attention_moe"
FORK_OPROJ = "oproj_down"
FORK_NEXT = "next_weights"
DISABLED = "pdl pass disabled (ablation): launched without PDL"
_NONE: dict[str, Any] = {}  # the decisions of a node the bin pass did not see


def uses_pdl_at(mark: Mapping[str, Any] | None, rows: str) -> bool:
    """Whether a launch with this ``meta["pdl"]`` mark waits in the PDL chain at bin ``rows``
    (its row count as a string, the key ``off_bins`` uses)."""
    return mark is not None and bool(mark.get("pdl")) and rows not in mark.get("off_bins", {})


def is_collective(node: Node) -> bool:
    """Whether ``node`` is a collective (launched by NCCL)."""
    opdef = OPS.get(node.op)
    return opdef is not None and opdef.category == "collective"


def selected_weights(node: Node) -> set[str]:
    """Weights of which a launch reads only the parts its data selects: routed experts'
    stacked weights (the router picks the experts) and the embedding table (the tokens pick
    its rows)."""
    if node.op == "routed_experts":
        return set(node.inputs[3:])
    if node.op == "embed":
        return set(node.inputs)
    return set()


def pre_wait_bytes(graph: Graph, node: Node, cap: int,
                   sizes: dict[str, int] | None = None) -> int:
    """The weight bytes ``node`` may load before its PDL wait, at most ``cap`` (``sizes``:
    an optional cache of weight bytes by name)."""
    skip = selected_weights(node)
    sizes = {} if sizes is None else sizes
    total = 0
    for name in dict.fromkeys(node.inputs):
        value = graph.values[name]
        if value.storage is Storage.WEIGHT and name not in skip:
            if name not in sizes:
                sizes[name] = value.nbytes_static
            total += sizes[name]
    return min(total, cap)


# ----------------------------------------------------------------------------- prefetch forks


Slice = tuple[str, int, int, str]  # (weight, byte offset, bytes, first reader)


def _matrix_weights(graph: Graph, node: Node) -> list[Slice]:
    """The matrix weights ``node`` reads before its wait (not the ones its data selects;
    vectors skipped as negligible), in input order, whole."""
    skip = selected_weights(node)
    queue: list[Slice] = []
    for name in dict.fromkeys(node.inputs):
        value = graph.values[name]
        if value.storage is Storage.WEIGHT and name not in skip and len(value.type.shape) >= 2:
            queue.append((name, 0, value.nbytes_static, node.name))
    return queue


def _mlp_queue(graph: Graph, nodes: list[Node]) -> list[Slice]:
    """The MLP matrix weights of ``nodes`` (one layer's) in launch order, whole, each once."""
    queue: list[Slice] = []
    seen: set[str] = set()
    for node in nodes:
        if node.unit == "mlp":
            for part in _matrix_weights(graph, node):
                if part[0] not in seen:
                    seen.add(part[0])
                    queue.append(part)
    return queue


def _take(queue: list[Slice], budget: int) -> list[Slice]:
    """Pop up to ``budget`` bytes off the front of ``queue``; a partly taken weight stays
    queued from the first byte not taken."""
    taken: list[Slice] = []
    while queue and budget > 0:
        name, offset, size, reader = queue[0]
        part = min(size, budget)
        taken.append((name, offset, part, reader))
        budget -= part
        if part == size:
            queue.pop(0)
        else:
            queue[0] = (name, offset + part, size - part, reader)
    return taken


def _fork_node(layer: int | None, fork: str, taken: list[Slice], unit: str | None,
               name: str | None = None) -> Node:
    return Node(
        name=name or f"l{layer}.prefetch_{fork}",
        op="prefetch",
        inputs=tuple(name for name, _, _, _ in taken),
        outputs=(),
        attrs={"bytes": sum(part for _, _, part, _ in taken),
               "weight_offsets": [offset for _, offset, _, _ in taken],
               "weight_bytes": [part for _, _, part, _ in taken],
               "target": taken[0][3], "fork": fork},
        layer=layer,
        unit=unit,
    )


def insert_forks(graph: Graph, nodes: list[Node], budget: int) -> list[Node]:
    """``nodes`` with the prefetch forks of every layer inserted at the seeds' fork points."""
    by_layer: dict[int, list[Node]] = {}
    for node in nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node)
    before: dict[str, Node] = {}
    after: dict[str, Node] = {}
    for layer, members in by_layer.items():
        queue = _mlp_queue(graph, members)
        core = next((n for n in members if n.op in CORE_OPS), None)
        oproj = next((n for n in members if n.op == "o_proj"), None)
        if core is not None:
            taken = _take(queue, budget)
            if taken:
                fork = _fork_node(layer, FORK_ATTENTION, taken, core.unit)
                (before if core.op == "kda_core" else after)[core.name] = fork
        if oproj is not None:
            taken = _take(queue, budget)
            if taken:
                after[oproj.name] = _fork_node(layer, FORK_OPROJ, taken, oproj.unit)
    result: list[Node] = []
    for node in nodes:
        if node.name in before:
            result.append(before[node.name])
        result.append(node)
        if node.name in after:
            result.append(after[node.name])
    return result


def streaming(graph: Graph, node: Node, stream_min: int, sizes: dict[str, int]) -> bool:
    """Whether ``node`` streams weights: at least ``stream_min`` weight bytes it may read
    before its wait, or routed experts (whose bytes the routing selects)."""
    return (node.op == "routed_experts"
            or pre_wait_bytes(graph, node, stream_min, sizes) >= stream_min)


def insert_forks_next(graph: Graph, nodes: list[Node], budget: int,
                      stream_min: int) -> list[Node]:
    """``nodes`` with a fork after every streaming launch that small launches follow,
    warming the first ``budget`` bytes of the next streaming launch's weights (none when that
    is routed experts: the router has not chosen them yet)."""
    sizes: dict[str, int] = {}
    stream = [i for i, node in enumerate(nodes) if streaming(graph, node, stream_min, sizes)]
    after: dict[str, Node] = {}
    for here, there in pairwise(stream):
        target = nodes[there]
        if there == here + 1 or target.op == "routed_experts":
            continue
        taken = _take(_matrix_weights(graph, target), budget)
        if taken:
            after[nodes[here].name] = _fork_node(target.layer, FORK_NEXT, taken, target.unit,
                                                 name=f"{target.name}.prefetch")
    result: list[Node] = []
    for node in nodes:
        result.append(node)
        if node.name in after:
            result.append(after[node.name])
    return result


# ----------------------------------------------------------------------------- marks


def pre_wait_inputs(graph: Graph, nodes: list[Node],
                    side: dict[str, str | None]) -> dict[str, list[str]]:
    """Per main-stream launch, the inputs it may read before its PDL wait: those no launch
    of the step writes before it (weights, step inputs, states from earlier steps), those
    last written by a main-stream launch before its predecessor (a PDL launch starts only
    once its predecessor has passed its own wait, so every earlier launch has completed),
    and those of a side branch joined at or before it. What the predecessor writes, or a
    branch joined later, is read only after the wait."""
    position = {node.name: i for i, node in enumerate(nodes)}
    last_writer: dict[str, int] = {}
    previous: int | None = None
    safe: dict[str, list[str]] = {}
    for i, node in enumerate(nodes):
        on_main = node.op != "prefetch" and node.name not in side
        if on_main:
            readable = []
            for name in node.inputs:
                writer = last_writer.get(graph.root(name))
                if writer is None:
                    readable.append(name)
                    continue
                if nodes[writer].name in side:
                    join = side[nodes[writer].name]
                    done = join is not None and position[join] <= i
                else:
                    done = previous is not None and writer < previous
                if done:
                    readable.append(name)
            safe[node.name] = readable
        for name in (*node.outputs, *node.updates):
            last_writer[graph.root(name)] = i
        if on_main:
            previous = i
    return safe


def _structural(node: Node, previous: Node | None, host_ops: set[str],
                on_side: bool = False) -> str | None:
    """Why ``node`` cannot use PDL whatever the bin (None: it can); ``previous``: the launch
    before it on its own stream."""
    if previous is None:
        # the side stream's first launch follows the fork's event wait: PDL changes nothing
        # for it and lets the launches of its node chain
        return None if on_side else "first launch of the step: it follows the host's input copy"
    if is_collective(node):
        return f"{node.op} is a collective: NCCL launches it without the PDL attribute"
    if node.attrs.get("host_side") or node.name in host_ops:
        return "a host-side operation"
    if is_collective(previous):
        return (f"follows collective {previous.name} ({previous.op}): NCCL kernels never "
                "trigger the dependent launch")
    if previous.attrs.get("host_side") or previous.name in host_ops:
        return f"follows host-side operation {previous.name}"
    return None


def _provider_verdict(mine: str | None, theirs: str | None, tables: TacticTables) -> str | None:
    """Why a launch with provider ``mine`` after one with provider ``theirs`` cannot use PDL
    (None: it can; ``{previous}`` stands for the predecessor's name)."""
    if mine == STOCK:
        return "runs the stock path at this bin"
    info = tables.data.providers.get(mine) if mine is not None else None
    if info is not None and not info.pdl:
        return f"provider {mine} cannot wait on griddepcontrol"
    if theirs is None:
        return None
    info = tables.data.providers.get(theirs)
    if theirs == STOCK or (info is not None and info.host):
        return f"follows host-side operation {{previous}} ({theirs})"
    if info is not None and not info.pdl:
        return f"follows {{previous}} ({theirs}), which never triggers the dependent launch"
    return None


@dataclass(frozen=True)
class Pdl:
    """Mark PDL launches, their pre-wait weight bytes, and insert L2 prefetch forks.

    ``enabled=False`` turns the whole pass off (ablation); ``prefetch=False`` keeps the PDL
    marks but inserts no fork."""

    name: ClassVar[str] = "pdl"
    enabled: bool = True
    prefetch: bool = True

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return a copy with forks inserted and ``meta["pdl"]`` filled."""
        g = graph.copy()
        tables = tables_for(g, ctx)
        nodes = [n for n in g if n.op != "prefetch"]
        removed = len(g) - len(nodes)
        if "decisions" in g.meta:  # edited below: this graph gets its own top level
            g.meta["decisions"] = {name: per_bin for name, per_bin in g.meta["decisions"].items()
                                   if not g.has_node(name) or g.node(name).op != "prefetch"}
        rule = tables.prefetch
        g.meta["pdl_config"] = {"enabled": self.enabled, "prefetch": self.prefetch,
                                "pre_wait_cap_bytes": tables.pre_wait_bytes,
                                "fork_budget_bytes": rule.fork_budget_bytes,
                                "fork_rule": rule.rule}
        if not self.enabled:
            g.set_nodes(nodes)
            g.meta["pdl"] = {n.name: {"pdl": False, "reason": DISABLED, "prefetch_bytes": 0}
                             for n in nodes}
            return PassResult(g, True, "disabled (ablation): no PDL, no prefetch forks")
        if self.prefetch and rule.rule == "next_weights":
            nodes = insert_forks_next(g, nodes, rule.fork_budget_bytes, rule.stream_min_bytes)
        elif self.prefetch:
            nodes = insert_forks(g, nodes, rule.fork_budget_bytes)
        g.set_nodes(nodes)

        decisions = g.meta.get("decisions", {})
        bins = [str(e["rows"]) for e in g.meta.get("bins", [])]
        stock_bins = {str(e["rows"]) for e in g.meta.get("bins", []) if e.get("path") == STOCK}
        host_ops = {n.name for n in nodes if n.attrs.get("host_side")}
        side = g.meta.get("streams", {}).get("side", {})
        readable = pre_wait_inputs(g, nodes, side)
        cap = tables.pre_wait_bytes
        marks: dict[str, dict[str, Any]] = {}
        last_on: dict[bool, Node | None] = {False: None, True: None}  # per stream: side?
        used = 0
        verdicts: dict[tuple[str | None, str | None], str | None] = {}
        templates: dict[tuple[int, int], dict[str, str]] = {}
        weight_bytes: dict[str, int] = {}
        for node in nodes:
            if node.op == "prefetch":
                marks[node.name] = {
                    "pdl": False,
                    "reason": f"L2 prefetch fork {node.attrs['fork']} on a side stream "
                              f"({node.attrs['bytes']} bytes for {node.attrs['target']}); "
                              "not in the PDL chain",
                    "prefetch_bytes": 0,
                }
                continue
            on_side = node.name in side
            previous = last_on[on_side]  # the launch before it on its own stream
            why = _structural(node, previous, host_ops, on_side)
            entry: dict[str, Any]
            if why is not None:
                entry = {"pdl": False, "reason": why, "prefetch_bytes": 0}
            else:
                mine_all = decisions.get(node.name, _NONE)
                theirs_all = decisions.get(previous.name, _NONE) if previous else _NONE
                pair = (id(mine_all), id(theirs_all))
                template = templates.get(pair)
                if template is None:
                    template = {}
                    for rows in bins:
                        if rows in stock_bins:
                            template[rows] = f"bin {rows} runs the stock path"
                            continue
                        mine, theirs = mine_all.get(rows), theirs_all.get(rows)
                        key = (mine and mine["provider"], theirs and theirs["provider"])
                        if key not in verdicts:
                            verdicts[key] = _provider_verdict(*key, tables)
                        if verdicts[key] is not None:
                            template[rows] = verdicts[key]
                    templates[pair] = template
                off = {rows: text.format(previous=previous.name if previous else "")
                       for rows, text in template.items()}
                if bins and len(off) == len(bins):
                    first = off[bins[0]]
                    same = all(r == first for r in off.values())
                    entry = {"pdl": False, "prefetch_bytes": 0,
                             "reason": first if same else "no bin can: " + "; ".join(
                                 f"{r}: {w}" for r, w in off.items())}
                else:
                    reason = "launched with PDL; weights load before the wait"
                    if not bins:
                        reason += " (no bin decisions: provider support unchecked)"
                    entry = {"pdl": True, "reason": reason,
                             "prefetch_bytes": pre_wait_bytes(g, node, cap, weight_bytes),
                             "pre_wait_inputs": readable.get(node.name, [])}
                    if off:
                        entry["off_bins"] = off
                    used += 1
            marks[node.name] = entry
            last_on[on_side] = node
        g.meta["pdl"] = marks
        if decisions:
            _decide_forks(g, tables, bins, stock_bins)
        forks = sum(1 for n in nodes if n.op == "prefetch")
        launches = len(nodes) - forks
        return PassResult(g, True, f"{used} of {launches} launches use PDL; {forks} prefetch "
                          f"forks inserted" + (f" ({removed} old ones replaced)" if removed
                                                else ""))


def _decide_forks(graph: Graph, tables: TacticTables, bins: list[str],
                  stock_bins: set[str]) -> None:
    """Give the inserted prefetch nodes a decision per bin, as ``bin`` gives every node."""
    provider = tables.providers("prefetch")[0]
    decisions = graph.meta["decisions"]
    run = {"provider": provider, "tactic": {},
           "reason": f"{tables.label}: prefetch -> {provider} (inserted by the pdl pass)"}
    skip = {"provider": STOCK, "tactic": {}, "reason": "the stock path prefetches nothing"}
    for node in graph:
        if node.op == "prefetch":
            decisions[node.name] = {r: (skip if r in stock_bins else run) for r in bins}
