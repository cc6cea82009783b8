"""A graph-free offline memory planner: abstract buffers with lifetimes -> arena offsets.

The algorithm is greedy with best fit, in the spirit of TFLite Micro's
``GreedyMemoryPlanner``: buffers are placed one by one, each in the smallest gap between
the already-placed buffers whose lifetimes intersect its own that is big enough (ties: the
lowest offset), or on top of them when no gap fits. The order of placement is a strategy:
``area`` (bytes x lifetime, largest first: long-lived buffers such as the AttnRes block
bank go to the bottom first), ``size`` (TFLite's largest first) and ``start`` (first
launch first); each wins on some inputs, so they are tried in that order until one meets
the aligned lower bound, keeping the smallest arena. All keys end with the name, so plans
are deterministic.

Finding the placed buffers whose lifetimes intersect ``[first, last]`` is the hot loop.
They are those live at ``first`` plus those that start in ``(first, last]``; both sets are
kept per launch index for short-lived buffers, and the few long-lived ones are filtered
from one list, so a query costs about the buffers it returns and the whole plan is
near-linear in the number of buffers of a decode step.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stepgraph.memory.buffer import Buffer, check_buffer

DEFAULT_ALIGNMENT = 256


@dataclass(frozen=True)
class Plan:
    """Byte offsets of every buffer and the arena size they need (``alignment`` applied:
    every offset is a multiple of it and every buffer reserves its size rounded up to it),
    and the placement order (``strategy``) that produced them."""

    offsets: dict[str, int]
    arena_bytes: int
    alignment: int
    strategy: str = "size"


STRATEGIES = ("area", "size", "start")


def _order(strategy: str, firsts: list[int], lasts: list[int], reserved: list[int],
           names: list[str]) -> list[int]:
    """The placement order of a strategy (every key is invariant under scaling sizes)."""
    index = range(len(names))
    if strategy == "area":  # bytes x launches, largest first
        return sorted(index, key=lambda i: (-reserved[i] * (lasts[i] - firsts[i] + 1),
                                            -reserved[i], firsts[i], names[i]))
    if strategy == "size":  # largest first, then longest lived
        return sorted(index, key=lambda i: (-reserved[i], firsts[i] - lasts[i], firsts[i],
                                            names[i]))
    if strategy == "start":  # in order of first launch
        return sorted(index, key=lambda i: (firsts[i], -reserved[i], -lasts[i], names[i]))
    raise ValueError(f"unknown placement order {strategy!r}; known: {', '.join(STRATEGIES)}")


def plan_offsets(buffers: Iterable[Buffer], alignment: int = DEFAULT_ALIGNMENT,
                 strategies: Sequence[str] = STRATEGIES) -> Plan:
    """Place ``buffers`` (unique names) in one arena.

    Each placement order of ``strategies`` is tried in turn until one reaches the aligned
    lower bound (the most reserved bytes live at one launch, which no plan can beat); the
    smallest arena wins (ties: the earlier order).
    """
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, not {alignment}")
    if not strategies:
        raise ValueError("no placement order to try")
    items = list(buffers)
    if any(b.size < 0 or b.first < 0 or b.last < b.first for b in items):
        for buffer in items:
            check_buffer(buffer)  # raises for the first bad one
    names = [b.name for b in items]
    if len(set(names)) != len(items):
        raise ValueError("buffer names repeat")
    if not items:
        return Plan({}, 0, alignment, strategies[0])
    firsts = [b.first for b in items]
    lasts = [b.last for b in items]
    reserved = [-(-b.size // alignment) * alignment for b in items]
    floor = _peak(firsts, lasts, reserved)
    best: tuple[list[int], int, str] | None = None
    for strategy in strategies:
        order = _order(strategy, firsts, lasts, reserved, names)
        offsets, arena = _greedy(order, firsts, lasts, reserved)
        if best is None or arena < best[1]:
            best = (offsets, arena, strategy)
        if arena <= floor:
            break
    assert best is not None
    offsets, arena, strategy = best
    return Plan(dict(zip(names, offsets, strict=True)), arena, alignment, strategy)


def _peak(firsts: list[int], lasts: list[int], reserved: list[int]) -> int:
    delta = [0] * (max(lasts) + 2)
    for first, last, size in zip(firsts, lasts, reserved, strict=True):
        delta[first] += size
        delta[last + 1] -= size
    peak = total = 0
    for step in delta:
        total += step
        peak = max(peak, total)
    return peak


LONG = 32  # lifetimes longer than this many launches are kept apart in the greedy


def _greedy(order: list[int], firsts: list[int], lasts: list[int],
            reserved: list[int]) -> tuple[list[int], int]:
    """Place the buffers in ``order``, each in the best-fitting gap; (offsets, arena).

    Placed buffers of short lifetime are indexed by launch (those live at t, those
    starting at t, and the sorted launches where some start); the few long-lived ones (the
    AttnRes bank) sit in one list that every query filters.
    """
    horizon = max(lasts) + 1
    live_at: list[list[int]] = [[] for _ in range(horizon)]  # short ones live at t
    starts_at: list[list[int]] = [[] for _ in range(horizon)]  # short ones starting at t
    points: list[int] = []  # sorted launches t with starts_at[t] non-empty
    long_ones: list[tuple[int, int, tuple[int, int]]] = []  # (first, last, span)
    spans = [(0, 0)] * len(order)  # placed (offset, end); zero-size buffers stay at 0
    arena = 0
    for i in order:
        size, first, last = reserved[i], firsts[i], lasts[i]
        if not size:
            continue
        # (offset, end) of the placed buffers whose lifetimes meet [first, last]
        taken = [spans[j] for j in live_at[first]]
        for t in points[bisect_right(points, first):bisect_right(points, last)]:
            taken.extend(spans[j] for j in starts_at[t])
        taken.extend(span for lo, hi, span in long_ones if lo <= last and hi >= first)
        offset = _best_fit(taken, size)
        end = offset + size
        spans[i] = (offset, end)
        if end > arena:
            arena = end
        if last - first > LONG:
            long_ones.append((first, last, spans[i]))
            continue
        if not starts_at[first]:
            insort(points, first)
        starts_at[first].append(i)
        for t in range(first, last + 1):
            live_at[t].append(i)
    return [span[0] for span in spans], arena


def _best_fit(taken: list[tuple[int, int]], size: int) -> int:
    """The start of the smallest gap of at least ``size`` bytes between the ``taken``
    ranges (ties: the lowest); the end of the highest range when no gap fits."""
    best_offset, best_gap = -1, -1
    cursor = 0
    for start, end in sorted(taken):
        gap = start - cursor
        if gap >= size and (best_gap < 0 or gap < best_gap):
            best_offset, best_gap = cursor, gap
        if end > cursor:
            cursor = end
    return best_offset if best_gap >= 0 else cursor


def _scaled(previous: list[int], plan: Plan, reserved: list[int],
            names: list[str]) -> Plan | None:
    """``plan`` scaled to ``reserved`` when every reserved size is the same multiple
    ``num / den`` of ``previous`` (then the greedy makes the same choices, and each offset,
    a sum of reserved sizes, scales exactly); None otherwise."""
    num, den = sum(reserved), sum(previous)
    if den == 0 or any(new * den != old * num for new, old in zip(reserved, previous,
                                                                   strict=True)):
        return None
    offsets = {}
    for name in names:
        scaled, rest = divmod(plan.offsets[name] * num, den)
        if rest:
            return None
        offsets[name] = scaled
    return Plan(offsets, plan.arena_bytes * num // den, plan.alignment, plan.strategy)


def plan_many(buffer_sets: Sequence[Sequence[Buffer]],
              alignment: int = DEFAULT_ALIGNMENT) -> list[Plan]:
    """:func:`plan_offsets` of each buffer set (the plans in the given order).

    Sets are planned largest first (by reserved bytes). A set whose buffers (same names,
    same lifetimes) are a uniform scaling of an already planned set's, after alignment,
    reuses that plan scaled: the result is identical to planning it afresh. The largest set
    tries every strategy; the others use the strategy that won there (a shared arena is
    as large as its largest bin, so the others only need to fit).
    """
    prepared = []
    for buffers in buffer_sets:
        names = [b.name for b in buffers]
        spans = [(b.first, b.last) for b in buffers]
        reserved = [-(-b.size // alignment) * alignment for b in buffers]
        prepared.append((names, spans, reserved))
    done: list[tuple[list[str], list[tuple[int, int]], list[int], Plan]] = []
    plans: list[Plan | None] = [None] * len(buffer_sets)
    winner: tuple[str, ...] = STRATEGIES
    for index in sorted(range(len(buffer_sets)), key=lambda i: -sum(prepared[i][2])):
        names, spans, reserved = prepared[index]
        plan = None
        for old_names, old_spans, old_reserved, old_plan in done:
            if old_names == names and old_spans == spans:
                plan = _scaled(old_reserved, old_plan, reserved, names)
                if plan is not None:
                    break
        if plan is None:
            plan = plan_offsets(buffer_sets[index], alignment, winner)
            winner = (plan.strategy,)
            done.append((names, spans, reserved, plan))
        plans[index] = plan
    return [plan for plan in plans if plan is not None]
