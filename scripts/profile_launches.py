"""Where a compiled step's GPU time goes: the graph replay of one bin on real inputs (random
caches filled to the context, random tokens: the bench's input sets), then the kernels of a
few replays as the CUDA profiler saw them, summed by kernel name. Replay time minus the sum
of kernel time is what the gaps between launches cost.

Usage (GPU machine): python3 scripts/profile_launches.py ARTIFACT [--rows 1 ...] [--context N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from stepgraph.artifact import load_artifact
from stepgraph.bench.protocol import build_feeds, fill_caches
from stepgraph.bench.weights import device_random_weights
from stepgraph.runtime import StepInputs, load


def _median_us(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _print_exposed(prof: profile, rounds: int) -> None:
    """Per kernel name, the time each launch adds to the chain: its end minus the latest end
    before it (PDL kernels start early and wait, so their own durations overlap)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    exposed: dict[str, float] = defaultdict(float)
    idle = 0.0
    latest = spans[0][0] if spans else 0.0
    for start, end, name in spans:
        if start > latest:
            idle += start - latest
        exposed[name] += max(0.0, end - max(latest, start))
        latest = max(latest, end)
    total = sum(exposed.values()) / rounds
    print(f"exposed (end minus the latest end before it), {total:.1f} us a replay, plus "
          f"{idle / rounds:.1f} us with no kernel running (between replays included):")
    for name, us in sorted(exposed.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {name:<62} {us / rounds:>10.1f}")


def _last_replay(prof: profile, rounds: int) -> list[tuple[str, float, float]]:
    """The kernels of the last profiled replay, in start order, times from its first."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    last = spans[len(spans) - len(spans) // rounds:]
    origin = last[0][0] if last else 0.0
    return [(name, start - origin, end - origin) for start, end, name in last]


def main() -> int:
    """Profile bins of an artifact."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--rows", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--timeline", help="write each bin's kernels of one replay (name, "
                        "start and end in us from the first) to this JSON file")
    args = parser.parse_args()
    timelines: dict[str, list[tuple[str, float, float]]] = {}
    artifact = load_artifact(args.artifact)
    weights = device_random_weights(artifact.graph, 0)
    step = load(artifact, weights=weights, device="cuda", max_requests=64,
                max_context=args.context + 64, progress=False)
    fill_caches(step.caches, 0)
    lim = step.limits
    for size in args.rows or [1]:
        feed = build_feeds(size, 1, 1, args.context, lim.block_size, lim.width, lim.vocab,
                           size)[0]
        with torch.no_grad():
            step.step(StepInputs.from_feed(feed))  # fills the input buffers
            replay = _median_us(lambda s=size: step.replay(s), args.repeats)
            rounds = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(rounds):
                    step.replay(size)
                torch.cuda.synchronize()
        kernels: dict[str, list[float]] = defaultdict(list)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:60]].append(event.device_time)
        busy = sum(sum(v) for v in kernels.values()) / rounds
        count = sum(len(v) for v in kernels.values()) / rounds
        print(f"\n== {artifact.graph.name} bin {size} (context {args.context}): graph replay "
              f"{replay:.1f} us; {count:.0f} kernels busy {busy:.1f} us a replay; gaps "
              f"{replay - busy:.1f} us")
        print(f"{'kernel':<62} {'n':>5} {'us/replay':>10} {'mean us':>8}")
        for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:30]:
            print(f"{name:<62} {len(times) / rounds:>5.0f} {sum(times) / rounds:>10.1f} "
                  f"{sum(times) / len(times):>8.2f}")
        _print_exposed(prof, rounds)
        timelines[str(size)] = _last_replay(prof, rounds)
    if args.timeline:
        with open(args.timeline, "w") as handle:
            json.dump(timelines, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
