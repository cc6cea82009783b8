"""Caller-owned caches: one tensor per state value of a graph, sized by the caller.

State values carry symbolic dims the caller sizes: ``S`` request state slots (KDA recurrent
and conv states), ``NB`` cache blocks and ``BS`` tokens per block (the paged MLA/DSA latent
cache). The executor reads and updates these tensors in place; which slot or block a row
uses comes from the step inputs (``kda_state_indices``, ``block_tables``, ``slot_mapping``).
"""

from __future__ import annotations

import torch

from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage, eval_dim
from stepgraph.lower.tensors import storage_dtype

Caches = dict[str, torch.Tensor]


def cache_layout(
    graph: Graph, slots: int, blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each state value's tensor: ``S`` = ``slots``, ``NB`` =
    ``blocks``, ``BS`` = ``block_size``; activation-dtype states are held in ``dtype``,
    float32 states (KDA recurrent state) stay float32."""
    symbols = {"S": slots, "NB": blocks, "BS": block_size}
    return {value.name: (tuple(eval_dim(dim, 1, symbols) for dim in value.type.shape),
                         storage_dtype(value.type.dtype, dtype))
            for value in graph.values_of(Storage.STATE)}


def allocate_caches(
    graph: Graph,
    slots: int,
    blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Caches:
    """Zeroed tensors for every state value of ``graph``, laid out as :func:`cache_layout`
    says."""
    return {name: torch.zeros(shape, dtype=held, device=device)
            for name, (shape, held) in cache_layout(graph, slots, blocks, block_size,
                                                     dtype).items()}


def reset_slots(graph: Graph, caches: Caches, slots: list[int]) -> None:
    """Zero the per-request states (those with an ``S`` leading dim) of ``slots``."""
    if not slots:
        return
    for value in graph.values_of(Storage.STATE):
        if value.type.shape and value.type.shape[0] == "S":
            tensor = caches[value.name]
            tensor[torch.tensor(slots, dtype=torch.long, device=tensor.device)] = 0
