"""Byte counts as people read them: binary units for memory sizes (weights, arenas, free GPU
memory). Bandwidth-style decimal units (GB moved a step) are :func:`stepgraph.bench.floor.
format_bytes`."""

from __future__ import annotations


def human_bytes(count: float) -> str:
    """A size in binary units, one decimal: 1536 -> '1.5 KiB', 1023 -> '1023 B'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable: TiB returns")
