"""Random weights for a benchmark, drawn on the device: a K3 slice holds tens of GB of
weights, which :func:`stepgraph.lower.weights.random_weights` would draw in float32 on the
host (minutes of GPU-machine time).

Small logical tensors (up to :data:`HOST_LIMIT` elements: norms, biases, router gates, conv
kernels) come from :class:`~stepgraph.lower.weights.RandomWeights`, so they are exactly those
of ``--weights random``, wherever the graph packs or splits them; larger ones (projections,
experts, the embedding) are drawn on the device with a generator seeded by (seed, logical
tensor name, expert): N(0, 1) for the embedding, N(0, 1 / fan_in) otherwise, the scale
RandomWeights uses. The values of a big tensor therefore differ from ``stepgraph run
--weights random``'s, but depend only on the seed and the logical tensor, like them: the pdl
and no-pdl compilations of one spec, and every rank's shard of a sharded plan, get the same
values as the unsharded graph (a rank holds its part of each logical tensor).
"""

from __future__ import annotations

import math
import zlib

import torch

from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage, eval_dim
from stepgraph.ir.values import Segment, Value
from stepgraph.lower.tensors import storage_dtype
from stepgraph.lower.weights import RandomWeights, Weights

HOST_LIMIT = 1 << 20


def _generator(device: torch.device, seed: int, key: str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF)
    return generator


def _normal(shape: tuple[int, ...], scale: float, generator: torch.Generator,
            device: torch.device, out: torch.Tensor) -> None:
    """Fill ``out`` (of ``shape``) with N(0, scale^2), drawn in float32 chunk by chunk."""
    flat = out.view(-1)
    chunk = 1 << 26
    for start in range(0, flat.numel(), chunk):
        stop = min(start + chunk, flat.numel())
        draw = torch.randn(stop - start, generator=generator, device=device)
        flat[start:stop] = (draw * scale).to(flat.dtype)


def _split_of(value: Value, segment: Segment):
    if segment.split is not None:
        return segment.split
    return value.split if len(value.segments) == 1 else None


def _fill_segment(value: Value, segment: Segment, target: torch.Tensor, seed: int,
                  rank: int, device: torch.device) -> None:
    """Fill ``target`` (the segment's rows of the packed weight): the rank's part of the
    segment's logical tensor, drawn on the host by RandomWeights when the logical tensor is
    small, on the device otherwise (a rule on the logical tensor, so that every graph that
    holds it, packed or not, split or not, gets the same values)."""
    source = segment.source
    assert source is not None
    split = _split_of(value, segment)
    shape = tuple(target.shape)
    full = list(shape)
    if split is not None:
        full[split.dim] *= split.ways
    if math.prod(full) <= HOST_LIMIT:
        logical = _host_logical(value, source, tuple(full), seed)
    elif split is None or split.ways == 1:
        _fill_logical(source, shape, target, seed, device)
        return
    else:
        logical = torch.empty(full, dtype=target.dtype, device=device)
        _fill_logical(source, tuple(full), logical, seed, device)
    if split is not None and split.ways > 1:
        logical = logical.chunk(split.ways, dim=split.dim)[rank % split.ways]
    target.copy_(logical)


def _host_logical(value: Value, source: str, shape: tuple[int, ...], seed: int
                  ) -> torch.Tensor:
    """A small logical tensor exactly as :class:`RandomWeights` (``--weights random``)
    draws it."""
    host = RandomWeights(seed)
    if "*" in source:
        prefix = source.split(".*.", 1)[0]
        parts = tuple(value.attrs.get("stacked", (source.rsplit(".", 1)[-1],)))
        return host.stacked(prefix, parts, shape, value.type.dtype)
    return host.tensor(source, shape, value.type.dtype)


def _fill_logical(source: str, shape: tuple[int, ...], out: torch.Tensor, seed: int,
                  device: torch.device) -> None:
    if "*" in source:  # stacked experts: one draw per expert
        for expert in range(shape[0]):
            gen = _generator(device, seed, f"{source}#{expert}")
            _normal(shape[1:], 1.0 / math.sqrt(shape[-1]), gen, device, out[expert])
        return
    gen = _generator(device, seed, source)
    scale = 1.0 if source == "embed_tokens" else 1.0 / math.sqrt(shape[-1])
    _normal(shape, scale, gen, device, out)


def device_random_weights(graph: Graph, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                          device: torch.device | str = "cuda", rank: int = 0) -> Weights:
    """Every weight value of ``graph`` (packed as the graph says) on ``device``; activation-
    dtype weights in ``dtype``, float32 ones in float32 (see the module docstring)."""
    device = torch.device(device)
    weights: Weights = {}
    for value in graph.values_of(Storage.WEIGHT):
        shape = tuple(eval_dim(d, 1) for d in value.type.shape)
        held = storage_dtype(value.type.dtype, dtype)
        tensor = torch.zeros(shape, dtype=held, device=device)  # padding segments stay zero
        for segment in value.segments:
            if segment.source is None:
                continue
            rows = tensor[segment.offset : segment.offset + segment.rows]
            _fill_segment(value, segment, rows, seed, rank, device)
        weights[value.name] = tensor
    return weights


def weight_bytes(weights: Weights) -> int:
    """Bytes held by ``weights``."""
    return sum(t.numel() * t.element_size() for t in weights.values())

