"""A Chrome / Perfetto trace (``traceEvents`` JSON) of one bin's launch schedule.

Track 1 holds one slice per launch in program order; track 2 the side stream: the streams
pass's branches (joined at or before their first reader: the launch carrying the join starts
no earlier than their end)
and the L2 prefetch forks. Durations are ESTIMATES, not measurements: the bytes a launch
moves divided by an assumed bandwidth from the tactic tables (HBM for compute and
prefetches, the link for collectives), at least the tables' kernel (or collective) floor. A
launch without PDL starts the tables' ``launch_gap_us`` after its predecessor ends; a PDL
launch starts as it ends (the gap hidden). PDL edges are flow events (``cat`` ``pdl``);
forks are flow events (``cat`` ``fork``) from the launch they follow to their side slice.

Bytes a launch moves: the floor's accounting (:mod:`stepgraph.bench.floor`: weights as each
launch reads them, the routed experts that uniform routing is expected to touch, states and
paged caches over ``context`` assumed tokens a request, activations at ``rows`` rows), plus an
L2 prefetch fork's own bytes on its slice.
"""

from __future__ import annotations

import json
from typing import Any

from stepgraph.bench.floor import step_bytes, uniform_touched
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.memory.liveness import side_branches
from stepgraph.passes.bin import tables_for
from stepgraph.passes.pdl import is_collective, uses_pdl_at
from stepgraph.tactics import TacticTables

MAIN_TID, PREFETCH_TID, PID = 1, 2, 1


def launch_bytes(graph: Graph, rows: int, context: int) -> dict[str, int]:
    """The estimated bytes each launch of bin ``rows`` moves, by node name: the floor's
    accounting (:func:`stepgraph.bench.floor.step_bytes`) with the routed experts that uniform
    routing is expected to touch, plus each L2 prefetch fork's own bytes (the floor counts
    those at the launch they warm; here the fork's slice takes the time to stream them)."""
    moved = step_bytes(graph, rows, context, touched=uniform_touched(graph, rows))
    out = {launch.node: launch.total for launch in moved.launches}
    for node in graph:
        if node.op == "prefetch":
            out[node.name] += int(node.attrs.get("bytes", 0))
    return out


def _duration_us(node: Node, moved: int, tables: TacticTables) -> tuple[float, str]:
    hw = tables.hardware
    if is_collective(node):
        bandwidth, floor, what = hw.link_bytes_per_s, hw.collective_floor_us, "link"
    else:
        bandwidth, floor, what = hw.hbm_bytes_per_s, hw.kernel_floor_us, "HBM"
    estimate = moved / bandwidth * 1e6
    note = (f"ESTIMATE, not measured: max({moved} B / {bandwidth:.3g} B/s assumed {what} "
            f"bandwidth, {floor} us floor) from {tables.label}")
    return max(estimate, floor), note


def chrome_trace(graph: Graph, rows: int, tables: TacticTables | None = None,
                 context: int = 4096) -> dict[str, Any]:
    """The trace of bin ``rows``: one slice per launch (main stream on track 1, side-stream
    branches and prefetch forks on track 2), PDL edges and forks as flow events.
    ``context``: assumed cached tokens a request (paged-cache reads). A rows count that is
    not a compiled bin is a UserError."""
    bins = graph.meta.get("bins")
    q = int(graph.meta.get("deployment", {}).get("q", 1))
    if bins:
        known = [int(b["rows"]) for b in bins]
        if rows not in known:
            raise UserError(f"bin {rows} is not compiled; the bins are "
                            f"{', '.join(map(str, known))}")
    tables = tables if tables is not None else tables_for(graph, None)
    hw = tables.hardware
    requests = max(rows // q, 1)
    decisions = graph.meta.get("decisions", {})
    marks = graph.meta.get("pdl", {})
    key = str(rows)

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0,
         "args": {"name": f"stepgraph {graph.name}: bin {rows} rows ({requests} requests)"}},
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": MAIN_TID,
         "args": {"name": "launches (main stream)"}},
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": PREFETCH_TID,
         "args": {"name": "side stream (branches, L2 prefetch forks)"}},
    ]
    side = side_branches(graph)
    joins = {join for join in side.values() if join is not None}
    clock = 0.0  # end of the last main-stream launch, us
    side_clock = 0.0  # end of the last side-stream launch
    previous: dict[str, Any] | None = None
    flow = 0
    moved_by_node = launch_bytes(graph, rows, context)
    for node in graph:
        moved = moved_by_node[node.name]
        duration, note = _duration_us(node, moved, tables)
        choice = decisions.get(node.name, {}).get(key, {})
        mark = marks.get(node.name, {})
        uses_pdl = uses_pdl_at(mark, key)
        args: dict[str, Any] = {
            "op": node.op, "layer": node.layer, "unit": node.unit,
            "provider": choice.get("provider"), "tactic": choice.get("tactic"),
            "decision": choice.get("reason"), "bytes": moved, "duration": note,
            "pdl": uses_pdl,
            "pdl_reason": mark.get("off_bins", {}).get(key, mark.get("reason")),
            "pre_wait_bytes": mark.get("prefetch_bytes", 0) if uses_pdl else 0,
        }
        if node.op == "prefetch" or node.name in side:
            start = max(clock, side_clock)
            side_clock = start + duration
            if node.op == "prefetch":
                args.update(fork=node.attrs.get("fork"), target=node.attrs.get("target"))
            else:
                args.update(joins_before=side[node.name])
            events.append({"ph": "X", "name": node.name,
                           "cat": "prefetch" if node.op == "prefetch" else "side", "pid": PID,
                           "tid": PREFETCH_TID, "ts": round(start, 3),
                           "dur": round(duration, 3), "args": args})
            if previous is not None:
                flow += 1
                events.append({"ph": "s", "id": flow, "name": "fork", "cat": "fork",
                               "pid": PID, "tid": MAIN_TID,
                               "ts": round(previous["ts"] + previous["dur"] * 0.99, 3)})
                events.append({"ph": "f", "bp": "e", "id": flow, "name": "fork",
                               "cat": "fork", "pid": PID, "tid": PREFETCH_TID,
                               "ts": round(start, 3)})
            continue
        if node.name in joins:
            clock = max(clock, side_clock)
        start = clock if (uses_pdl or previous is None) else clock + hw.launch_gap_us
        slice_ = {"ph": "X", "name": node.name, "cat": "launch", "pid": PID, "tid": MAIN_TID,
                  "ts": round(start, 3), "dur": round(duration, 3), "args": args}
        events.append(slice_)
        if uses_pdl and previous is not None:
            flow += 1
            events.append({"ph": "s", "id": flow, "name": "pdl", "cat": "pdl", "pid": PID,
                           "tid": MAIN_TID,
                           "ts": round(previous["ts"] + previous["dur"] * 0.99, 3)})
            events.append({"ph": "f", "bp": "e", "id": flow, "name": "pdl", "cat": "pdl",
                           "pid": PID, "tid": MAIN_TID, "ts": round(start, 3)})
        clock = start + duration
        previous = slice_
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "graph": graph.name, "rows": rows, "requests": requests, "context": context,
            "tables": f"{tables.label} (sha256 {tables.digest[:12]})",
            "note": "durations are estimates from assumed bandwidths, not measurements",
            "estimated_step_us": round(max(clock, side_clock), 3),
        },
    }


def trace_json(graph: Graph, rows: int, tables: TacticTables | None = None,
               context: int = 4096) -> str:
    """:func:`chrome_trace` as deterministic JSON text (for ``inspect --trace FILE``)."""
    return json.dumps(chrome_trace(graph, rows, tables, context), indent=None,
                      separators=(",", ":"), sort_keys=True)
