"""``stepgraph bench ARTIFACT --weights random [--batches 1,4,16,64] [--replays 50]
[--context 4096] [--json FILE]``: the GPU benchmark protocol of shared/BENCHMARKS.md in one
process (see :mod:`stepgraph.bench.session`): the numerical check first, then per bin the
floor, eager, torch.compile(mode="reduce-overhead"), the compiled step's replays, the same
as a decode loop (each step's tokens the argmax of the last step's logits) and the compiled
step with the PDL/prefetch pass off; a Markdown table per bin printed last.

Exit status: 0 when every check passed, 1 when a check failed (its table says which), 2 on
a user error (one line). Needs CUDA; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from stepgraph.atomic_file import writable_path
from stepgraph.commands.common import check_nproc, parse_int_list
from stepgraph.errors import UserError

MODE_FLAGS = {"eager": "eager", "compile": "torch_compile", "stepgraph": "stepgraph",
              "loop": "stepgraph_loop", "nopdl": "stepgraph_nopdl"}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("bench", help="benchmark a compiled step on the GPU against its "
                                          "floor, eager and torch.compile")
    parser.add_argument("artifact", help="compiled artifact (.sgart)")
    parser.add_argument("--weights", required=True,
                        help="`random` (the benchmark runs on seeded random weights)")
    parser.add_argument("--batches", help="row bins to run, e.g. 1,4,16,64 (default: every "
                                          "bin of the artifact)")
    parser.add_argument("--replays", type=int, default=50,
                        help="timed replays per mode and bin (median reported; default 50)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed calls before the replays (default 5)")
    parser.add_argument("--context", type=int, default=4096,
                        help="cached tokens each request attends over (default 4096)")
    parser.add_argument("--sets", type=int, default=4,
                        help="input sets the replays rotate over (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, caches, inputs")
    parser.add_argument("--modes", default=",".join(MODE_FLAGS),
                        help=f"what to run, of {','.join(MODE_FLAGS)} (default: all)")
    parser.add_argument("--check-steps", type=int, default=2,
                        help="consecutive steps of the numerical check (default 2)")
    parser.add_argument("--json", help="also write the full results as JSON to this file, and "
                                       "the tables to the same name with .md; both rewritten "
                                       "after every bin, so a run cut short leaves its results")
    parser.add_argument("--budget-s", type=float,
                        help="start no new measurement after this many seconds (the rest is "
                             "reported as skipped)")
    parser.add_argument("--commit", help="the commit to print (default: git rev-parse here)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (default), or cpu for a dry run of the protocol (its times "
                             "mean nothing)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--nproc", type=int,
                        help="processes, one GPU each, for an artifact compiled for several "
                             "ranks (default: the artifact's ranks)")
    parser.add_argument("--no-ablation", action="store_true",
                        help="multi-rank: skip the no-collectives ablation")
    parser.add_argument("--no-eager", action="store_true",
                        help="multi-rank: skip the eager torch + NCCL mode")
    return parser


def _positive(value: int, flag: str, minimum: int = 1) -> int:
    if value < minimum:
        raise UserError(f"{flag} {value}: must be at least {minimum}")
    return value


def parse_modes(text: str) -> tuple[str, ...]:
    """``"eager,stepgraph"`` -> the report's mode names, in the report's order."""
    from stepgraph.bench.table import MODES

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in MODE_FLAGS]
    if unknown or not names:
        raise UserError(f"--modes {text!r}: choose from {','.join(MODE_FLAGS)}")
    chosen = {MODE_FLAGS[n] for n in names}
    return tuple(m for m in MODES if m in chosen)


def options_from(args: argparse.Namespace, bins: list[int]):  # -> BenchOptions
    """Check every flag (one-line errors) and build the bench options."""
    from stepgraph.bench.options import BenchOptions

    if args.weights != "random":
        raise UserError(f"--weights {args.weights!r}: the benchmark runs on random weights "
                        f"only (--weights random)")
    batches = None
    if args.batches:
        batches = tuple(sorted(set(parse_int_list(args.batches, "--batches"))))
        missing = [b for b in batches if b not in bins]
        if missing:
            raise UserError(f"--batches {','.join(map(str, missing))}: not a bin of this "
                            f"artifact (its bins: {','.join(map(str, bins))})")
    if args.device not in ("cuda", "cpu"):
        raise UserError(f"--device {args.device!r}: choose cuda (or cpu for a dry run)")
    if args.json:
        writable_path(args.json, "--json")
    return BenchOptions(
        batches=batches,
        replays=_positive(args.replays, "--replays"),
        warmup=_positive(args.warmup, "--warmup", 0),
        context=_positive(args.context, "--context"),
        sets=_positive(args.sets, "--sets"),
        seed=args.seed,
        modes=parse_modes(args.modes),
        check_steps=_positive(args.check_steps, "--check-steps"),
        commit=args.commit,
        command=shlex.join(["stepgraph", "bench", *sys.argv[2:]]) if len(sys.argv) > 2 else "",
        progress=not args.no_progress,
        device=args.device,
        budget_s=None if args.budget_s is None else float(_positive(args.budget_s,
                                                                    "--budget-s", 0)),
    )


def run(args: argparse.Namespace) -> int:
    """Check the flags and the artifact, run the benchmark, print the tables."""
    from stepgraph.artifact import load_artifact
    from stepgraph.memory.arena import bin_rows

    artifact = load_artifact(args.artifact)
    options = options_from(args, bin_rows(artifact.graph))
    world = check_nproc(artifact.graph, args.nproc)
    if world > 1:
        return run_ranks(args, options, world)
    from stepgraph.bench.session import run_bench
    from stepgraph.bench.table import MODES, BenchReport, format_report

    def write(report: BenchReport) -> None:
        if not args.json:
            return
        path = Path(args.json)
        try:
            path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
            path.with_suffix(".md").write_text(format_report(report))
        except OSError as error:  # the run goes on: its tables still print at the end
            print(f"warning: --json {args.json}: cannot write ({error.strerror})",
                  file=sys.stderr)

    report = run_bench(artifact, args.artifact, options, write)
    print(format_report(report), end="")
    failed = any(r.check_failed(mode) for r in report.bins for mode in MODES)
    return 1 if failed else 0


def run_ranks(args: argparse.Namespace, options, world: int) -> int:  # options: BenchOptions
    """The multi-rank benchmark (stepgraph.bench.ranks) on ``world`` GPUs."""
    if options.device != "cuda":
        raise UserError("the multi-rank benchmark runs on GPUs only (--device cuda)")
    from stepgraph.bench.ranks import RankBenchOptions, format_rank_bench, run_rank_bench
    from stepgraph.bench.session import git_commit
    from stepgraph.runtime.launch import launch

    rank_options = RankBenchOptions(
        batches=options.batches, replays=options.replays, warmup=options.warmup,
        context=options.context, sets=options.sets, seed=options.seed,
        check_steps=max(options.check_steps, 3), ablation=not args.no_ablation,
        eager=not args.no_eager)
    results = launch(run_rank_bench, world, args.artifact, rank_options)
    header = (f"stepgraph bench {args.artifact} over {world} ranks (commit "
              f"{options.commit or git_commit()}; {options.command or 'stepgraph bench'})")
    text = format_rank_bench(results, header)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=1))
            Path(args.json).with_suffix(".md").write_text(text)
        except OSError as error:
            print(f"warning: --json {args.json}: cannot write ({error.strerror})",
                  file=sys.stderr)
    print(text, end="")
    return 1 if any(b.check_failed for r in results for b in r.bins) else 0
