"""Memory planning of the step's temps: liveness over the launch order, a greedy best-fit
planner over abstract buffers, an independent overlap checker, whole-graph plans for all
bins in one shared arena, and pictures of a plan."""

from stepgraph.memory.arena import bin_rows, plan_memory
from stepgraph.memory.buffer import Buffer
from stepgraph.memory.checker import Conflict, PlanCheckError, check_plan, find_conflict
from stepgraph.memory.liveness import (
    LivenessError,
    buffers_at,
    buffers_for,
    live_bytes,
    live_ranges,
    lower_bound,
    naive_bytes,
)
from stepgraph.memory.planner import DEFAULT_ALIGNMENT, Plan, plan_many, plan_offsets

__all__ = [
    "DEFAULT_ALIGNMENT",
    "Buffer",
    "Conflict",
    "LivenessError",
    "Plan",
    "PlanCheckError",
    "bin_rows",
    "buffers_at",
    "buffers_for",
    "check_plan",
    "find_conflict",
    "live_bytes",
    "live_ranges",
    "lower_bound",
    "naive_bytes",
    "plan_many",
    "plan_memory",
    "plan_offsets",
]
