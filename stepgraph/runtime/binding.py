"""Binding: every value of a compiled step gets a tensor.

* temps: typed views of ONE arena (``torch.uint8``) at the offsets the memory plan
  (``meta["memory"]``) gives each bin; a temp that is an IR :class:`View` is a strided view of
  its base (no memory of its own), except a view of column groups (multi-rank plans: the
  router logits of an all-gathered MoE front), which no strided view expresses: it gets a
  small buffer of its own that :func:`regroup_launches` refreshes after its base is written;
* weights and states (caches): persistent tensors shared by every bin;
* step inputs and outputs: static buffers sized for the largest bin; a bin binds their first
  ``rows`` rows.

The plan sizes temps in their IR dtypes. When the step runs in a wider dtype than the model's
(float32 compute of a bfloat16 model, on CPU), every offset and the arena are scaled by the
same factor, which keeps disjoint byte ranges disjoint.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import DTYPE_BYTES, Storage, eval_dim
from stepgraph.ir.values import Value, View
from stepgraph.lower.tensors import read_view, storage_dtype

ALIGNMENT = 256


def arena_scale(graph: Graph, compute: torch.dtype) -> int:
    """How many times wider than planned the arena must be: the largest ratio of a temp's
    run dtype to its IR dtype (1 when the step runs in the model's dtype or narrower)."""
    scale = 1
    for value in graph.values_of(Storage.TEMP):
        held = storage_dtype(value.type.dtype, compute)
        planned = DTYPE_BYTES[value.type.dtype]
        scale = max(scale, -(-held.itemsize // planned))
    return scale


@dataclass
class Arena:
    """One byte buffer holding every bin's temps, aligned to :data:`ALIGNMENT` bytes;
    ``scale`` multiplies the plan's offsets (see the module docstring)."""

    data: torch.Tensor
    scale: int = 1

    @classmethod
    def allocate(cls, planned_bytes: int, scale: int, device: torch.device) -> Arena:
        """An arena for a plan of ``planned_bytes`` (scaled by ``scale``) on ``device``."""
        size = max(planned_bytes * scale, 1)
        raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, device=device)
        skip = (-raw.data_ptr()) % ALIGNMENT
        return cls(raw[skip : skip + size], scale)

    @property
    def nbytes(self) -> int:
        """The arena's size in bytes."""
        return self.data.numel()

    def typed(self, name: str, offset: int, planned: int, shape: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` at the plan's ``offset`` (``planned`` bytes
        reserved there); refuses a tensor that does not fit its reservation."""
        start, room = offset * self.scale, planned * self.scale
        numel = 1
        for dim in shape:
            numel *= dim
        size = numel * dtype.itemsize
        if size > room or start + size > self.nbytes:
            raise UserError(f"temp {name}: {size} bytes do not fit its {room}-byte slot at "
                            f"offset {start} of the {self.nbytes}-byte arena (recompile)")
        return self.data[start : start + size].view(dtype).view(shape)

    def poison(self, byte: int = 0xFF) -> None:
        """Fill the arena with ``byte`` (0xFF: NaN in every float dtype, -1 in integers)."""
        self.data.fill_(byte)


def _shape(value: Value, rows: int, symbols: Mapping[str, int] | None = None
           ) -> tuple[int, ...]:
    return tuple(eval_dim(d, rows, dict(symbols or {})) for d in value.type.shape)


def bind_temps(graph: Graph, rows: int, arena: Arena, compute: torch.dtype
               ) -> dict[str, torch.Tensor]:
    """Every temp of ``graph`` at bin ``rows``: arena tensors at the plan's offsets, views as
    strided views of their bases."""
    memory = graph.meta.get("memory")
    if not memory or str(rows) not in memory.get("bins", {}):
        raise UserError(f"the artifact has no memory plan for bin {rows} (compile it through "
                        f"the alias pass)")
    plan = memory["bins"][str(rows)]
    offsets, sizes = plan["offsets"], plan["sizes"]
    bound: dict[str, torch.Tensor] = {}
    temps = graph.values_of(Storage.TEMP)
    for value in temps:
        if value.view is not None:
            continue
        if value.name not in offsets:
            continue  # written by no node: nothing reads it either
        bound[value.name] = arena.typed(value.name, offsets[value.name], sizes[value.name],
                                        _shape(value, rows),
                                        storage_dtype(value.type.dtype, compute))

    def view_of(value: Value) -> torch.Tensor:
        found = bound.get(value.name)
        if found is not None:
            return found
        assert value.view is not None
        base = graph.values[value.view.base]
        if base.view is None and base.name not in bound:
            raise UserError(f"temp {value.name} views {base.name}, which has no memory")
        if value.view.groups != 1:  # not a strided view: a buffer of its own, refreshed
            tensor = torch.empty(_shape(value, rows), dtype=storage_dtype(value.type.dtype,
                                                                          compute),
                                 device=arena.data.device)
        else:
            tensor = read_view(view_of(base), value.view)
        bound[value.name] = tensor
        return tensor

    for value in temps:
        if value.view is not None:
            view_of(value)
    return bound


def regroup_launches(graph: Graph, bound: Mapping[str, torch.Tensor]
                     ) -> dict[str, list[Callable[[], None]]]:
    """For each value that has views of column groups: the copies that refresh those views'
    buffers from it (run right after the node that writes it)."""
    copies: dict[str, list[Callable[[], None]]] = {}
    for value in graph.values_of(Storage.TEMP):
        view = value.view
        if view is None or view.groups == 1 or value.name not in bound:
            continue
        target, base = bound[value.name], bound[view.base]

        def refresh(target: torch.Tensor = target, base: torch.Tensor = base,
                    view: View = view) -> None:
            target.copy_(read_view(base, view))

        copies.setdefault(view.base, []).append(refresh)
    return copies


def static_shapes(graph: Graph, storage: Storage, rows: int, symbols: Mapping[str, int],
                  compute: torch.dtype, names: Collection[str] | None = None
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every value of ``storage`` (``names`` only, when given) at
    ``rows`` rows."""
    return {
        value.name: (_shape(value, rows, symbols), storage_dtype(value.type.dtype, compute))
        for value in graph.values_of(storage) if names is None or value.name in names
    }


def static_buffers(graph: Graph, storage: Storage, rows: int, symbols: Mapping[str, int],
                   compute: torch.dtype, device: torch.device,
                   names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Zeroed buffers for every value of ``storage`` (outputs, kept temps; ``names`` only,
    when given) at ``rows`` rows."""
    shapes = static_shapes(graph, storage, rows, symbols, compute, names)
    return {name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()}


def bind_weights(graph: Graph, weights: Mapping[str, torch.Tensor], compute: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Every weight of ``graph`` from ``weights`` (by graph name, already packed), checked
    against its shape, moved to ``device`` in its run dtype."""
    bound = {}
    for value in graph.values_of(Storage.WEIGHT):
        if value.name not in weights:
            raise UserError(f"weight {value.name} is missing from the weights given")
        tensor = weights[value.name]
        expected = _shape(value, 1)
        if tuple(tensor.shape) != expected:
            raise UserError(f"weight {value.name}: expected shape {list(expected)}, found "
                            f"{list(tensor.shape)}")
        bound[value.name] = tensor.to(device=device,
                                      dtype=storage_dtype(value.type.dtype, compute))
    return bound


@dataclass
class Bindings:
    """The tensors of a step: persistent ones (weights, caches), static input and output
    buffers at the largest bin, and each bin's temps."""

    fixed: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    temps: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def for_bin(self, rows: int, inputs: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, Any]:
        """Name -> tensor for every value at bin ``rows``; ``inputs``: the input buffers
        to bind instead of :attr:`inputs` (another device block of them)."""
        bound: dict[str, Any] = dict(self.fixed)
        given = self.inputs if inputs is None else inputs
        bound.update({k: v[:rows] for k, v in given.items()})
        bound.update({k: v[:rows] for k, v in self.outputs.items()})
        bound.update(self.temps[rows])
        return bound
