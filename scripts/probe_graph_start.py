"""Probe: what a forked side-stream branch costs at the start of a captured CUDA graph.

k3-slice-tp1 and k3-rank-tp8 show ~10 us between the step's first kernel and its second when
the graph has the shared expert's side branch, ~1.9 us when compiled ``--no-streams``
(docs/perf.md, tenth session). This probe captures synthetic graphs of one chain of small
PDL launches (RMSNorms of one 7168-wide row) with and without a forked branch, and with the
branch forked at different points, and prints per graph the gap between the end of kernel 0
and the start of kernel 1 and 2 (CUDA profiler timestamps, median over replays) and the
replay time: which placement of the fork, if any, keeps the start free.

Usage (GPU machine): python3 scripts/probe_graph_start.py [--chain 40] [--replays 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from stepgraph.runtime.kernels.elementwise import RmsNorm
from stepgraph.runtime.side_stream import fork, join

WIDTH = 7168


def _chain(dev: torch.device, length: int, fork_after: tuple[int, ...], branch: int = 3,
           join_after: int = 6) -> Callable[[], None]:
    """``length`` RMSNorms in a chain (PDL); after each launch in ``fork_after``, ``branch``
    more on the side stream, joined before launch ``fork point + join_after``."""
    rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16) for _ in range(length + 1)]
    side_rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16)
                 for _ in range(branch + 1)]
    weight = torch.ones(WIDTH, device=dev, dtype=torch.bfloat16)
    main = [RmsNorm(rows[i], weight, rows[i + 1], 1e-5, pdl=i > 0) for i in range(length)]
    side = [RmsNorm(side_rows[i], weight, side_rows[i + 1], 1e-5, pdl=i > 0)
            for i in range(branch)]

    def branch_launches() -> None:
        for launch in side:
            launch()

    def run() -> None:
        for i, launch in enumerate(main):
            if i - join_after in fork_after:
                join(dev)
            launch()
            if i in fork_after:
                fork(dev, branch_launches)
        join(dev)

    return run


def _captured(run: Callable[[], None], dev: torch.device) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _measure(graph: torch.cuda.CUDAGraph, replays: int) -> tuple[float, float, float]:
    """(median gap kernel 0 end -> kernel 1 start, -> kernel 2 start, replay us)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    per = len(spans) // replays
    gaps1, gaps2 = [], []
    for r in range(replays):
        one = spans[r * per:(r + 1) * per]
        gaps1.append(one[1][0] - one[0][1])
        gaps2.append(one[2][0] - one[0][1])
    return statistics.median(gaps1), statistics.median(gaps2), statistics.median(times)


def main() -> int:
    """Capture and time each graph form."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    forms = {"one chain": (), "fork after kernel 0": (0,), "fork after kernel 1": (1,),
             "fork after kernel 5": (5,), "fork after kernel 20": (20,),
             "3 forks (5, 15, 25)": (5, 15, 25), "6 forks (every 6th)": (0, 6, 12, 18, 24, 30)}
    print(f"{'graph':<24} {'k0 end -> k1 start us':>22} {'-> k2 start us':>15} {'replay us':>10}")
    for name, at in forms.items():
        graph = _captured(_chain(dev, args.chain, at), dev)
        gap1, gap2, replay = _measure(graph, args.replays)
        print(f"{name:<24} {gap1:>22.2f} {gap2:>15.2f} {replay:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
