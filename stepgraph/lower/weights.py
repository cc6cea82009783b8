"""Weights for a graph: from a checkpoint or random, packed the way the graph says.

Every weight value of a graph lists ``segments``: row ranges each cut from a logical source
tensor (``source``, None for zero padding), of which a rank takes part ``rank % ways`` along
``split.dim`` when the segment is split. :func:`materialize` builds each value from a
:class:`WeightSource`: :class:`CheckpointWeights` (a Hugging Face-layout safetensors
checkpoint, see :mod:`stepgraph.lower.checkpoint`) or :class:`RandomWeights` (seeded, scaled
like a trained model). Stacked expert weights (segment source ``...experts.*.gate_proj``)
come from per-expert tensors or from a fused 3-D tensor, whichever the checkpoint stores.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Protocol

import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage, eval_dim
from stepgraph.ir.values import Segment, Value
from stepgraph.lower.checkpoint import (
    EXPERT_ALIASES,
    CheckpointReader,
    check_dtype,
    find,
    fit_shape,
    full_names,
    leaf_candidates,
)
from stepgraph.lower.tensors import storage_dtype, torch_dtype

Weights = dict[str, torch.Tensor]


class WeightSource(Protocol):
    """Where logical tensors come from."""

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """Logical weight ``name`` (full, unsplit) of ``shape``."""
        ...

    def stacked(self, prefix: str, parts: tuple[str, ...], shape: tuple[int, ...],
                dtype: str) -> torch.Tensor:
        """Experts ``prefix.{e}.{part}`` concatenated over ``parts`` and stacked over e."""
        ...


# ---------------------------------------------------------------------- checkpoints


class CheckpointWeights:
    """Logical tensors read from a Hugging Face-layout safetensors checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.reader = CheckpointReader(path)
        self.path = path
        config = self.reader.config.get("text_config", self.reader.config)
        kind = config.get("model_type")
        self.interleaved_rope = kind == "deepseek_v32" or (
            kind == "deepseek_v3" and config.get("rope_interleave", True))
        self.config = config

    def _missing(self, name: str) -> UserError:
        tried = [full_names(name, leaf)[0] for leaf in leaf_candidates(name)][:2]
        return UserError(f"weight {name}: missing from checkpoint {self.path} "
                         f"(looked for {' or '.join(tried)})")

    def _read(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        found = find(self.reader, name)
        if found is None:
            fused = self._from_fused_conv(name, shape, dtype)
            if fused is not None:
                return fused
            raise self._missing(name)
        tensor = self.reader.get(found)
        check_dtype(found, tensor, dtype)
        return fit_shape(found, tensor, shape).float()

    def _from_fused_conv(self, name: str, shape: tuple[int, ...], dtype: str
                         ) -> torch.Tensor | None:
        """q/k/v conv weights cut from the transformers layout's fused ``self_attn.conv1d``."""
        for index, part in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            if name.endswith(f".self_attn.{part}"):
                fused = name[: -len(part)] + "conv1d"
                found = find(self.reader, fused)
                if found is None:
                    return None
                tensor = self.reader.get(found)
                check_dtype(found, tensor, dtype)
                width = shape[0]
                if tensor.shape[0] != 3 * width:
                    raise UserError(f"tensor {found}: wrong shape: expected [{3 * width}, 1, "
                                    f"{shape[1]}] (q|k|v), found {list(tensor.shape)}")
                return fit_shape(found, tensor[index * width : (index + 1) * width], shape).float()
        return None

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """Logical weight ``name`` (DeepSeek's interleaved rope rows are de-interleaved, so the
        spec's non-interleaved rope computes the same q.k)."""
        tensor = self._read(name, shape, dtype)
        if self.interleaved_rope:
            tensor = self._deinterleave(name, tensor)
        return tensor

    def _deinterleave(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        rope = int(self.config.get("qk_rope_head_dim", 0))
        if not rope:
            return tensor
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if name.endswith(("self_attn.q_b_proj", "self_attn.q_proj")):
            heads = int(self.config["num_attention_heads"])
            nope = int(self.config["qk_nope_head_dim"])
            per_head = tensor.view(heads, nope + rope, -1)
            fixed = torch.cat([per_head[:, :nope], per_head[:, nope:][:, order]], dim=1)
            return fixed.reshape(tensor.shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa"):
            lora = int(self.config["kv_lora_rank"])
            return torch.cat([tensor[:lora], tensor[lora:][order]], dim=0)
        return tensor

    def stacked(self, prefix: str, parts: tuple[str, ...], shape: tuple[int, ...],
                dtype: str) -> torch.Tensor:
        """Experts from a fused ``prefix.gate_up_proj`` / ``prefix.down_proj`` tensor, else from
        per-expert ``prefix.{e}.gate_proj`` (or w1/w3/w2) tensors."""
        fused_name = f"{prefix}.{'_'.join(p.removesuffix('_proj') for p in parts)}_proj"
        if find(self.reader, fused_name) is not None:
            return self._read(fused_name, shape, dtype)
        experts = shape[0]
        rows = shape[1] // len(parts)
        per_expert = []
        for expert in range(experts):
            pieces = []
            for part in parts:
                pieces.append(self._expert_part(prefix, expert, part, (rows, *shape[2:]), dtype))
            per_expert.append(torch.cat(pieces, dim=0))
        return torch.stack(per_expert)

    def _expert_part(self, prefix: str, expert: int, part: str, shape: tuple[int, ...],
                     dtype: str) -> torch.Tensor:
        for alias in EXPERT_ALIASES.get(part, (part,)):
            name = f"{prefix}.{expert}.{alias}"
            if find(self.reader, name) is not None:
                return self._read(name, shape, dtype)
        raise self._missing(f"{prefix}.{expert}.{part}")


# ---------------------------------------------------------------------- random weights


class RandomWeights:
    """Seeded random weights scaled like a trained model: projections N(0, 1/fan_in), norms
    ~1, A_log = log U(1, 16), dt_bias = softplus^-1 of U(1e-3, 1e-1) in log space (the FLA
    init), small correction biases. Each logical tensor depends only on the seed and its name,
    so packing and sharding never change the values."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def _generator(self, name: str) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()) & 0x7FFFFFFF)
        return generator

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A random logical tensor for weight ``name``."""
        gen = self._generator(name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        if leaf == "dt_bias":
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            dt = dt.clamp_min(1e-4)
            return dt + torch.log(-torch.expm1(-dt))
        if leaf in ("e_score_correction_bias", "k_norm_bias"):
            return 0.05 * torch.randn(shape, generator=gen)
        if "norm" in leaf or leaf.endswith("layernorm"):
            return 1.0 + 0.05 * torch.randn(shape, generator=gen)
        if name == "embed_tokens":
            return torch.randn(shape, generator=gen)
        fan_in = shape[-1] if len(shape) > 1 else shape[0]
        return torch.randn(shape, generator=gen) / math.sqrt(fan_in)

    def stacked(self, prefix: str, parts: tuple[str, ...], shape: tuple[int, ...],
                dtype: str) -> torch.Tensor:
        """Random stacked experts [E, rows, cols], N(0, 1/cols)."""
        name = f"{prefix}.{'_'.join(parts)}"
        return torch.randn(shape, generator=self._generator(name)) / math.sqrt(shape[-1])


# ---------------------------------------------------------------------- packing


def _segment_split(value: Value, segment: Segment):
    if segment.split is not None:
        return segment.split
    return value.split if len(value.segments) == 1 else None


def materialize(
    graph: Graph,
    source: WeightSource,
    rank: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Weights:
    """Every weight value of ``graph`` for ``rank``, filled segment by segment from
    ``source`` (zero padding where a segment has no source). Activation-dtype weights are
    held in ``dtype`` (default: the graph's dtype); float32 weights stay float32."""
    weights: Weights = {}
    for value in graph.values_of(Storage.WEIGHT):
        shape = tuple(eval_dim(d, 1) for d in value.type.shape)
        held = storage_dtype(value.type.dtype, dtype) if dtype else torch_dtype(value.type.dtype)
        packed = torch.zeros(shape, dtype=torch.float32)
        for segment in value.segments:
            if segment.source is None:
                continue
            split = _segment_split(value, segment)
            full = [segment.rows, *shape[1:]]
            if split is not None:
                full[split.dim] *= split.ways
            if "*" in segment.source:
                prefix = segment.source.split(".*.", 1)[0]
                parts = tuple(value.attrs.get("stacked", (segment.source.rsplit(".", 1)[-1],)))
                logical = source.stacked(prefix, parts, tuple(full), value.type.dtype)
            else:
                logical = source.tensor(segment.source, tuple(full), value.type.dtype)
            if split is not None:
                logical = logical.chunk(split.ways, dim=split.dim)[rank % split.ways]
            packed[segment.offset : segment.offset + segment.rows] = logical
        weights[value.name] = packed.to(device=device, dtype=held)
    return weights


def load_weights(graph: Graph, path: str | Path, rank: int = 0, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> Weights:
    """The weights of ``graph`` from the safetensors checkpoint at ``path``."""
    return materialize(graph, CheckpointWeights(path), rank, dtype, device)


def random_weights(graph: Graph, seed: int = 0, rank: int = 0, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> Weights:
    """Seeded random weights for ``graph`` (see :class:`RandomWeights`)."""
    return materialize(graph, RandomWeights(seed), rank, dtype, device)
