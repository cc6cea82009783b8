"""The ``streams`` pass: independent branches onto a side stream.

A decode step at few rows is one chain of launches, and most of them leave HBM partly idle
(a router, a norm, a GEMM's ramp and tail). A node whose op the tactic tables list under
``streams.side_ops`` (K3: the shared expert, which nothing on the routed path reads) is
moved to run as early as its inputs allow, right after the last node writing one of them,
and is marked to run on the device's side stream: the runtime forks it there and makes the
main stream wait for it (a join) right before the first node that reads one of its outputs,
or ``streams.join_lead`` main-stream launches before it (the launch that carries the join
starts only once the branch's last launch has let it, as well as its main-stream
predecessor: captured, both its edges are PDL edges; a lead puts that wait on a launch that
loses less by it, e.g. the MoE's last GEMV instead of the next AttnRes mix, which loads its
sources before its wait). Between the fork and the join its launches
overlap the main chain's.

What may move: a compute node that updates no state, reads only values written before its
new position (it moves earlier, never past a reader) and whose outputs nothing between its
new and old positions reads. Nothing else moves, so collectives keep their relative order.
A branch whose window (fork to join) holds a collective stays on the main stream, where it
was: NCCL kernels beside a side stream inside a CUDA graph are not verified on two GPUs yet.

Signal: with ``streams.signal`` (table data) a branch joins before its first reader itself
(``join_lead`` unused) and ``meta["streams"]["signal"]`` asks the runtime to hand it over
without a graph edge: the branch's last launch is followed by one that sets a flag, and the
reader's launch waits on the flag (an AttnRes step waits before it lets its own dependents
launch, so the branch always finds SMs to run on); a reader whose launch cannot wait gets
the graph join. On the H200 the join's edge kept the launch carrying it from starting
early under PDL (docs/perf.md, eighteenth session).

Root fork: with ``streams.root_fork`` (table data) a graph that has side branches also
forks one empty launch onto the side stream before the step's first launch, joined at the
step's end (``meta["streams"]["root_fork"]``; the runtime adds it): on the H200 that makes
the step several microseconds faster (measured; why is not established). Its window is the
whole step, so a graph with a collective gets none (as a branch beside one stays on the
main stream).

Memory: the arena is planned for concurrent branches. ``meta["streams"]["side"]`` maps each
side node to the node it joins before (None: the step's end), and
:func:`stepgraph.memory.liveness.live_ranges` keeps every temp a side node reads or writes
live until that join, so no main-stream launch of the window reuses its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage
from stepgraph.passes.bin import tables_for
from stepgraph.passes.manager import CompileContext, PassResult
from stepgraph.passes.pdl import is_collective


def _temp_roots(graph: Graph, names: tuple[str, ...]) -> set[str]:
    """The arena roots (temps, views followed to their base) among ``names``."""
    roots = (graph.root(name) for name in names)
    return {root for root in roots if graph.values[root].storage is Storage.TEMP}


def _earliest(graph: Graph, nodes: list[Node], index: int) -> int:
    """The position right after the last node before ``index`` that writes one of
    ``nodes[index]``'s temp inputs (0 when none does)."""
    wanted = _temp_roots(graph, nodes[index].inputs)
    for position in range(index - 1, -1, -1):
        if wanted & {graph.root(out) for out in nodes[position].outputs}:
            return position + 1
    return 0


def _join_before(graph: Graph, nodes: list[Node], index: int, side: set[str],
                 lead: int = 0) -> str | None:
    """The node the side branch ``nodes[index]`` joins before: the first node after it that
    reads one of its outputs, moved ``lead`` main-stream launches earlier (never onto the
    branch itself or a launch before it; ``side``: the nodes already on the side stream)."""
    outputs = {graph.root(out) for out in nodes[index].outputs}
    reader = next((i for i in range(index + 1, len(nodes))
                   if outputs & {graph.root(name) for name in nodes[i].inputs}), None)
    if reader is None:
        return None
    main = [i for i in range(index + 1, reader + 1) if nodes[i].name not in side]
    return nodes[main[max(0, len(main) - 1 - lead)]].name


@dataclass(frozen=True)
class Streams:
    """Move the tables' ``streams.side_ops`` nodes to their earliest position and mark them
    for the side stream; ``enabled=False`` keeps one stream (ablation)."""

    name: ClassVar[str] = "streams"
    enabled: bool = True

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return a copy with side nodes moved and ``meta["streams"]`` set."""
        g = graph.copy()
        rule = tables_for(g, ctx).streams
        side_ops = rule.side_ops if self.enabled else ()
        lead = 0 if rule.signal else rule.join_lead  # a signalled branch joins at its reader
        nodes = list(g)
        side: dict[str, str | None] = {}
        moved = kept = 0
        for node in [n for n in nodes if n.op in side_ops]:
            if node.updates:
                continue  # a state's accesses keep their order on the main stream
            index = next(i for i, n in enumerate(nodes) if n is node)
            target = _earliest(g, nodes, index)
            trial = [*nodes[:target], node, *nodes[target:index], *nodes[index + 1:]]
            join = _join_before(g, trial, target, set(side), lead)
            stop = next((i for i, n in enumerate(trial) if n.name == join), len(trial))
            if any(is_collective(n) for n in trial[target + 1:stop]):
                kept += 1  # NCCL beside a side stream: not verified on two GPUs yet
                continue
            nodes = trial
            moved += target < index
            side[node.name] = join
        g.set_nodes(nodes)
        g.meta["streams"] = {"side": side, "side_ops": list(side_ops),
                             "join_lead": lead,
                             "signal": bool(side) and rule.signal,
                             "root_fork": (bool(side) and rule.root_fork
                                           and not any(is_collective(n) for n in nodes))}
        if not self.enabled:
            return PassResult(g, False, "disabled (ablation): one stream")
        note = f"; {kept} kept on the main stream (a collective in their window)" if kept else ""
        if not side:
            return PassResult(g, False, f"no side-stream branch{note or ' in this graph'}")
        ops = sorted({g.node(name).op for name in side})
        return PassResult(g, moved > 0, f"{len(side)} {'/'.join(ops)} node(s) on the side "
                                        f"stream, {moved} moved earlier{note}")
