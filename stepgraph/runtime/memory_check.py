"""Whether a compiled step fits the GPU before anything is allocated.

A K3 rank holds tens of GiB of weights: on a card too small for them the first sign would
be a CUDA out-of-memory traceback minutes into a load (or into a benchmark's weight draw).
:func:`step_memory` adds up what :func:`stepgraph.runtime.load` allocates that scales with
the model (the weights, the caches, the arena) from the graph alone, and
:func:`check_fits` turns a step that cannot fit the device's free memory into one line that
says by how much and what to change. It is a lower bound: kernels' workspaces and the CUDA
graphs' pool come on top, so a step close to the limit may still run out of memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage
from stepgraph.lower.caches import cache_layout
from stepgraph.lower.tensors import storage_dtype
from stepgraph.runtime.binding import arena_scale
from stepgraph.units import human_bytes


@dataclass(frozen=True)
class CacheExtent:
    """How the runtime sizes the caches: ``slots`` request state slots and ``blocks`` cache
    blocks of ``block_size`` tokens, ``width`` blocks a request; the caches hold one more
    slot and one more block, the scratch entries padded rows point at."""

    slots: int
    blocks: int
    block_size: int
    width: int

    @property
    def held_slots(self) -> int:
        """State slots the caches hold: the requests' and the scratch slot."""
        return self.slots + 1

    @property
    def held_blocks(self) -> int:
        """Cache blocks the caches hold: the requests' and the scratch block."""
        return self.blocks + 1


def cache_extent(requests: int, q: int, max_context: int, block_size: int) -> CacheExtent:
    """The caches of ``requests`` requests of ``q`` tokens a step and up to ``max_context``
    cached tokens each."""
    width = math.ceil(max_context / block_size)
    return CacheExtent(requests * q, requests * width, block_size, width)


@dataclass(frozen=True)
class StepMemory:
    """Bytes a loaded step holds on its device, by kind."""

    weights: int
    caches: int
    arena: int

    @property
    def total(self) -> int:
        """Everything together."""
        return self.weights + self.caches + self.arena

    def describe(self) -> str:
        """``weights 86.0 GiB + caches 1.2 GiB + arena 6.2 MiB``."""
        return (f"weights {human_bytes(self.weights)} + caches {human_bytes(self.caches)} + "
                f"arena {human_bytes(self.arena)}")


def step_memory(graph: Graph, compute: torch.dtype, extent: CacheExtent,
                weights: bool = True) -> StepMemory:
    """What loading ``graph`` (one rank's) in ``compute`` with caches of ``extent``
    allocates; ``weights=False`` leaves out the weights (already on the device)."""
    weight_bytes = 0
    if weights:
        for value in graph.values_of(Storage.WEIGHT):
            held = storage_dtype(value.type.dtype, compute)
            weight_bytes += value.type.numel(1) * held.itemsize
    layout = cache_layout(graph, extent.held_slots, extent.held_blocks, extent.block_size,
                          compute)
    cache_bytes = sum(math.prod(shape) * held.itemsize for shape, held in layout.values())
    arena = int(graph.meta.get("memory", {}).get("arena_bytes", 0)) * arena_scale(graph, compute)
    return StepMemory(weight_bytes, cache_bytes, arena)


WEIGHTS_REMEDY = ("the weights alone do not fit: shard them over more GPUs (compile with a "
                  "higher --tp or --dep) or use a GPU with more memory")


def check_fits(need: StepMemory, device: torch.device, remedy: str) -> None:
    """Refuse, in one line, a step that needs more than ``device``'s free memory (a no-op
    off CUDA); ``remedy`` says what the caller can change, unless the weights alone do not
    fit (then only sharding or a larger GPU helps: :data:`WEIGHTS_REMEDY`)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if need.total <= free:
        return
    if need.weights > free:
        remedy = WEIGHTS_REMEDY
    raise UserError(
        f"the step needs at least {human_bytes(need.total)} on {device} "
        f"({torch.cuda.get_device_name(device)}: {human_bytes(free)} free of "
        f"{human_bytes(total)}): {need.describe()}; {remedy}")
