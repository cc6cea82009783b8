"""Probe: a decode step's time when every step's tokens come from the step before, against
back-to-back replays of ready inputs, and one step at a time.

``scripts/ab_replay.py`` and the bench's main row time steps whose inputs are ready before
they run, so a step's graph may start while the one before still runs. In a decode loop the
next tokens are sampled from the last logits: here ("dependent") each step's tokens are the
argmax of the previous step's logits, written on the GPU into the token buffer the next
replay reads (the bench's decode-loop row, :func:`stepgraph.bench.protocol.
decode_loop_call`), so every step starts after the one before has ended (what a serving loop
with on-device sampling pays); "waited": one step at a time, the host waiting for each
(its launch included). Per artifact and round, us a step; artifacts interleaved in a round.

Usage (GPU machine): python3 scripts/probe_dependent_steps.py ART [ART ...] [--rows 1]
"""

from __future__ import annotations

import sys

import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.ab import compare, load_step, probe_arguments, shared_weights
from stepgraph.bench.protocol import build_feeds, decode_loop_call, fill_caches
from stepgraph.runtime import StepInputs
from stepgraph.runtime.step import CompiledStep
from stepgraph.runtime.tune import replay_median_us


def _dependent_us(step: CompiledStep, inputs: StepInputs, replays: int) -> float:
    """Microseconds a step (the mean) over ``replays`` steps of the bench's decode loop,
    each one's tokens the argmax of the last one's logits."""
    one = decode_loop_call(step, inputs)
    for _ in range(5):
        one(None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        one(None)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> int:
    """Load the artifacts on shared weights and time each form in interleaved rounds."""
    parser = probe_arguments(__doc__.splitlines()[0])
    parser.add_argument("more", nargs="*", help="more artifacts, timed beside the first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA GPU", file=sys.stderr)
        return 2
    paths = [args.artifact, *args.more]
    artifacts = [load_artifact(path) for path in paths]
    weights = shared_weights(artifacts[0])
    steps = [load_step(artifact, weights, [args.rows], args.context) for artifact in artifacts]
    independent = compare(steps, args.rows, args.context, args.rounds, args.replays)
    lim = steps[0].limits
    feed = build_feeds(args.rows, 1, 1, args.context, lim.block_size, lim.width, lim.vocab,
                       args.rows)[0]
    rounds: dict[str, dict[str, list[float]]] = {p: {"dependent": [], "waited": []}
                                                 for p in paths}
    inputs = StepInputs.from_feed(feed)
    with torch.no_grad():
        for step in steps:
            fill_caches(step.caches, 0)
        for _ in range(args.rounds):
            for path, step in zip(paths, steps, strict=True):
                rounds[path]["dependent"].append(_dependent_us(step, inputs, args.replays))
                # one replay on an idle GPU at a time, the host waiting for each
                rounds[path]["waited"].append(replay_median_us(
                    step.plan(step.bin_for(args.rows)).graph, args.replays // 2))
    print(f"B={args.rows}, us a step per round")
    for path, result in zip(paths, independent, strict=True):
        print(f"{path:<28} logits vs the first {result.error:.1e}")
        print(f"  {'independent (the bench)':<26}" + " ".join(f"{v:8.1f}" for v in result.rounds))
        for form in ("dependent", "waited"):
            print(f"  {form:<26}" + " ".join(f"{v:8.1f}" for v in rounds[path][form]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
