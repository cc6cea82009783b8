"""``stepgraph tune ARTIFACT --out FILE [--bins 1,2,4] [--shapes 560x7168,...] [--quick]
[--cublas-margin-us US | --splitk-only]``: measure cuBLAS and split-K tactics for every
projection shape (and gated MLP gate_up shape; or only the ``--shapes`` named) and bin of an
artifact on this machine's GPU and write a tactic table file (the
format of ``stepgraph/data/tactics/h200.yaml``); cuBLAS is picked only where it is faster
alone by more than the margin (default: the target table's ``pdl.cublas_break_us``).

``stepgraph tune ARTIFACT --out FILE --bins 1 --step OP.FIELD=V1,V2 [--step ...] [--table
FILE]``: measure every combination of those tactic values of tabled ops (or of keys of the
file's sections, e.g. ``streams.root_fork=0,1``) *in the step* (the artifact's spec compiled
once per candidate, A/B in one process on the same weights) and write the base table with
the fastest candidate set (:mod:`stepgraph.runtime.tune_step`).
Needs CUDA; torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import math

from stepgraph.atomic_file import writable_path
from stepgraph.commands.common import parse_int_list
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("tune", help="measure projection tactics on the GPU; write a "
                            "tactic table file")
    parser.add_argument("artifact", help="compiled artifact (.sgart)")
    parser.add_argument("--out", required=True,
                        help="table file to write, e.g. stepgraph/data/tactics/h200.measured.yaml")
    parser.add_argument("--bins", help="row counts to measure (default: the artifact's bins)")
    parser.add_argument("--shapes", metavar="NxK[,NxK...]",
                        help="measure only these per-rank weight shapes of the artifact, e.g. "
                        "560x7168 (default: every projection shape; `stepgraph inspect "
                        "--explain NODE` shows a node's)")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller tactic grid (split 1..4, 4 stages)")
    margin = parser.add_mutually_exclusive_group()
    margin.add_argument("--cublas-margin-us", type=float, metavar="US",
                        help="pick cuBLAS only where it is faster alone than the best split-K "
                        "tactic by more than US microseconds (a cuBLAS launch breaks the PDL "
                        "chain on both sides; default: the target table's "
                        "pdl.cublas_break_us)")
    margin.add_argument("--splitk-only", action="store_true",
                        help="write the fastest split-K tactic at every shape and bin even "
                        "where cuBLAS is faster alone (an infinite --cublas-margin-us)")
    parser.add_argument("--step", action="append", default=[], metavar="OP.FIELD=V1,V2",
                        help="tune these tactic values of a tabled op (or values of a "
                        "section key: streams.join_lead=0,1, streams.root_fork=0,1) in the "
                        "step itself (repeatable: every combination is measured; needs "
                        "--bins)")
    parser.add_argument("--table", help="with --step: the base table file (default: the "
                        "target's own)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --step: interleaved timing rounds (default 3)")
    parser.add_argument("--context", type=int, default=4096,
                        help="with --step: cached tokens a request (default 4096)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"560x7168,7168x448"`` -> [(560, 7168), (7168, 448)]; a one-line error otherwise."""
    from stepgraph.tactics import parse_weight_shape

    shapes = []
    for part in (p for p in text.split(",") if p.strip()):
        shape = parse_weight_shape(part)
        if shape is None:
            raise UserError(f"--shapes {text!r}: expected comma-separated NxK weight shapes "
                            "with positive sizes, e.g. 560x7168,7168x448")
        shapes.append(shape)
    if not shapes:
        raise UserError("--shapes: give at least one NxK weight shape, e.g. 560x7168")
    return shapes


def run(args: argparse.Namespace) -> int:
    """Measure, write the table, print the summary."""
    writable_path(args.out, "--out")
    bins = parse_int_list(args.bins, "--bins") if args.bins else None
    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    if args.step:
        if shapes is not None:
            raise UserError("--shapes belongs to the projection tuning, not to --step")
        return run_step(args, bins)
    if args.table:
        raise UserError("--table is the base table of --step; the projection tuning writes "
                        "its rows over the target's own table")
    from stepgraph.runtime.tune import summary, tune

    margin = math.inf if args.splitk_only else args.cublas_margin_us
    tuned = tune(args.artifact, args.out, bins=bins, quick=args.quick,
                 show_progress=not args.no_progress, cublas_margin_us=margin, shapes=shapes)
    print(summary(tuned))
    measured = len({m.shape for m in tuned.measurements})
    print(f"wrote {args.out}: projection rows for {measured} shapes")
    return 0


def run_step(args: argparse.Namespace, bins: list[int] | None) -> int:
    """``--step``: tune tactic values in the step, write the table, print the timings."""
    from stepgraph.runtime.tune_step import summary, tune_step

    if args.quick or args.splitk_only or args.cublas_margin_us is not None:
        raise UserError("--quick, --splitk-only and --cublas-margin-us belong to the "
                        "projection tuning, not to --step")
    if args.rounds < 1 or args.context < 1:
        raise UserError("--rounds and --context must be positive")
    results = tune_step(args.artifact, args.out, args.step, bins or [], table=args.table,
                        rounds=args.rounds, context=args.context,
                        show_progress=not args.no_progress)
    print(summary(results))
    print(f"wrote {args.out}: the base table with the fastest candidate of "
          f"{len(results)} bin(s) set")
    return 0
