"""``stepgraph tune ARTIFACT --out FILE [--bins 1,2,4] [--quick] [--splitk-only]``: measure
cuBLAS and split-K tactics for every projection shape (and gated MLP gate_up shape) and bin of
an artifact on this machine's GPU and write a tactic table file (the format of
``stepgraph/data/tactics/h200.yaml``). Needs CUDA; torch is imported only when the command
runs."""

from __future__ import annotations

import argparse

from stepgraph.commands.common import parse_int_list


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("tune", help="measure projection tactics on the GPU; write a "
                            "tactic table file")
    parser.add_argument("artifact", help="compiled artifact (.sgart)")
    parser.add_argument("--out", required=True,
                        help="table file to write, e.g. stepgraph/data/tactics/h200.measured.yaml")
    parser.add_argument("--bins", help="row counts to measure (default: the artifact's bins)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller tactic grid (split 1..4, 4 stages)")
    parser.add_argument("--splitk-only", action="store_true",
                        help="write the fastest split-K tactic at every shape and bin even "
                        "where cuBLAS is faster alone (cuBLAS launches break PDL chains)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    """Measure, write the table, print the summary."""
    bins = parse_int_list(args.bins, "--bins") if args.bins else None
    from stepgraph.runtime.tune import summary, tune

    results = tune(args.artifact, args.out, bins=bins, quick=args.quick,
                   show_progress=not args.no_progress, splitk_only=args.splitk_only)
    print(summary(results, args.splitk_only))
    print(f"wrote {args.out}: projection rows for {len({r.shape for r in results})} shapes")
    return 0
