"""Memory plans of a whole graph: every bin's temps placed in one shared arena, each plan
verified by the independent checker.

The result is the JSON-able ``graph.meta["memory"]`` record::

    {"arena_bytes": int, "alignment": int, "live": {temp: [first, last]},
     "bins": {str(rows): {"arena_bytes", "lower_bound_bytes", "naive_bytes",
                          "offsets": {temp: int}, "sizes": {temp: int}}}}

``live`` (launch indices, the same for every bin) is stored once.

``arena_bytes`` at the top is the max over bins: one allocation serves every bin's
captured graph. A bin's ``lower_bound_bytes`` (the most bytes live at one launch) and
``naive_bytes`` (the sum of its temps) use the temps' exact sizes; its ``arena_bytes``
includes the alignment of every offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepgraph.ir.graph import Graph
from stepgraph.memory.checker import check_plan
from stepgraph.memory.liveness import buffers_for, live_ranges, lower_bound, naive_bytes
from stepgraph.memory.planner import DEFAULT_ALIGNMENT, plan_many


def bin_rows(graph: Graph, batches: Sequence[int] | None = None) -> list[int]:
    """The row counts of the graph's bins, ascending and unique: ``meta["bins"]`` when the
    bin pass ran, else ``batches`` (a pass gives the deployment's), else
    ``meta["deployment"]["batches"]``, else one bin of 1 row."""
    bins = graph.meta.get("bins")
    if bins:
        return sorted({int(b["rows"]) for b in bins})
    if batches:
        return sorted(set(batches))
    recorded = graph.meta.get("deployment", {}).get("batches")
    if recorded:
        return sorted({int(r) for r in recorded})
    return [1]


def plan_memory(graph: Graph, rows: Sequence[int],
                alignment: int = DEFAULT_ALIGNMENT) -> dict[str, Any]:
    """Plan the temps of ``graph`` for every row count in ``rows`` and check each plan.

    Raises :class:`~stepgraph.memory.liveness.LivenessError` for a temp the arena cannot
    hold and :class:`~stepgraph.memory.checker.PlanCheckError` for a wrong plan.
    """
    ranges = live_ranges(graph)
    live = {name: [first, last] for name, (first, last) in ranges.items()}
    buffer_sets = buffers_for(graph, rows, ranges)
    plans = plan_many(buffer_sets, alignment)
    bins: dict[str, Any] = {}
    for r, buffers, plan in zip(rows, buffer_sets, plans, strict=True):
        check_plan(buffers, plan.offsets, plan.arena_bytes, alignment)
        bins[str(r)] = {
            "arena_bytes": plan.arena_bytes,
            "lower_bound_bytes": lower_bound(buffers),
            "naive_bytes": naive_bytes(buffers),
            "offsets": plan.offsets,
            "sizes": {b.name: b.size for b in buffers},
        }
    arena = max((b["arena_bytes"] for b in bins.values()), default=0)
    return {"arena_bytes": arena, "alignment": alignment, "live": live, "bins": bins}
