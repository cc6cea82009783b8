"""Liveness of a step's temps over its launch order, as abstract buffers for the planner.

Launch index i is the i-th node of the graph's program order (the schedule). A temp lives
from its producer's launch to its last reader's launch, both inclusive (the producer's own
launch when nothing reads it). A view has no memory of its own: reading it reads its base,
so it extends the base's lifetime. A side-stream node's temps live until its branch joins
the main stream (see :mod:`stepgraph.passes.streams`). Weights, states, inputs and outputs
are not in the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage, TensorType
from stepgraph.memory.buffer import Buffer


class LivenessError(UserError):
    """A temp the arena cannot hold: read but never written, or sized by a symbol other
    than the step's rows."""


def live_ranges(graph: Graph) -> dict[str, tuple[int, int]]:
    """Every arena temp (a temp that is not a view) -> (first, last) launch, inclusive, in
    order of production. Independent of the row count."""
    values = graph.values
    roots: dict[str, str | None] = {}  # value -> its arena root, None when not in the arena

    def arena_root(name: str) -> str | None:
        if name not in roots:
            root = graph.root(name)
            roots[name] = root if values[root].storage is Storage.TEMP else None
        return roots[name]

    ranges: dict[str, list[int]] = {}
    for index, node in enumerate(graph):
        for name in node.inputs:
            root = arena_root(name)
            if root is None:
                continue
            span = ranges.get(root)
            if span is None:
                raise LivenessError(
                    f"temp {root} is read by node {node.name} before any node writes it")
            span[1] = index
        for name in node.outputs:
            if arena_root(name) == name:
                ranges[name] = [index, index]
    _hold_side_branches(graph, ranges, arena_root)
    return {name: (span[0], span[1]) for name, span in ranges.items()}


def side_branches(graph: Graph) -> dict[str, str | None]:
    """The streams pass's side-stream nodes (``meta["streams"]["side"]``) -> the node their
    branch joins before (None: the step's end); empty for a graph on one stream."""
    return dict(graph.meta.get("streams", {}).get("side", {}))


def _hold_side_branches(graph: Graph, ranges: dict[str, list[int]],
                        arena_root: Callable[[str], str | None]) -> None:
    """Keep every temp a side-stream node reads or writes (the streams pass's
    ``meta["streams"]["side"]``) live until the node its branch joins before (the last
    launch when it joins at the end): the main stream's launches of the window run beside
    it and must not reuse those bytes."""
    for name, join in side_branches(graph).items():
        if not graph.has_node(name):
            continue
        until = graph.position(join) if join is not None else len(graph) - 1
        node = graph.node(name)
        for value in (*node.inputs, *node.outputs):
            root = arena_root(value)
            if root is not None and root in ranges:
                ranges[root][1] = max(ranges[root][1], until)


def buffers_at(graph: Graph, rows: int,
               ranges: dict[str, tuple[int, int]] | None = None) -> list[Buffer]:
    """The arena buffers of ``graph`` at ``rows`` rows (``ranges``: a precomputed
    :func:`live_ranges`), in order of production."""
    return buffers_for(graph, [rows], ranges)[0]


def buffers_for(graph: Graph, rows: Sequence[int],
                ranges: dict[str, tuple[int, int]] | None = None) -> list[list[Buffer]]:
    """:func:`buffers_at` for each row count of ``rows`` (sizes each distinct type once)."""
    if ranges is None:
        ranges = live_ranges(graph)
    kinds: dict[TensorType, int] = {}  # temps share a handful of types
    kind_of = [kinds.setdefault(graph.values[name].type, len(kinds)) for name in ranges]
    result = []
    for r in rows:
        sizes = []
        for kind in kinds:
            try:
                sizes.append(kind.nbytes(r))
            except KeyError:
                name = next(n for n in ranges if graph.values[n].type == kind)
                raise LivenessError(
                    f"temp {name} is {kind}: an arena temp may only use the row dims "
                    f"B, B*n, B/n") from None
        result.append([Buffer(name, sizes[k], first, last)
                       for (name, (first, last)), k in zip(ranges.items(), kind_of,
                                                           strict=True)])
    return result


def live_bytes(buffers: Iterable[Buffer]) -> list[int]:
    """Bytes live at each launch index 0..max(last)."""
    items = list(buffers)
    if not items:
        return []
    delta = [0] * (max(b.last for b in items) + 2)
    for b in items:
        delta[b.first] += b.size
        delta[b.last + 1] -= b.size
    total, result = 0, []
    for step in delta[:-1]:
        total += step
        result.append(total)
    return result


def lower_bound(buffers: Iterable[Buffer]) -> int:
    """The most bytes live at any one launch: no plan's arena can be smaller."""
    return max(live_bytes(buffers), default=0)


def naive_bytes(buffers: Iterable[Buffer]) -> int:
    """The sum of every buffer's size: the arena without any reuse."""
    return sum(b.size for b in buffers)
