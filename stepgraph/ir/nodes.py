"""IR nodes: one unit of the decode step a provider prepares, with its placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stepgraph.ir.values import fast_replace

GROUPS = ("tp", "dcp", "ep", "dp")


@dataclass(frozen=True)
class Placement:
    """Where a node runs: ``replicated`` on every rank, ``sharded`` over ``ways`` ranks of
    ``group`` along ``dim`` (``heads``, ``rows``, ``columns``, ``experts``, ``vocab``,
    ``tokens``), or ``data``-parallel (each rank its own rows)."""

    kind: str = "replicated"
    group: str | None = None
    ways: int = 1
    dim: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("replicated", "sharded", "data"):
            raise ValueError(f"bad placement kind {self.kind!r}")
        if self.kind == "replicated" and (self.group is not None or self.ways != 1):
            raise ValueError("a replicated placement has no group")
        if self.kind != "replicated" and (self.group not in GROUPS or self.ways < 1):
            raise ValueError(f"placement {self.kind} needs a group in {GROUPS} and ways >= 1")

    def __str__(self) -> str:
        if self.kind == "replicated":
            return "replicated"
        dim = f"[{self.dim}]" if self.dim else ""
        return f"{self.kind}{dim}@{self.group}{self.ways}"


REPLICATED = Placement()


@dataclass(frozen=True)
class Node:
    """One launch unit: ``op`` reads ``inputs``, writes ``outputs`` (SSA) and updates the
    states in ``updates`` in place. ``layer`` is the model layer (None outside layers),
    ``unit`` the part of the layer (``attention``, ``mlp``, ``residual``, ``head``, ...).
    ``attrs`` holds JSON-able op attributes."""

    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    placement: Placement = REPLICATED
    layer: int | None = None
    unit: str = ""
    updates: tuple[str, ...] = ()

    def evolve(self, **changes: Any) -> Node:
        """A copy with ``changes`` (fields only)."""
        return fast_replace(self, changes)
