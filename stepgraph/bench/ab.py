"""A/B of compiled steps of one spec in one process: every step loaded on the same random
weights, each one's logits from freshly filled caches checked against the first's, then the
steps timed in interleaved rounds (A B C A B C ...), so a machine's drift shows as spread
instead of as a difference. Used by ``stepgraph tune --step`` and ``scripts/ab_replay.py``.

The check is routing-aware: a row whose experts differ from the first step's at some router
(a tie within BF16 rounding that another kernel order breaks the other way) differs by a
whole expert's output, right or wrong; such rows are counted and left out of the error,
which is taken over the rows routed alike (see :mod:`stepgraph.bench.protocol`)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stepgraph.artifact import Artifact
from stepgraph.bench.protocol import (
    build_feeds,
    fill_caches,
    launched_step,
    same_routing_rows,
    serving_call,
    time_calls,
)
from stepgraph.bench.weights import device_random_weights
from stepgraph.runtime import StepInputs, load
from stepgraph.runtime.step import CompiledStep

INPUT_SETS = 4  # input sets the timing rotates over, each with its own requests' slots


@dataclass
class Compared:
    """One step of an A/B at one row count: its logits' distance from the first step's
    (``||out - first|| / ||first||`` over the rows routed as the first step routes them;
    NaN when its logits hold a NaN or no row is routed alike), the rows routed otherwise
    (``rerouted`` of ``rows``) and the median step time of each round (us)."""

    error: float
    rounds: list[float] = field(default_factory=list)
    rerouted: int = 0
    rows: int = 0

    @property
    def us(self) -> float:
        """The median of the rounds' medians."""
        return statistics.median(self.rounds)

    def change_from(self, base: Compared) -> tuple[float, float]:
        """The least and the most this step's time moved from ``base``'s over rounds timed
        side by side (round i against round i: the pairs share the machine's drift), us."""
        if not self.rounds or len(self.rounds) != len(base.rounds):
            raise ValueError(f"paired rounds: {len(self.rounds)} against {len(base.rounds)}")
        moves = [mine - theirs for mine, theirs in zip(self.rounds, base.rounds, strict=True)]
        return min(moves), max(moves)


def probe_arguments(description: str) -> argparse.ArgumentParser:
    """The command line the step probes share (``scripts/probe_*.py``): an artifact, the row
    count, the rounds, timed replays a round and the context."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("artifact")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=60)
    parser.add_argument("--context", type=int, default=4096)
    return parser


def shared_weights(artifact: Artifact, seed: int = 0, device: str = "cuda"
                   ) -> dict[str, torch.Tensor]:
    """Seeded random weights of ``artifact``'s graph on ``device``, for every step of an A/B
    (the steps of one spec bind the same weights)."""
    return device_random_weights(artifact.graph, seed, device=device)


def load_step(artifact: Artifact, weights: dict[str, torch.Tensor], rows: Sequence[int],
              context: int, device: str = "cuda") -> CompiledStep:
    """Load ``artifact``'s step on ``weights`` with caches for ``context`` tokens and enough
    requests for the input sets of the largest row count."""
    requests = max(64, INPUT_SETS * max(rows))
    return load(artifact, weights=weights, device=device, max_requests=requests,
                max_context=context + 64, progress=False)


def checked(ids: dict[str, torch.Tensor], logits: torch.Tensor,
            base_ids: dict[str, torch.Tensor], base: torch.Tensor) -> Compared:
    """A step's logits (and expert choices) against the first step's: the relative error
    over the rows both route alike, and how many rows they route otherwise."""
    rows = logits.shape[0]
    alike = (same_routing_rows(ids, base_ids) if base_ids
             else torch.ones(rows, dtype=torch.bool, device=logits.device))
    rerouted = rows - int(alike.sum())
    if bool(torch.isnan(logits).any()) or rerouted == rows:
        return Compared(float("nan"), rerouted=rerouted, rows=rows)
    kept, want = logits[alike], base[alike]
    error = float((kept - want).norm() / want.norm().clamp_min(1e-30))
    return Compared(error, rerouted=rerouted, rows=rows)


def compare(steps: Sequence[CompiledStep], rows: int, context: int, rounds: int,
            replays: int) -> list[Compared]:
    """Check each step's logits against the first's (over the rows routed alike, the
    expert choices read from its launches run one by one on the same caches), then time
    every step ``rounds`` times in turn (``replays`` timed calls a round, after 10 untimed;
    a call is the inputs' copy and the replay, the logits left in the output buffer, as the
    bench times it)."""
    lim = steps[0].limits
    feeds = build_feeds(rows, 1, INPUT_SETS, context, lim.block_size, lim.width, lim.vocab,
                        rows)
    inputs = [StepInputs.from_feed(feed) for feed in feeds]
    results = []
    first: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
    for step in steps:
        with torch.no_grad():
            fill_caches(step.caches, 0)
            ids, _ = launched_step(step, inputs[0])
            fill_caches(step.caches, 0)
            logits = step.step(inputs[0]).float()
        first = (ids, logits) if first is None else first
        results.append(checked(ids, logits, *first))
    for _ in range(rounds):
        for step, result in zip(steps, results, strict=True):
            with torch.no_grad():
                got = time_calls(serving_call(step), inputs, replays, 10, step.device)
            result.rounds.append(statistics.median(got))
    return results
