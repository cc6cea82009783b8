"""The ``schedule`` pass: the launch order of the step.

The frontend's program order is already a valid (topological) order. This pass keeps it
except inside short runs where another order lowers the peak of live temp bytes, and it
is deliberately conservative about what may move:

* only ``compute`` nodes move, and only inside a *run*: a maximal stretch of consecutive
  compute nodes of the same layer and unit. Collectives, prefetches and every other
  non-compute node stay exactly where they are, so all ranks keep issuing collectives in
  the same relative order, and the units that the pdl pass and the trace see stay
  contiguous and in order;
* inside a run, data dependencies (through views, to their base) and the order of every
  state's accesses (a write after any earlier read or write of the same state, a read
  after the earlier write) are kept;
* a run is reordered only when the best order's peak, at the largest bin's sizes, is
  strictly below program order's; the search is exact (see
  :mod:`stepgraph.memory.reorder`) and falls back to program order on large runs.

Since bytes outside a run do not depend on the order inside it, minimizing each run's
peak minimizes the step's lower bound. The pass records nothing in ``meta``; its summary
says how many runs moved and the lower bound before and after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.ops import OPS
from stepgraph.ir.types import Storage
from stepgraph.memory.arena import bin_rows
from stepgraph.memory.buffer import Buffer
from stepgraph.memory.liveness import LivenessError, buffers_at, lower_bound
from stepgraph.memory.reorder import RunBuffer, best_order
from stepgraph.passes.manager import CompileContext, PassError, PassResult


def _runs(graph: Graph) -> list[tuple[int, int]]:
    """[start, stop) of every maximal stretch of compute nodes sharing (layer, unit)."""
    runs: list[tuple[int, int]] = []
    start, key = 0, None
    for index, node in enumerate(graph):
        opdef = OPS.get(node.op)
        movable = opdef is not None and opdef.category == "compute"
        this = (node.layer, node.unit) if movable else None
        if this is None or this != key:
            if key is not None and index - start > 1:
                runs.append((start, index))
            start, key = index, this
    if key is not None and len(graph) - start > 1:
        runs.append((start, len(graph)))
    return runs


@dataclass(frozen=True)
class _Facts:
    """What the run builder needs: the memory root of every view, the program position of
    the node writing each written value, the readers (program positions) and size of each
    arena temp, and the names of the states."""

    root: dict[str, str]
    producer: dict[str, int]
    readers: dict[str, list[int]]
    size: dict[str, int]
    states: frozenset[str]


def _facts(graph: Graph, buffers: list[Buffer]) -> _Facts:
    root = {name: graph.root(name) for name, value in graph.values.items()
            if value.view is not None}
    states = frozenset(name for name, value in graph.values.items()
                       if value.storage is Storage.STATE)
    size = {b.name: b.size for b in buffers}
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(graph):
        for name in node.outputs:
            producer[name] = index
        for name in node.inputs:
            base = root.get(name, name)
            if base in size:
                seen = readers.setdefault(base, [])
                if not seen or seen[-1] != index:
                    seen.append(index)
    return _Facts(root, producer, readers, size, states)


def _order_run(nodes: list[Node], start: int, facts: _Facts,
               max_states: int) -> tuple[tuple[int, ...], int, int]:
    """(order, peak, program peak) of the run ``nodes`` = program positions
    start..start+len-1."""
    stop = start + len(nodes)
    preds = [0] * len(nodes)
    last_write: dict[str, int] = {}
    reads_since: dict[str, int] = {}
    touched: dict[str, None] = {}
    for task, node in enumerate(nodes):
        for name in node.inputs:
            base = facts.root.get(name, name)
            made = facts.producer.get(base, -1)
            if start <= made < stop:
                preds[task] |= 1 << (made - start)
            if base in facts.size:
                touched[base] = None
            elif name in facts.states:
                if name in last_write:
                    preds[task] |= 1 << last_write[name]
                if name not in node.updates:
                    reads_since[name] = reads_since.get(name, 0) | (1 << task)
        for name in node.updates:
            preds[task] |= reads_since.pop(name, 0) & ~(1 << task)
            if name in last_write:
                preds[task] |= 1 << last_write[name]
            last_write[name] = task
        for name in node.outputs:
            if name in facts.size:
                touched[name] = None
    buffers = []
    for name in touched:
        made = facts.producer[name]
        mask, kept = 0, False
        for index in facts.readers.get(name, ()):
            if index >= stop:
                kept = True
            elif index >= start:
                mask |= 1 << (index - start)
        producer = made - start if made >= start else None
        buffers.append(RunBuffer(facts.size[name], producer, mask, kept))
    result = best_order(preds, buffers, max_states)
    return result.order, result.peak, result.program_peak


@dataclass(frozen=True)
class Schedule:
    """Choose the launch order: program order, with runs of compute nodes of one unit
    reordered where that strictly lowers their peak of live temps (``reorder`` False:
    program order as is). ``max_states`` bounds the exact search per run."""

    name: ClassVar[str] = "schedule"
    reorder: bool = True
    max_states: int = 4096

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return the graph with its nodes in launch order."""
        g = graph.copy()
        if not self.reorder:
            return PassResult(g, False, "program order kept (reorder off)")
        rows = max(bin_rows(graph, ctx.deployment.batches))
        try:
            buffers = buffers_at(graph, rows)
        except LivenessError as error:
            raise PassError(self.name, str(error)) from None
        facts = _facts(graph, buffers)
        before = lower_bound(buffers)
        program = graph.nodes
        nodes = list(program)
        moved = 0
        for start, stop in _runs(graph):
            order, peak, program_peak = _order_run(nodes[start:stop], start, facts,
                                                   self.max_states)
            if peak < program_peak:
                nodes[start:stop] = [program[start + task] for task in order]
                moved += 1
        if not moved:
            return PassResult(g, False, f"program order kept (lower bound {before} bytes at "
                                        f"{rows} rows)")
        g.set_nodes(nodes)
        after = lower_bound(buffers_at(g, rows))
        return PassResult(g, True, f"reordered {moved} runs: lower bound {before} -> {after} "
                                   f"bytes at {rows} rows")
