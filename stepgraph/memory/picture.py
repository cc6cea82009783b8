"""Pictures of a memory plan: the arena over the schedule, as an image or an ASCII map.

:func:`render_memory` draws one bin's plan with matplotlib (x: launch index, y: byte
offset, a rectangle per temp colored by layer, the live-bytes curve and the lower bound),
or prints a map in the manner of TFLite Micro's ``PrintMemoryPlan``: a line per launch, a
column per slice of the arena, a symbol per temp. :func:`memory_summary` gives the numbers
of every bin for ``inspect``. Both read ``graph.meta["memory"]`` when the alias pass ran
and plan the graph themselves otherwise. matplotlib is optional and imported lazily.
"""

from __future__ import annotations

import importlib.util
import io
import string
from pathlib import Path
from typing import Any

from stepgraph.atomic_file import writable_path, write_atomically
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.memory.arena import bin_rows, plan_memory
from stepgraph.memory.buffer import Buffer
from stepgraph.memory.liveness import live_bytes
from stepgraph.units import human_bytes

SYMBOLS = string.digits + string.ascii_letters
IMAGE_SUFFIXES = (".png", ".svg")


def _memory(graph: Graph) -> dict[str, Any]:
    memory = graph.meta.get("memory")
    if memory is not None:
        return memory
    return plan_memory(graph, bin_rows(graph))


def _bin(graph: Graph, rows: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the memory record, the record of bin ``rows``)."""
    memory = graph.meta.get("memory")
    if memory is None:
        memory = plan_memory(graph, [rows])
    record = memory["bins"].get(str(rows))
    if record is None:
        known = ", ".join(sorted(memory["bins"], key=int))
        raise UserError(f"no bin of {rows} rows; the plan has bins of {known} rows")
    return memory, record


def _buffers(memory: dict[str, Any], record: dict[str, Any]) -> list[Buffer]:
    """The bin's buffers in order of production (a stored record may have sorted keys)."""
    buffers = [Buffer(name, record["sizes"][name], span[0], span[1])
               for name, span in memory["live"].items()]
    return sorted(buffers, key=lambda b: (b.first, b.name))


def memory_summary(graph: Graph) -> list[dict[str, Any]]:
    """Per bin, ascending rows: ``rows``, ``arena_bytes``, ``lower_bound_bytes``,
    ``naive_bytes``, ``arena_over_lower_bound`` and ``naive_over_arena`` (ratios rounded
    to 4 places; 1.0 where the denominator is 0)."""
    memory = _memory(graph)
    result = []
    for key in sorted(memory["bins"], key=int):
        record = memory["bins"][key]
        arena, bound, naive = (record["arena_bytes"], record["lower_bound_bytes"],
                               record["naive_bytes"])
        result.append({
            "rows": int(key),
            "arena_bytes": arena,
            "lower_bound_bytes": bound,
            "naive_bytes": naive,
            "arena_over_lower_bound": round(arena / bound, 4) if bound else 1.0,
            "naive_over_arena": round(naive / arena, 4) if arena else 1.0,
        })
    return result


def render_memory(graph: Graph, rows: int, path: str | None = None, width: int = 64) -> str:
    """Picture bin ``rows``'s plan. With ``path`` (a .png or .svg in an existing folder, else
    a one-line error) and matplotlib installed: draw it there and return a one-line
    description. Otherwise: return an ASCII map (``width`` columns for the arena), prefixed
    by a note when an image was asked for but matplotlib is missing."""
    if path is not None:
        if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
            raise UserError(f"--memory {path}: the picture is drawn as "
                            f"{' or '.join(IMAGE_SUFFIXES)}; leave PICTURE out for an ASCII "
                            "map on stdout")
        writable_path(path, "--memory")
    memory, record = _bin(graph, rows)
    if path is not None:
        if importlib.util.find_spec("matplotlib") is not None:
            return _draw(graph, rows, memory, record, path)
        note = f"matplotlib is not installed, so {path} was not drawn; an ASCII map instead"
        return note + "\n" + _ascii(graph, rows, memory, record, width)
    return _ascii(graph, rows, memory, record, width)


def _headline(rows: int, record: dict[str, Any], count: int) -> str:
    arena, bound, naive = (record["arena_bytes"], record["lower_bound_bytes"],
                           record["naive_bytes"])
    ratio = arena / bound if bound else 1.0
    reuse = naive / arena if arena else 1.0
    return (f"bin {rows} rows: {count} temps, arena {arena} B ({human_bytes(arena)}), lower bound "
            f"{bound} B (arena x{ratio:.3f}), naive {naive} B (x{reuse:.1f} the arena)")


def _ascii(graph: Graph, rows: int, memory: dict[str, Any], record: dict[str, Any],
           width: int) -> str:
    buffers = _buffers(memory, record)
    offsets = record["offsets"]
    arena = max(record["arena_bytes"], 1)
    step = -(-arena // width)
    nodes = graph.nodes
    horizon = max(len(nodes), max((b.last + 1 for b in buffers), default=0))
    live = live_bytes(buffers) + [0] * horizon
    starting: list[list[int]] = [[] for _ in range(horizon)]
    for index, buffer in enumerate(buffers):
        starting[buffer.first].append(index)
    bound_column = min(width - 1, record["lower_bound_bytes"] // step)
    lines = [
        _headline(rows, record, len(buffers)),
        f"one column = {step} B; symbols name temps in order of production (legend: "
        f"the temps each launch writes); shared arena of all bins: {memory['arena_bytes']} B",
        f"{'launch':>6} |{' ' * bound_column}v{' ' * (width - bound_column - 1)}| live B   "
        f"node: writes",
    ]
    active: list[int] = []
    for t in range(horizon):
        active = [i for i in active if buffers[i].last >= t] + starting[t]
        row = ["."] * width
        for i in active:
            buffer = buffers[i]
            if buffer.size == 0:
                continue
            lo = offsets[buffer.name] // step
            hi = min(width, -(-(offsets[buffer.name] + buffer.size) // step))
            for column in range(lo, hi):
                row[column] = SYMBOLS[i % len(SYMBOLS)]
        name = nodes[t].name if t < len(nodes) else "?"
        writes = ", ".join(f"{SYMBOLS[i % len(SYMBOLS)]}={buffers[i].name}"
                           for i in starting[t])
        lines.append(f"{t:>6} |{''.join(row)}| {live[t]:<8} {name}" +
                     (f": {writes}" if writes else ""))
    return "\n".join(lines) + "\n"


def _draw(graph: Graph, rows: int, memory: dict[str, Any], record: dict[str, Any],
          path: str) -> str:
    import matplotlib
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    buffers = _buffers(memory, record)
    offsets = record["offsets"]
    nodes = graph.nodes
    scale = 2**20
    cmap = matplotlib.colormaps["tab20"]
    shapes, colors = [], []
    for buffer in buffers:
        x0, x1 = buffer.first, buffer.last + 1
        y0 = offsets[buffer.name] / scale
        y1 = (offsets[buffer.name] + buffer.size) / scale
        shapes.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        layer = nodes[buffer.first].layer if buffer.first < len(nodes) else None
        colors.append("0.6" if layer is None else cmap(layer % 20))
    figure = Figure(figsize=(14, 6), dpi=120)
    axes = figure.add_subplot()
    axes.add_collection(PolyCollection(shapes, facecolors=colors, edgecolors="0.2",
                                       linewidths=0.2))
    live = live_bytes(buffers)
    axes.step(range(len(live)), [v / scale for v in live], where="post", color="black",
              linewidth=0.6, label="bytes live")
    bound = record["lower_bound_bytes"] / scale
    arena = record["arena_bytes"] / scale
    axes.axhline(bound, color="red", linestyle="--", linewidth=0.8, label="lower bound")
    axes.axhline(arena, color="blue", linestyle=":", linewidth=0.8, label="arena")
    axes.set_xlim(0, max(len(nodes), 1))
    axes.set_ylim(0, max(arena, bound, 1e-6) * 1.05)
    axes.set_xlabel("launch index")
    axes.set_ylabel("arena offset (MiB)")
    axes.set_title(f"{graph.name}: arena plan, bin {rows} rows (temps colored by layer)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
    figure.subplots_adjust(left=0.06, right=0.88)
    image = io.BytesIO()
    figure.savefig(image, format=Path(path).suffix.lower().lstrip("."))
    write_atomically(path, image.getvalue())
    return f"wrote {path}: " + _headline(rows, record, len(buffers))
