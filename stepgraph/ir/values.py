"""IR values: named, typed tensors with a storage class; packed weights and views."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from stepgraph.ir.types import Storage, TensorType


def fast_replace(obj: Any, changes: dict[str, Any]) -> Any:
    """``dataclasses.replace`` for the IR's frozen dataclasses without ``__post_init__``:
    a shallow copy with ``changes`` (passes re-type thousands of values; ``replace`` re-runs
    ``__init__`` and is several times slower). Unknown field names are refused."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = frozenset(f.name for f in fields(obj))
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    state = dict(obj.__dict__)
    state.update(changes)
    object.__setattr__(new, "__dict__", state)
    return new


_FIELDS: dict[type, frozenset[str]] = {}



@dataclass(frozen=True)
class Split:
    """How a logical tensor is divided over a process group: ``dim`` cut in ``ways`` parts.

    ``group`` names the group (``tp``, ``dcp``, ``ep``). Rank r holds part r.
    """

    group: str
    dim: int
    ways: int


@dataclass(frozen=True)
class Segment:
    """Rows ``[offset, offset + rows)`` of a (packed) weight, cut from checkpoint tensor ``source``.

    ``source`` is the logical weight name the runtime fills the rows from (None: zero
    padding); ``split`` says which part of the source a rank takes (None: all of it).
    """

    name: str
    source: str | None
    rows: int
    offset: int = 0
    split: Split | None = None


@dataclass(frozen=True)
class View:
    """A column slice of another value: ``base[:, start:stop]`` in each of ``groups`` blocks.

    With ``groups`` = 1 it is a plain slice of the last dim. With ``groups`` > 1 the base's
    last dim is ``groups`` blocks of ``pitch`` columns (e.g. the all-gather of per-rank packed
    outputs) and the view is the concatenation of ``[start:stop]`` of every block.
    """

    base: str
    start: int
    stop: int
    groups: int = 1
    pitch: int = 0

    @property
    def width(self) -> int:
        """Columns the view holds."""
        return (self.stop - self.start) * self.groups


@dataclass(frozen=True)
class Value:
    """A tensor of the step.

    Weights carry ``segments`` (one for a plain weight, several for a packed one) and
    ``layout``: how the frontend intends the weight to be sharded (``replicated``,
    ``column`` = rows split, ``row`` = columns split, ``experts``, ``vocab``, ``heads``),
    resolved to a :class:`Split` by the shard pass. States name their ``owner`` node.
    Temps may be a ``view`` of another temp (no memory of their own).
    """

    name: str
    type: TensorType
    storage: Storage
    segments: tuple[Segment, ...] = ()
    layout: str = "replicated"
    split: Split | None = None
    owner: str | None = None
    view: View | None = None
    attrs: dict[str, Any] = field(default_factory=dict, compare=False)

    def evolve(self, **changes: Any) -> Value:
        """A copy with ``changes`` (fields only)."""
        return fast_replace(self, changes)

    @property
    def is_weight(self) -> bool:
        """Whether the value is a weight."""
        return self.storage is Storage.WEIGHT

    @property
    def nbytes_static(self) -> int:
        """Bytes of a value without row dims (weights, fixed-size values)."""
        return self.type.nbytes(1)
