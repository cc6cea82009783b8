"""What ``inspect`` and ``dump`` print: the summary of a compiled step and the graph forms."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.ops import OPS
from stepgraph.ir.printer import format_graph, graph_to_dot, graph_to_mermaid
from stepgraph.ir.serialize import graph_to_json
from stepgraph.ir.types import Storage
from stepgraph.memory.liveness import side_branches
from stepgraph.passes.pdl import uses_pdl_at
from stepgraph.units import human_bytes


def check_layers(graph: Graph, layers: list[int] | None) -> None:
    """A one-line error when ``--layer`` names a layer the model does not have."""
    missing = sorted(set(layers or ()) - set(graph.layers()))
    if missing:
        from stepgraph.errors import UserError

        raise UserError(f"--layer {missing[0]}: the model has layers 0..{max(graph.layers())}")


def render_graph(graph: Graph, form: str, layers: list[int] | None,
                 annotate: Any = None) -> str:
    """The graph in ``form`` (text, json, dot, mermaid), optionally only some layers."""
    check_layers(graph, layers)
    chosen = set(layers) if layers else None
    if form == "text":
        return format_graph(graph, chosen, annotate=annotate)
    if form == "dot":
        return graph_to_dot(graph, chosen)
    if form == "mermaid":
        return graph_to_mermaid(graph, chosen)
    return json.dumps(graph_to_json(graph), indent=1, sort_keys=True)


def weight_rows(graph: Graph) -> list[dict[str, Any]]:
    """Every weight with its per-rank shape, dtype and bytes."""
    rows = []
    for value in graph.values_of(Storage.WEIGHT):
        item: dict[str, Any] = {
            "name": value.name,
            "shape": list(value.type.shape),
            "dtype": value.type.dtype,
            "bytes": value.type.nbytes(1),
            "layout": value.layout,
        }
        if value.split is not None:
            item["split"] = {"group": value.split.group, "dim": value.split.dim,
                             "ways": value.split.ways}
        if len(value.segments) > 1:
            item["segments"] = [{"name": s.name, "rows": s.rows, "offset": s.offset,
                                 "source": s.source} for s in value.segments]
        rows.append(item)
    return rows


def bin_rows(graph: Graph) -> list[dict[str, Any]]:
    """Every bin with its rows, requests and memory plan figures."""
    memory = graph.meta.get("memory", {}).get("bins", {})
    bins = graph.meta.get("bins") or [{"rows": r} for r in graph.meta["deployment"]["batches"]]
    result = []
    for entry in bins:
        rows = entry["rows"]
        plan = memory.get(str(rows), {})
        item = {"rows": rows, "requests": entry.get("requests", rows)}
        if plan:
            item["memory"] = {
                "arena_bytes": plan["arena_bytes"],
                "lower_bound_bytes": plan["lower_bound_bytes"],
                "naive_bytes": plan["naive_bytes"],
            }
        for key in ("path", "reason"):
            if key in entry:
                item[key] = entry[key]
        result.append(item)
    return result


def pdl_chain(graph: Graph) -> dict[str, Any]:
    """Per bin, how many launches wait in the PDL chain and which stand outside it, name ->
    op (the first launch, collectives, providers that cannot wait such as cuBLAS, and the
    launch after each); from the pdl pass's marks. Empty where the pass did not run."""
    marks = graph.meta.get("pdl")
    if not marks:
        return {}
    launches = [node.name for node in graph if node.op != "prefetch"]
    if not graph.meta.get("pdl_config", {}).get("enabled", True):
        return {"enabled": False, "launches": len(launches)}
    bins = [str(e["rows"]) for e in graph.meta.get("bins", [])] or ["all"]
    result: dict[str, Any] = {"enabled": True, "launches": len(launches), "bins": {}}
    for rows in bins:
        off = {name: graph.node(name).op for name in launches
               if not uses_pdl_at(marks.get(name), rows)}
        result["bins"][rows] = {"in_chain": len(launches) - len(off), "off_chain": off}
    return result


def _summary_floor(graph: Graph) -> dict[str, Any]:
    """The summary's floor; the floor's modules load only when a summary is made (not when
    `stepgraph compile` builds its parser)."""
    from stepgraph.commands.floor_view import summary_floor

    return summary_floor(graph)


def summary_data(graph: Graph, document: dict[str, Any]) -> dict[str, Any]:
    """The machine-readable summary (``inspect --format json``)."""
    layers = graph.meta.get("layers", [])
    weights = weight_rows(graph)
    temps = graph.values_of(Storage.TEMP)
    side = side_branches(graph)
    streams = graph.meta.get("streams", {})
    ops = Counter(node.op for node in graph)
    collectives = {op: n for op, n in ops.items() if OPS[op].category == "collective"}
    deployment = document["deployment"]
    return {
        "format_version": document["format_version"],
        "compiler_version": document["compiler_version"],
        "hash": document["hash"],
        "input_hash": document["input_hash"],
        "model": {k: document["spec"][k] for k in ("name", "hidden_size", "vocab_size", "dtype")},
        "deployment": deployment,
        "world": graph.meta.get("world", 1),
        "layers": layers,
        "layer_counts": {
            "attention": dict(sorted(Counter(x["attention"] for x in layers).items())),
            "mlp": dict(sorted(Counter(x["mlp"] for x in layers).items())),
        },
        "launches": len(graph),
        "ops": dict(sorted(ops.items())),
        "collectives": dict(sorted(collectives.items())),
        "weights": weights,
        "weight_bytes_per_rank": sum(w["bytes"] for w in weights),
        "temps": {"count": len(temps), "views": sum(v.view is not None for v in temps)},
        "states": [{"name": v.name, "shape": list(v.type.shape), "dtype": v.type.dtype}
                   for v in graph.values_of(Storage.STATE)],
        "bins": bin_rows(graph),
        "caps": graph.meta.get("caps", {}),
        "streams": {"side": side, "side_ops": dict(sorted(Counter(
            graph.node(name).op for name in side).items())),
            **{key: bool(streams.get(key)) for key in ("root_fork", "signal")}},
        "pdl": pdl_chain(graph),
        "tables": {k: v for k, v in graph.meta.get("tactics", {}).items()
                   if k in ("target", "version", "digest", "file")},
        "floor": _summary_floor(graph),
    }


def representative_weights(data: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The weights of the first layer of each attention kind and each MLP kind (2-D and
    larger only), then the step's own (embedding, lm_head): what one reads to check shapes."""
    firsts: dict[str, int] = {}
    for layer in data["layers"]:
        firsts.setdefault(f"{layer['attention']} attention", layer["index"])
        firsts.setdefault(f"{layer['mlp']} mlp", layer["index"])
    groups = []
    for label, index in sorted(firsts.items(), key=lambda item: (item[1], item[0])):
        unit = ".self_attn." if label.endswith("attention") else ".mlp."
        prefix = f"layers.{index}{unit}"
        chosen = [w for w in data["weights"]
                  if w["name"].startswith(prefix) and len(w["shape"]) >= 2]
        groups.append((f"{label} (layer {index})", chosen))
    step = [w for w in data["weights"] if not w["name"].startswith("layers.")
            and len(w["shape"]) >= 2]
    groups.append(("step", step))
    return groups


def tables_note(target: str, tables: dict[str, str]) -> str:
    """The target and the tactic tables it compiled with (their own target and version, as
    the bin pass recorded them), saying so where the target has no table of its own and got
    the portable default (torch providers, no PDL)."""
    own, version = tables.get("target", "?"), tables.get("version", "?")
    if own == "default":
        return (f"target {target} (no tactic table of its own: the portable {version} "
                f"tables, torch providers, no PDL)")
    return f"target {target} (tables {version}" + (f" of {own}" if own != target else "") + ")"


def summary_text(data: dict[str, Any], path: str) -> str:
    """The human summary printed before the graph."""
    d = data["deployment"]
    counts = data["layer_counts"]
    attention = " + ".join(f"{n} {k}" for k, n in counts["attention"].items())
    mlp = " + ".join(f"{n} {k}" for k, n in counts["mlp"].items())
    model = data["model"]
    lines = [
        f"artifact   {path}  hash {data['hash'][:16]}  stepgraph {data['compiler_version']}",
        f"model      {model['name']}: {len(data['layers'])} layers, hidden {model['hidden_size']},"
        f" vocab {model['vocab_size']}, {model['dtype']}",
        f"layers     attention {attention}; mlp {mlp}",
        f"deployment tp={d['tp']} dcp={d['dcp']} dep={d['dep']} (world {data['world']}), "
        f"q={d['q']}, bins {','.join(map(str, d['batches']))}, "
        f"{tables_note(d['target'], data.get('tables', {}))}",
        f"launches   {data['launches']}: "
        + ", ".join(f"{n} {op}" for op, n in sorted(data["ops"].items(), key=lambda x: -x[1])),
        f"weights    {human_bytes(data['weight_bytes_per_rank'])} per rank in "
        f"{len(data['weights'])} tensors",
    ]
    for label, weights in representative_weights(data):
        lines.append(f"  {label}:")
        for weight in weights:
            shape = " x ".join(map(str, weight["shape"]))
            lines.append(f"    {weight['name']:<52} {shape:<20} {weight['dtype']:<9} "
                         f"{human_bytes(weight['bytes'])}")
    lines.append(f"temps      {data['temps']['count']} ({data['temps']['views']} views); "
                 f"states {len(data['states'])}")
    if data["caps"]:
        lines.append("caps       " + ", ".join(f"{k} {v}" for k, v in data["caps"].items()))
    streams = data.get("streams", {})
    if streams.get("side"):
        lines.append(f"streams    {len(streams['side'])} launches on a side stream ("
                     + ", ".join(f"{n} {op}" for op, n in streams["side_ops"].items())
                     + "), each joined at or before its first reader"
                     + (" (a flag the reader waits on, where it can)" if streams.get("signal")
                        else "")
                     + ("; an empty launch forked there at the root" if streams.get("root_fork")
                        else ""))
    lines.extend(pdl_lines(data.get("pdl", {})))
    if data.get("floor", {}).get("bins"):
        from stepgraph.commands.floor_view import summary_floor_line

        lines.append(summary_floor_line(data["floor"]))
    planned = [b for b in data["bins"] if "memory" in b]
    if planned:
        lines.append("memory     rows    arena      lower bound  naive      arena/lb")
        for entry in planned:
            m = entry["memory"]
            ratio = m["arena_bytes"] / m["lower_bound_bytes"] if m["lower_bound_bytes"] else 1.0
            lines.append(f"           {entry['rows']:<6}  {human_bytes(m['arena_bytes']):<10} "
                         f"{human_bytes(m['lower_bound_bytes']):<12} "
                         f"{human_bytes(m['naive_bytes']):<10} {ratio:.3f}")
    return "\n".join(lines)


PDL_OPS_SHOWN = 5


def pdl_lines(chain: dict[str, Any]) -> list[str]:
    """The summary's PDL lines: per bin, the launches in the chain and those outside it by
    op (``inspect --explain NODE`` says why each is)."""
    if not chain:
        return []
    if not chain["enabled"]:
        return ["pdl        off (compiled with --no-pdl): no launch waits on its predecessor "
                "early"]
    lines = []
    for index, (rows, entry) in enumerate(chain["bins"].items()):
        off = Counter(entry["off_chain"].values()).most_common()
        shown = ", ".join(f"{n} {op}" for op, n in off[:PDL_OPS_SHOWN])
        if len(off) > PDL_OPS_SHOWN:
            shown += f", {sum(n for _, n in off[PDL_OPS_SHOWN:])} more"
        label = "pdl        " if index == 0 else " " * 11
        lines.append(f"{label}rows {rows}: {entry['in_chain']} of {chain['launches']} launches "
                     f"in the PDL chain" + (f"; outside it: {shown}" if off else ""))
    return lines


def decision_note(graph: Graph, rows: int):
    """An annotate callback: each node's provider/tactic at ``rows`` rows, and the side
    stream for the streams pass's branches."""
    decisions = graph.meta.get("decisions", {})
    side = side_branches(graph)

    def note(node: Node) -> str:
        entry = decisions.get(node.name, {}).get(str(rows))
        if not entry:
            return ""
        tactic = entry.get("tactic")
        text = f"{entry['provider']}" + (f" {tactic}" if tactic not in (None, "") else "")
        if node.name in side:
            text += f" [side stream, joins before {side[node.name] or 'the step end'}]"
        return text

    return note
