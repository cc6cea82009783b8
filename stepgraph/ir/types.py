"""Tensor types of the IR: shapes with symbolic dims, dtypes and storage classes.

A dim is an ``int`` or a symbol string. ``"B"`` is the step's row count (requests x q);
``"B*N"`` and ``"B/N"`` are rows scaled by an integer; any other identifier (``"S"`` state
slots, ``"NB"`` cache blocks, ``"T"`` block-table width) is sized by the caller at run time
and never lives in the arena.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

Dim = int | str

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
}

_ROWS = re.compile(r"^B(?:([*/])(\d+))?$")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


class Storage(StrEnum):
    """Who owns a value's memory and for how long."""

    WEIGHT = "weight"  # persistent, read-only
    STATE = "state"  # persistent, read/write, caller-owned caches
    INPUT = "input"  # step metadata written by the host before a replay
    TEMP = "temp"  # step-local; the memory planner places it in the arena
    OUTPUT = "output"  # read by the host after a replay


def is_rows_dim(dim: Dim) -> bool:
    """Whether ``dim`` scales with the row count B."""
    return isinstance(dim, str) and _ROWS.match(dim) is not None


def check_dim(dim: Dim) -> None:
    """Raise ValueError if ``dim`` is not a valid dim."""
    if isinstance(dim, bool):
        raise ValueError(f"bad dim {dim!r}")
    if isinstance(dim, int):
        if dim < 0:
            raise ValueError(f"negative dim {dim}")
        return
    if not (_ROWS.match(dim) or _SYMBOL.match(dim)):
        raise ValueError(f"bad symbolic dim {dim!r}")


def eval_dim(dim: Dim, rows: int, symbols: dict[str, int] | None = None) -> int:
    """The size of ``dim`` for ``rows`` rows (and the caller's ``symbols``)."""
    if isinstance(dim, int):
        return dim
    match = _ROWS.match(dim)
    if match is not None:
        op, factor = match.groups()
        if op is None:
            return rows
        return rows * int(factor) if op == "*" else -(-rows // int(factor))
    if symbols is None or dim not in symbols:
        raise KeyError(f"symbol {dim!r} has no size")
    return symbols[dim]


def scale_rows(dim: Dim, factor: int) -> Dim:
    """A rows dim multiplied by ``factor`` (``"B"`` x 8 -> ``"B*8"``)."""
    match = _ROWS.match(str(dim))
    if match is None:
        raise ValueError(f"{dim!r} is not a rows dim")
    op, old = match.groups()
    if op is None:
        return "B" if factor == 1 else f"B*{factor}"
    if op == "*":
        return f"B*{int(old) * factor}"
    raise ValueError(f"cannot scale {dim!r}")


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape (ints and symbolic dims) and dtype."""

    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        for dim in self.shape:
            check_dim(dim)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_BYTES[self.dtype]

    def numel(self, rows: int = 1, symbols: dict[str, int] | None = None) -> int:
        """Elements at ``rows`` rows."""
        total = 1
        for dim in self.shape:
            total *= eval_dim(dim, rows, symbols)
        return total

    def nbytes(self, rows: int = 1, symbols: dict[str, int] | None = None) -> int:
        """Bytes at ``rows`` rows."""
        return self.numel(rows, symbols) * self.itemsize

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.dtype_short}[{dims}]"

    @property
    def dtype_short(self) -> str:
        """A short dtype name for printing (bf16, f32, i32, ...)."""
        return _SHORT[self.dtype]


_SHORT = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
}
