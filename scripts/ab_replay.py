"""A/B of compiled steps of one spec (artifacts compiled with different options or tactic
tables) on the same random weights: per artifact, the logits of one step from freshly filled
caches against the first artifact's, and the median step time over rotating input sets.

Usage (GPU machine): python3 scripts/ab_replay.py ART[:NAME=VALUE,...] [...] [--rows 1]
Every artifact is loaded first (the NAME=VALUE pairs after one are set in the environment
while it loads); then each round times every step in turn (A B C A B C ...), so drift shows
as spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.protocol import build_feeds, fill_caches, time_calls
from stepgraph.bench.weights import device_random_weights
from stepgraph.runtime import StepInputs, load


def main() -> int:
    """Load, check and time each artifact."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rows", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=60)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    rows_list = args.rows or [1]
    paths = [spec.split(":")[0] for spec in args.artifacts]
    envs = [dict(kv.split("=") for kv in spec.split(":")[1].split(",")) if ":" in spec else {}
            for spec in args.artifacts]
    artifacts = [load_artifact(path) for path in paths]
    weights = device_random_weights(artifacts[0].graph, 0)
    sets = 4  # input sets the timing rotates over, each with its own requests' slots
    requests = max(64, sets * max(rows_list))
    steps = []
    for artifact, env in zip(artifacts, envs, strict=True):
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        steps.append(load(artifact, weights=weights, device="cuda", max_requests=requests,
                          max_context=args.context + 64, progress=False))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    reference: dict[int, torch.Tensor] = {}
    times: dict[tuple[str, int], list[float]] = {}
    for rows in rows_list:
        lim = steps[0].limits
        feeds = build_feeds(rows, 1, sets, args.context, lim.block_size, lim.width, lim.vocab,
                            rows)
        inputs = [StepInputs.from_feed(f) for f in feeds]
        for path, step in zip(args.artifacts, steps, strict=True):
            with torch.no_grad():
                fill_caches(step.caches, 0)
                logits = step.step(inputs[0]).float()
            if rows not in reference:
                reference[rows] = logits
            err = float((logits - reference[rows]).norm() / reference[rows].norm())
            nan = ", NaN" if bool(torch.isnan(logits).any()) else ""
            print(f"{path} B={rows}: logits vs the first artifact's {err:.1e}{nan}")
        for _ in range(args.rounds):
            for path, step in zip(args.artifacts, steps, strict=True):
                with torch.no_grad():
                    got = time_calls(step.step, inputs, args.replays, 10, step.device)
                times.setdefault((path, rows), []).append(statistics.median(got))
    print("\nmedian step time (us) per round")
    for rows in rows_list:
        for path in args.artifacts:
            values = times[(path, rows)]
            print(f"B={rows:<3} {path:<40} " + " ".join(f"{v:8.1f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
