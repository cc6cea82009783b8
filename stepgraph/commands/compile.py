"""``stepgraph compile SPEC -o FILE``: compile a spec for a deployment into an artifact."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from stepgraph.commands.common import (
    add_deployment_flags,
    add_option_flags,
    options_from,
    spec_and_deployment,
)
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("compile", help="compile a model spec into a step artifact")
    parser.add_argument("spec", help="model spec (YAML), e.g. models/kimi_k3.yaml")
    parser.add_argument("-o", "--output", required=True, help="artifact file to write")
    add_deployment_flags(parser)
    add_option_flags(parser)
    parser.add_argument("--dump-after", nargs=2, metavar=("PASS", "DIR"),
                        help="write the IR text after PASS (or `all`) into DIR")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print each pass's time and what it changed")
    return parser


def dump_hook(which: str, folder: Path, known: tuple[str, ...]):
    """A pipeline hook writing ``NN-pass.mlir``-like text files after the chosen pass(es)."""
    from stepgraph.ir.printer import format_graph

    if which != "all" and which not in known:
        raise UserError(f"--dump-after {which}: no such pass; choose one of "
                        f"{', '.join(known)} or all")
    folder.mkdir(parents=True, exist_ok=True)
    order = {name: index for index, name in enumerate(known)}

    def hook(name: str, graph: Graph) -> None:
        if which in ("all", name):
            path = folder / f"{order[name]:02d}-{name}.txt"
            path.write_text(format_graph(graph) + "\n", encoding="utf-8")

    return hook


def run(args: argparse.Namespace) -> int:
    """Compile and write the artifact atomically."""
    from stepgraph.artifact import write_artifact
    from stepgraph.commands.views import tables_note
    from stepgraph.compiler import compile_document
    from stepgraph.passes.pipeline import PASS_ORDER

    start = time.perf_counter()
    spec, deployment = spec_and_deployment(args)
    hook = None
    if args.dump_after:
        which, folder = args.dump_after
        hook = dump_hook(which, Path(folder), ("frontend", *PASS_ORDER))
    document, reports = compile_document(spec, deployment, options_from(args), hook,
                                         tables_path=args.tactics)
    size = write_artifact(document, args.output)
    seconds = time.perf_counter() - start
    if args.verbose:
        for report in reports:
            mark = "changed" if report.changed else "unchanged"
            print(f"  {report.name:<9} {report.seconds * 1000:7.1f} ms  {mark:<9} "
                  f"{report.summary}", file=sys.stderr)
    nodes = len(document["graph"]["nodes"])
    tables = tables_note(deployment.target, document["graph"]["meta"].get("tactics", {}))
    print(f"wrote {args.output}: {spec.model.name} tp={deployment.tp} dcp={deployment.dcp} "
          f"dep={deployment.dep} q={deployment.q}, {tables}, "
          f"{nodes} nodes, {size / 1e3:.1f} kB, hash {document['hash'][:12]} "
          f"({seconds:.2f} s)")
    return 0
