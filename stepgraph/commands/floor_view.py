"""``stepgraph inspect ARTIFACT --floor``: the roofline floor of every bin, before any GPU.

Per bin: the bytes one step must move through HBM (:mod:`stepgraph.bench.floor`'s
accounting, with the routed experts that uniform routing is expected to touch) and the time
that takes at a bandwidth: the target table's ``hbm_bytes_per_s`` unless ``--bandwidth``
names one (``stepgraph bench`` divides by the copy bandwidth it measures on the card, which
is below the datasheet peak the tables hold). For one bin, the bytes by op, drawn as bars:
where a step's time must go. No torch here."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from stepgraph.bench.floor import (
    CATEGORIES,
    StepBytes,
    expert_nodes,
    format_bytes,
    step_bytes,
    uniform_touched,
)
from stepgraph.bench.table import floor_bar
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.memory.arena import bin_rows
from stepgraph.passes.bin import tables_for

BAR_WIDTH = 40


@dataclass(frozen=True)
class BinFloor:
    """One bin's bytes and floor."""

    rows: int
    touched: float  # routed experts a routed-experts launch is expected to touch
    local_experts: int
    moved: StepBytes
    floor_us: float


def bandwidth_of(graph: Graph, tbps: float | None) -> tuple[float, str]:
    """Bytes per second and where the figure came from: ``tbps`` (TB/s) when given, else
    the target table's ``hbm_bytes_per_s``."""
    if tbps is not None:
        if not tbps > 0:
            raise UserError(f"--bandwidth {tbps:g}: give the bandwidth in TB/s, above 0")
        return tbps * 1e12, "--bandwidth"
    tables = tables_for(graph, None)
    return tables.hardware.hbm_bytes_per_s, f"{tables.label} hardware.hbm_bytes_per_s"


def bin_floors(graph: Graph, context: int, bandwidth: float,
               bins: list[int] | None = None) -> list[BinFloor]:
    """The floor of each of ``bins`` (default: every compiled bin) at ``context`` cached
    tokens a request."""
    if context < 1:
        raise UserError(f"--context {context}: give the cached tokens a request, at least 1")
    experts = expert_nodes(graph)
    first = experts[0] if experts else None
    floors = []
    for rows in bins if bins is not None else bin_rows(graph):
        touched = uniform_touched(graph, rows)
        moved = step_bytes(graph, rows, context, touched=touched)
        floors.append(BinFloor(
            rows=rows,
            touched=touched[first.name] if first else 0.0,
            local_experts=int(first.attrs["local_experts"]) if first else 0,
            moved=moved,
            floor_us=moved.floor_us(bandwidth),
        ))
    return floors


def summary_floor(graph: Graph, context: int = 4096) -> dict[str, Any]:
    """The summary's floor: the smallest and the largest bin at the target table's bandwidth
    (``inspect --format json``'s ``floor`` key; ``--floor`` shows every bin)."""
    bandwidth, source = bandwidth_of(graph, None)
    bins = bin_rows(graph)
    floors = bin_floors(graph, context, bandwidth, sorted({bins[0], bins[-1]}))
    return {"bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source, "context": context,
            "bins": [{"rows": f.rows, "bytes": f.moved.total, "floor_us": round(f.floor_us, 2)}
                     for f in floors]}


def summary_floor_line(floor: dict[str, Any]) -> str:
    """``floor      rows 1: 27.08 GB a step, 5642.5 us at 4.8 TB/s; rows 64: ...``."""
    tbps = floor["bandwidth_bytes_per_s"] / 1e12
    parts = [f"rows {b['rows']}: {format_bytes(b['bytes'])} a step, {b['floor_us']:.1f} us"
             for b in floor["bins"]]
    return (f"floor      {'; '.join(parts)} at {tbps:.3g} TB/s ({floor['bandwidth_source']}; "
            f"MLA context {floor['context']}; `--floor`: every bin, by op)")


def bytes_by_op(moved: StepBytes) -> list[tuple[str, int, int]]:
    """(op, launches, bytes) of one bin, most bytes first."""
    totals: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for launch in moved.launches:
        totals[launch.op] += launch.total
        counts[launch.op] += 1
    return sorted(((op, counts[op], total) for op, total in totals.items() if total),
                  key=lambda item: (-item[2], item[0]))


def floor_data(graph: Graph, context: int, tbps: float | None, rows: int) -> dict[str, Any]:
    """The view as plain data (``--format json``): every bin, and bin ``rows`` by op."""
    bandwidth, source = bandwidth_of(graph, tbps)
    floors = bin_floors(graph, context, bandwidth)
    chosen = next(f for f in floors if f.rows == rows)
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": source,
        "context": context,
        "bins": [{"rows": f.rows, "experts_touched": round(f.touched, 2),
                  "local_experts": f.local_experts, **f.moved.by_category(),
                  "total": f.moved.total, "floor_us": round(f.floor_us, 2)}
                 for f in floors],
        "by_op": {"rows": rows, "ops": [{"op": op, "launches": n, "bytes": nbytes}
                                        for op, n, nbytes in bytes_by_op(chosen.moved)]},
    }


def step_title(graph: Graph) -> str:
    """``kimi_k3 tp=8 dcp=1 dep=1, one rank's step``: what the floor is of."""
    d = graph.meta.get("deployment", {})
    ranks = int(graph.meta.get("world", 1))
    scope = "one rank's step" if ranks > 1 else "the step"
    return (f"{graph.name} tp={d.get('tp', 1)} dcp={d.get('dcp', 1)} dep={d.get('dep', 1)}, "
            f"{scope}")


def format_floor(data: dict[str, Any], title: str) -> str:
    """The text view of :func:`floor_data`."""
    tbps = data["bandwidth_bytes_per_s"] / 1e12
    lines = [
        f"floor of {title}: the bytes a step moves through HBM / {tbps:.3g} TB/s "
        f"({data['bandwidth_source']}); MLA context {data['context']} tokens a request; "
        "routed experts: those uniform routing is expected to touch",
        "",
        f"{'rows':>5}  {'experts':>14}  " + "  ".join(f"{c:>11}" for c in CATEGORIES)
        + f"  {'total':>10}  {'floor us':>9}  {'us a row':>8}",
    ]
    for b in data["bins"]:
        touched = (f"{b['experts_touched']:.0f} of {b['local_experts']}"
                   if b["local_experts"] else "-")
        lines.append(f"{b['rows']:>5}  {touched:>14}  "
                     + "  ".join(f"{format_bytes(b[c]):>11}" for c in CATEGORIES)
                     + f"  {format_bytes(b['total']):>10}  {b['floor_us']:>9.1f}  "
                       f"{b['floor_us'] / b['rows']:>8.1f}")
    ops = data["by_op"]["ops"]
    total = sum(op["bytes"] for op in ops) or 1
    rows = data["by_op"]["rows"]
    lines += ["", f"bin {rows}: where the floor goes (bytes by op; --bin picks the bin)"]
    width = max(len(op["op"]) for op in ops) if ops else 0
    for op in ops:
        share = op["bytes"] / total
        bar = floor_bar(share, BAR_WIDTH).rstrip()
        lines.append(f"  {op['op']:<{width}}  {op['launches']:>5} x  "
                     f"{format_bytes(op['bytes']):>10}  {share:>6.1%}  {bar}")
    lines.append("Measured floors and step times: `stepgraph bench ARTIFACT --weights random` "
                 "on the GPU (it divides by the copy bandwidth it measures there).")
    return "\n".join(lines)
