"""An independent checker of memory plans: no two buffers live at the same launch may share
a byte, and every buffer must lie inside the arena.

It shares no code with the planner (only the :class:`Buffer` data type): it sweeps the
buffers in order of their first launch and compares each with the buffers still live
when it starts, which visits every pair of buffers whose lifetimes intersect exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stepgraph.errors import UserError
from stepgraph.memory.buffer import Buffer


class PlanCheckError(UserError):
    """A memory plan that places two simultaneously live buffers on the same bytes, or a
    buffer outside the arena or off the alignment."""


@dataclass(frozen=True)
class Conflict:
    """Why a plan is wrong: ``a`` and ``b`` overlap (``b`` is None for a single buffer that
    is malformed, unplaced, misaligned or out of the arena); ``reason`` says it in one
    line."""

    a: Buffer
    b: Buffer | None
    reason: str


def _single(buffer: Buffer, offsets: Mapping[str, int], arena_bytes: int | None,
            alignment: int) -> str | None:
    if buffer.size < 0 or buffer.first < 0 or buffer.last < buffer.first:
        return (f"{buffer.name} is malformed: size {buffer.size}, lifetime "
                f"{buffer.first}..{buffer.last}")
    start = offsets.get(buffer.name)
    if start is None:
        return f"{buffer.name} has no offset"
    if start < 0 or start % alignment:
        return f"{buffer.name} at offset {start} is not a non-negative multiple of {alignment}"
    if arena_bytes is not None and start + buffer.size > arena_bytes:
        return (f"{buffer.name} [{start}, {start + buffer.size}) ends past the arena of "
                f"{arena_bytes} bytes")
    return None


def find_conflict(
    buffers: Iterable[Buffer],
    offsets: Mapping[str, int],
    arena_bytes: int | None = None,
    alignment: int = 1,
) -> Conflict | None:
    """The first problem of a plan, or None when it is sound.

    Single buffers are checked first, in the given order (well formed, an offset for each,
    >= 0, a multiple of ``alignment``, ``offset + size <= arena_bytes`` when that is given),
    then pairs: buffers in order of (first launch, name), each against those still live
    when it starts, in the order they started.
    """
    items = list(buffers)
    for buffer in items:
        reason = _single(buffer, offsets, arena_bytes, alignment)
        if reason is not None:
            return Conflict(buffer, None, reason)
    live: list[tuple[int, int, int, Buffer]] = []  # (last, start, end, buffer)
    for buffer in sorted(items, key=lambda b: (b.first, b.name)):
        if buffer.size == 0:
            continue
        first = buffer.first
        live = [entry for entry in live if entry[0] >= first]
        start = offsets[buffer.name]
        end = start + buffer.size
        for _, other_start, other_end, other in live:
            if other_start < end and start < other_end:
                return Conflict(
                    other, buffer,
                    f"{other.name} [{other_start}, {other_end}) live {other.first}..{other.last}"
                    f" overlaps {buffer.name} [{start}, {end}) live {first}..{buffer.last}")
        live.append((buffer.last, start, end, buffer))
    return None


def check_plan(
    buffers: Iterable[Buffer],
    offsets: Mapping[str, int],
    arena_bytes: int | None = None,
    alignment: int = 1,
) -> None:
    """Raise :class:`PlanCheckError` with the first problem :func:`find_conflict` finds."""
    conflict = find_conflict(buffers, offsets, arena_bytes, alignment)
    if conflict is not None:
        raise PlanCheckError(f"memory plan is wrong: {conflict.reason}")
