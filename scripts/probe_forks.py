"""Probe: where a captured CUDA graph's forked side branches cost, and which form costs least.

docs/perf.md (eleventh session): a chain of 40 PDL launches replays ~12-15 us slower with one
forked branch, each further fork ~2-3 us more; k3-rank-tp8 forks the shared expert 12 times a
step. This probe captures a chain of ``--chain`` small PDL launches (RMSNorms of one
7168-wide row) with ``--forks`` branches of ``--branch`` launches (Adds, so the profile tells
them apart) forked every ``chain / forks`` launches and joined ``--join-after`` launches
later, in several forms, and prints per form the replay time (each replay synchronized;
"ahead": replays enqueued back to back, as a serving loop runs) and where the main chain's time
between its launches goes (the gap before launch 1, at the launches right after a fork, at
the launches carrying a join, everywhere else; CUDA profiler timestamps, summed a replay,
median over replays).

Usage (GPU machine): python3 scripts/probe_forks.py [--chain 120] [--forks 12] [--replays 20]
(It replaces scripts/probe_graph_start.py, the eleventh session's probe of one fork's place:
``--chain 40`` and the forms with one fork, ``at=(k,)``.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from stepgraph.runtime.kernels.elementwise import Add, RmsNorm
from stepgraph.runtime.side_stream import fork, join, side_stream
from stepgraph.runtime.tune import captured_graph, replay_median_us

WIDTH = 7168


@dataclass(frozen=True)
class Form:
    """One graph form: how the branches are launched and joined."""

    side_pdl: bool = True  # the branch's launches after its first use PDL
    first_side_pdl: bool = False  # the branch's first launch too (its edge is a full one)
    join_at_end: bool = False  # every branch joined once, after the chain
    root_branch: bool = False  # one more branch forked before launch 0, joined at the end
    pdl_after_join: bool = True  # the launch carrying a join is a PDL launch
    at: tuple[int, ...] | None = None  # the fork points (None: every chain / forks launches)
    branch: int | None = None  # launches a branch (None: --branch)


FORMS = {
    "one chain": Form(at=()),
    "one fork": Form(first_side_pdl=True, at=(0,)),
    "one fork after kernel 20": Form(first_side_pdl=True, at=(20,)),
    "forks (as the runtime)": Form(first_side_pdl=True),
    "forks, branch's first launch no PDL": Form(),
    "forks, branch without PDL": Form(side_pdl=False),
    "forks, joined at the end": Form(first_side_pdl=True, join_at_end=True),
    "forks + a branch at the root": Form(first_side_pdl=True, root_branch=True),
    "forks, no PDL on the join launch": Form(first_side_pdl=True, pdl_after_join=False),
    "2 forks (0, 60)": Form(first_side_pdl=True, at=(0, 60)),
    "2 forks (0, 10)": Form(first_side_pdl=True, at=(0, 10)),
    "2 forks (10, 20)": Form(first_side_pdl=True, at=(10, 20)),
    "2 forks (30, 40)": Form(first_side_pdl=True, at=(30, 40)),
    "4 forks (0, 10, 20, 30)": Form(first_side_pdl=True, at=(0, 10, 20, 30)),
    "11 forks from 10": Form(first_side_pdl=True, at=tuple(range(10, 120, 10))),
    "forks, branches of 1 launch": Form(first_side_pdl=True, branch=1),
}


def _graph_run(dev: torch.device, length: int, forks: int, branch: int, join_after: int,
               form: Form) -> tuple[Callable[[], None], set[int], set[int]]:
    """The launches of one form, and the main-chain positions right after a fork and those
    that carry a join."""
    rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16) for _ in range(length + 1)]
    weight = torch.ones(WIDTH, device=dev, dtype=torch.bfloat16)
    every = max(1, length // max(1, forks))
    at = list(range(0, length, every)) if form.at is None else list(form.at)
    branch = form.branch or branch
    joins = {i + join_after for i in at if i + join_after < length and not form.join_at_end}
    main = [RmsNorm(rows[i], weight, rows[i + 1], 1e-5,
                    pdl=i > 0 and (form.pdl_after_join or i not in joins))
            for i in range(length)]
    side_rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16)
                 for _ in range(branch + 1)]
    side = [Add([side_rows[i], side_rows[i]], side_rows[i + 1],
                pdl=form.side_pdl and (i > 0 or form.first_side_pdl)) for i in range(branch)]
    root = Add([side_rows[0], side_rows[0]], side_rows[1], pdl=False)

    def branch_launches() -> None:
        for launch in side:
            launch()

    def run() -> None:
        if form.root_branch:
            side_stream(dev).wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side_stream(dev)):
                root()
        for i, launch in enumerate(main):
            if i in joins:
                join(dev)
            launch()
            if i in at:
                fork(dev, branch_launches)
        if form.root_branch:
            torch.cuda.current_stream(dev).wait_stream(side_stream(dev))
        join(dev)

    return run, {i + 1 for i in at}, joins


def _measure(graph: torch.cuda.CUDAGraph, replays: int, after_fork: set[int],
             joins: set[int]) -> dict[str, float]:
    """Median replay us and the main chain's gaps a replay, by where they sit."""
    replay = replay_median_us(graph, replays)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    ahead = start.elapsed_time(end) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
    main = [(s, e) for s, e, name in events if "rmsnorm" in name]
    per = len(main) // replays
    parts: dict[str, list[float]] = {"first": [], "after fork": [], "join": [], "other": []}
    for r in range(replays):
        one = main[r * per:(r + 1) * per]
        sums = dict.fromkeys(parts, 0.0)
        for i in range(1, len(one)):
            gap = one[i][0] - one[i - 1][1]
            key = ("first" if i == 1 else "join" if i in joins
                   else "after fork" if i in after_fork else "other")
            sums[key] += gap
        for key, value in sums.items():
            parts[key].append(value)
    out = {key: statistics.median(values) for key, values in parts.items()}
    out["replay"] = replay
    out["ahead"] = ahead
    out["span"] = statistics.median(main[r * per + per - 1][1] - main[r * per][0]
                                    for r in range(replays))
    return out


def main() -> int:
    """Capture and time each graph form."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=120)
    parser.add_argument("--forks", type=int, default=12)
    parser.add_argument("--branch", type=int, default=3)
    parser.add_argument("--join-after", type=int, default=6)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"chain {args.chain}, forks {args.forks}, branch {args.branch}, "
          f"joined {args.join_after} later; us a replay (gaps: main chain, summed)")
    print(f"{'graph':<36} {'replay':>8} {'ahead':>8} {'span':>8} {'first':>7} {'@fork':>7} "
          f"{'@join':>7} {'other':>7}")
    for name, form in FORMS.items():
        run, after_fork, joins = _graph_run(dev, args.chain, args.forks, args.branch,
                                            args.join_after, form)
        m = _measure(captured_graph(run, dev), args.replays, after_fork, joins)
        print(f"{name:<36} {m['replay']:>8.1f} {m['ahead']:>8.1f} {m['span']:>8.1f} "
              f"{m['first']:>7.2f} {m['after fork']:>7.2f} {m['join']:>7.2f} "
              f"{m['other']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
