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


def allocate_caches(
    graph: Graph,
    slots: int,
    blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Caches:
    """Zeroed tensors for every state value of ``graph``: ``S`` = ``slots``, ``NB`` =
    ``blocks``, ``BS`` = ``block_size``; activation-dtype states are held in ``dtype``,
    float32 states (KDA recurrent state) stay float32."""
    symbols = {"S": slots, "NB": blocks, "BS": block_size}
    caches: Caches = {}
    for value in graph.values_of(Storage.STATE):
        shape = tuple(eval_dim(dim, 1, symbols) for dim in value.type.shape)
        caches[value.name] = torch.zeros(
            shape, dtype=storage_dtype(value.type.dtype, dtype), device=device
        )
    return caches


def reset_slots(graph: Graph, caches: Caches, slots: list[int]) -> None:
    """Zero the per-request states (those with an ``S`` leading dim) of ``slots``."""
    if not slots:
        return
    for value in graph.values_of(Storage.STATE):
        if value.type.shape and value.type.shape[0] == "S":
            tensor = caches[value.name]
            tensor[torch.tensor(slots, dtype=torch.long, device=tensor.device)] = 0
