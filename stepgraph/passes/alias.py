"""The ``alias`` pass: memory planning. Every temp of every bin gets an offset in one arena
shared by all bins (the runtime allocates it once and every bin's captured graph uses it).

Liveness comes from the launch order (run ``schedule`` first); each bin's temps are
placed by the greedy best-fit planner and every plan is verified by the independent
overlap checker, a failed check being a pass error. The result is ``meta["memory"]``
(see :mod:`stepgraph.memory.arena` for its layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.memory.arena import bin_rows, plan_memory
from stepgraph.memory.checker import PlanCheckError
from stepgraph.memory.liveness import LivenessError
from stepgraph.memory.planner import DEFAULT_ALIGNMENT
from stepgraph.passes.manager import CompileContext, PassError, PassResult


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Alias:
    """Plan the arena: an offset for every temp of every bin, each offset and reservation a
    multiple of ``alignment`` bytes; the bins are ``meta["bins"]`` (the bin pass) or else
    the deployment's batches."""

    name: ClassVar[str] = "alias"
    alignment: int = DEFAULT_ALIGNMENT

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return the graph with ``meta["memory"]`` set."""
        if self.alignment < 1:
            raise PassError(self.name, f"alignment must be at least 1 byte, not "
                                       f"{self.alignment}")
        g = graph.copy()
        rows = bin_rows(graph, ctx.deployment.batches)
        try:
            memory = plan_memory(graph, rows, self.alignment)
        except (LivenessError, PlanCheckError) as error:
            raise PassError(self.name, str(error)) from None
        g.meta["memory"] = memory
        largest = memory["bins"][str(rows[-1])]
        ratio = largest["arena_bytes"] / max(largest["lower_bound_bytes"], 1)
        summary = (f"{len(largest['offsets'])} temps x {len(rows)} bins in one arena of "
                   f"{_mib(memory['arena_bytes'])} (lower bound x{ratio:.3f} at {rows[-1]} "
                   f"rows)")
        return PassResult(g, True, summary)
