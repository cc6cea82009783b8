"""``stepgraph inspect FILE``: a summary of a compiled step, then its graph; or one view of it
(``--explain NODE``, ``--memory``, ``--trace FILE``, ``--floor``)."""

from __future__ import annotations

import argparse
import json

from stepgraph.atomic_file import writable_path, write_atomically
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("inspect", help="summarize and print a compiled artifact")
    parser.add_argument("artifact", help="artifact file written by `stepgraph compile`")
    parser.add_argument("--format", choices=("text", "json", "dot", "mermaid"), default="text",
                        help="text (summary + graph), json (machine-readable), dot, mermaid")
    parser.add_argument("--layer", type=int, action="append",
                        help="only this layer's nodes (repeatable)")
    parser.add_argument("--bin", type=int, dest="bin_rows",
                        help="the bin (rows) to show decisions, memory and trace for")
    parser.add_argument("--summary", action="store_true", help="the summary only")
    parser.add_argument("--explain", metavar="NODE", help="why NODE got its provider/tactic")
    parser.add_argument("--memory", nargs="?", const="-", metavar="PICTURE",
                        help="the arena over the schedule: PNG/SVG to PICTURE (matplotlib), "
                             "or an ASCII map when PICTURE is omitted")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome/Perfetto trace JSON of one bin's launches")
    parser.add_argument("--floor", action="store_true",
                        help="the roofline floor of every bin (bytes a step moves / HBM "
                             "bandwidth) and one bin's bytes by op")
    parser.add_argument("--context", type=int, default=4096,
                        help="with --floor: cached tokens a request (default 4096)")
    parser.add_argument("--bandwidth", type=float, metavar="TBPS",
                        help="with --floor: HBM bandwidth in TB/s (default: the target "
                             "table's hbm_bytes_per_s, a datasheet peak)")
    return parser


def _bin(graph, requested: int | None) -> int:
    from stepgraph.memory.arena import bin_rows

    bins = bin_rows(graph)
    if requested is None:
        return bins[0]
    if requested not in bins:
        raise UserError(f"--bin {requested}: the artifact's bins are {', '.join(map(str, bins))}")
    return requested


def run(args: argparse.Namespace) -> int:
    """Print what was asked; every flag is checked before anything is printed or written."""
    from stepgraph.artifact import load_artifact
    from stepgraph.commands.views import (
        check_layers,
        decision_note,
        render_graph,
        summary_data,
        summary_text,
    )

    artifact = load_artifact(args.artifact)
    graph = artifact.graph
    rows = _bin(graph, args.bin_rows)
    check_layers(graph, args.layer)
    if args.floor:
        if args.format not in ("text", "json"):
            raise UserError(f"--floor --format {args.format}: the floor prints as text or json")
        from stepgraph.commands.floor_view import floor_data, format_floor, step_title

        floor = floor_data(graph, args.context, args.bandwidth, rows)
        print(json.dumps(floor, indent=1, sort_keys=True) if args.format == "json"
              else format_floor(floor, step_title(graph)))
        return 0
    if args.explain:
        from stepgraph.passes.bin import explain

        print(explain(graph, args.explain))
        return 0
    if args.memory is not None:
        from stepgraph.memory.picture import render_memory

        print(render_memory(graph, rows, None if args.memory == "-" else args.memory))
        return 0
    if args.trace:
        from stepgraph.trace import chrome_trace

        path = writable_path(args.trace, "--trace")
        trace = chrome_trace(graph, rows)
        write_atomically(path, json.dumps(trace).encode("utf-8"))
        print(f"wrote {args.trace}: {len(trace['traceEvents'])} events "
              f"(open in https://ui.perfetto.dev or chrome://tracing)")
        return 0
    data = summary_data(graph, artifact.document)
    if args.format == "json":
        if args.summary:
            print(json.dumps(data, indent=1, sort_keys=True))
            return 0
        from stepgraph.ir.serialize import graph_to_json

        data["graph"] = graph_to_json(graph)
        print(json.dumps(data, sort_keys=True))
        return 0
    if args.format != "text":
        print(render_graph(graph, args.format, args.layer))
        return 0
    print(summary_text(data, args.artifact))
    if not args.summary:
        note = decision_note(graph, rows) if args.bin_rows is not None else None
        print()
        print(render_graph(graph, "text", args.layer, annotate=note))
    return 0
