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
import sys

from stepgraph.artifact import load_artifact
from stepgraph.bench.ab import compare, load_step, shared_weights


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
    weights = shared_weights(artifacts[0])
    steps = []
    for artifact, env in zip(artifacts, envs, strict=True):
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        steps.append(load_step(artifact, weights, rows_list, args.context))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    table = {}
    for rows in rows_list:
        table[rows] = compare(steps, rows, args.context, args.rounds, args.replays)
        for path, result in zip(args.artifacts, table[rows], strict=True):
            rerouted = (f" ({result.rerouted} of {result.rows} rows rerouted, left out)"
                        if result.rerouted else "")
            print(f"{path} B={rows}: logits vs the first artifact's {result.error:.1e}"
                  f"{rerouted}")
    print("\nmedian step time (us) per round")
    for rows in rows_list:
        for path, result in zip(args.artifacts, table[rows], strict=True):
            print(f"B={rows:<3} {path:<40} " + " ".join(f"{v:8.1f}" for v in result.rounds))
    if len(args.artifacts) > 1:
        print(f"\nchange from {args.artifacts[0]}, round by round (us a step; - is faster)")
        for rows in rows_list:
            base = table[rows][0]
            for path, result in zip(args.artifacts[1:], table[rows][1:], strict=True):
                low, high = result.change_from(base)
                print(f"B={rows:<3} {path:<40} {low:+8.1f} to {high:+.1f} "
                      f"({(result.us - base.us) / base.us:+.1%} in the median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
