"""Timing helper of the probe scripts: prepared launches captured once into a CUDA graph and
replayed back to back (the way the runtime's step replays)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def replay_us(launches: Sequence[Callable[[], None]], replays: int) -> float:
    """Median microseconds of one replay of a CUDA graph of every launch (captured on a side
    stream after one eager run, three warm-up replays first)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for launch in launches:
            launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for launch in launches:
            launch()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return median_replay_us(graph, replays)


def median_replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median microseconds of ``replays`` replays of ``graph``, each timed by a CUDA event
    pair and synchronized."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run_once(launches: Sequence[Callable[[], None]]) -> str | None:
    """Run every launch once eagerly (compiling its kernels); None, or why it failed in one
    line (a probe reports the form and goes on to the next)."""
    try:
        for launch in launches:
            launch()
        torch.cuda.synchronize()
    except Exception as exc:  # any failure of a form is reported, not raised
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None
