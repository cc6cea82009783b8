"""The planner's unit of work: an abstract buffer with a size and an inclusive lifetime.

Kept apart from the planner and the checker so that both read the same data type while
sharing no code.
"""

from __future__ import annotations

from typing import NamedTuple


class Buffer(NamedTuple):
    """``size`` bytes live from launch ``first`` to launch ``last`` (both inclusive).

    Two buffers conflict when their lifetimes share a launch and their byte ranges
    ``[offset, offset + size)`` intersect; a buffer of size 0 conflicts with nothing. A
    valid buffer has ``size >= 0`` and ``0 <= first <= last`` (:func:`check_buffer`).
    """

    name: str
    size: int
    first: int
    last: int


def check_buffer(buffer: Buffer) -> None:
    """Raise ValueError for a negative size or a lifetime that is not ``0 <= first <= last``."""
    if buffer.size < 0:
        raise ValueError(f"buffer {buffer.name}: negative size {buffer.size}")
    if buffer.first < 0 or buffer.last < buffer.first:
        raise ValueError(f"buffer {buffer.name}: bad lifetime [{buffer.first}, {buffer.last}]")
