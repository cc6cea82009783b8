"""Probe: what a timed step holds besides its graph replay: ``CompiledStep.step`` (the
inputs' copy to the device, the replay, the logits' clone) with the host running ahead, the
same without the clone (what the bench times), the replay alone (inputs left as the last
fill wrote them) and the fill alone; for the step loaded with one device block of inputs
(the copy between two steps' graphs) and with two (the copy beside the step before).

Usage (GPU machine): python3 scripts/probe_step_overhead.py ARTIFACT [--rows 1] [--rounds 3]
"""

from __future__ import annotations

import statistics
import sys

import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.ab import INPUT_SETS, probe_arguments, shared_weights
from stepgraph.bench.protocol import build_feeds, fill_caches, serving_call, time_calls
from stepgraph.runtime import StepInputs, load


def main() -> int:
    """Load the step once; time each form of the call in interleaved rounds."""
    args = probe_arguments(__doc__.splitlines()[0]).parse_args()
    artifact = load_artifact(args.artifact)
    weights = shared_weights(artifact)
    steps = {blocks: load(artifact, weights=weights, device="cuda", max_requests=64,
                          max_context=args.context + 64, progress=False, input_blocks=blocks)
             for blocks in (1, 2)}
    lim = steps[1].limits
    feeds = build_feeds(args.rows, 1, INPUT_SETS, args.context, lim.block_size, lim.width,
                        lim.vocab, args.rows)
    inputs = [StepInputs.from_feed(feed) for feed in feeds]
    forms = {}
    for blocks, step in steps.items():
        size = step.bin_for(args.rows)
        fill_caches(step.caches, 0)
        forms.update({
            f"{blocks} block(s): step (fill, replay, clone)": step.step,
            f"{blocks} block(s): step, clone=False (bench)": serving_call(step),
            f"{blocks} block(s): replay only": lambda inp, s=step, n=size: s.replay(n),
            f"{blocks} block(s): fill only": lambda inp, s=step, n=size: s.filler.fill(inp, n),
        })
    table: dict[str, list[float]] = {name: [] for name in forms}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, call in forms.items():
                got = time_calls(call, inputs, args.replays, 10, torch.device("cuda"))
                table[name].append(statistics.median(got))
    for name, rounds in table.items():
        print(f"{name:<44} " + " ".join(f"{v:8.1f}" for v in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
