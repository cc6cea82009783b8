"""``stepgraph dump SPEC --after PASS``: print the IR after one pass of the pipeline."""

from __future__ import annotations

import argparse

from stepgraph.commands.common import (
    add_deployment_flags,
    add_option_flags,
    options_from,
    spec_and_deployment,
)
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("dump", help="print the IR after a pass (or the frontend)")
    parser.add_argument("spec", help="model spec (YAML)")
    parser.add_argument("--after", default="frontend",
                        help="frontend, or a pass: shard, pack, fuse, bin, schedule, streams, pdl, "
                             "alias")
    parser.add_argument("--layer", type=int, action="append",
                        help="only this layer's nodes (repeatable)")
    parser.add_argument("--format", choices=("text", "json", "dot", "mermaid"), default="text")
    add_deployment_flags(parser)
    add_option_flags(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Compile up to ``--after`` and print the graph."""
    from stepgraph.commands.views import render_graph
    from stepgraph.compiler import compile_graph
    from stepgraph.frontend import build_step
    from stepgraph.passes.pipeline import PASS_ORDER

    spec, deployment = spec_and_deployment(args)
    if args.after == "frontend":
        graph = build_step(spec.model, deployment)
    elif args.after in PASS_ORDER:
        graph, _ = compile_graph(spec, deployment, options_from(args), stop_after=args.after,
                                 tables_path=args.tactics)
    else:
        raise UserError(f"--after {args.after}: no such pass; choose frontend or one of "
                        f"{', '.join(PASS_ORDER)}")
    print(render_graph(graph, args.format, args.layer))
    return 0
