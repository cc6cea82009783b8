"""Read Hugging Face-layout safetensors checkpoints (one file, or shards listed by
``model.safetensors.index.json``) and map their tensor names to the graph's logical names.

Never unpickles: ``.bin`` / ``.pt`` checkpoints are refused. Logical names are the frontend's
(``layers.3.self_attn.q_proj``); a checkpoint may spell them in the transformers layout
(``model.layers.3.self_attn.q_proj.weight``, ``self_attn.forget_gate.A_log``, a fused
``self_attn.conv1d`` over q|k|v, fused ``mlp.experts.gate_up_proj``), the original Moonshot
layout (``self_attn.q_conv1d``, ``block_sparse_moe.experts.{e}.w1``), or K3's
(``language_model.model.layers...``, ``self_attention_res_proj``, ``output_attn_res_norm``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stepgraph.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
MODEL_PREFIXES = ("model.", "", "language_model.model.", "model.language_model.")
HEAD_PREFIXES = ("", "language_model.", "model.")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# logical leaf -> checkpoint leaf (without the model prefix and the ".weight" suffix rules)
_GLOBAL = {
    "final_res.query": ("output_attn_res_proj.weight",),
    "final_res.norm": ("output_attn_res_norm.weight",),
}
_LAYER_RENAMES = (
    ("attn_res.query", "self_attention_res_proj"),
    ("attn_res.norm", "self_attention_res_norm"),
    ("mlp_res.query", "mlp_res_proj"),
    ("mlp_res.norm", "mlp_res_norm"),
    ("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj"),
    ("self_attn.f_b_proj", "self_attn.forget_gate.f_b_proj"),
    ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
    ("self_attn.A_log", "self_attn.forget_gate.A_log"),
    ("self_attn.indexer.k_norm_bias", "self_attn.indexer.k_norm.bias"),
)
EXPERT_ALIASES = {"gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3"),
                  "down_proj": ("down_proj", "w2")}


class CheckpointReader:
    """The tensors of a safetensors checkpoint directory (or single file), read lazily."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.path = Path(path)
        self.where: dict[str, Path] = {}
        if self.path.is_file():
            files = [self.path]
            folder = self.path.parent
        elif self.path.is_dir():
            folder = self.path
            index = self.path / INDEX_FILE
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                except (ValueError, KeyError, TypeError):
                    raise UserError(f"{index}: not a safetensors index (no weight_map)") from None
                for name, file in weight_map.items():
                    self.where[name] = folder / file
                files = []
            else:
                files = sorted(self.path.glob("*.safetensors"))
        else:
            raise UserError(f"--weights {path}: no such checkpoint directory or file")
        if not files and not self.where:
            pickled = sorted(p.name for p in folder.glob("*")
                             if p.suffix in (".bin", ".pt", ".pth"))
            hint = (f" ({pickled[0]} is a pickle checkpoint; stepgraph never unpickles: convert it "
                    "to safetensors)") if pickled else ""
            raise UserError(f"{path}: no *.safetensors files{hint}")
        for file in files:
            with self._open_file(file) as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    self.where[name] = file
        self._handles: dict[Path, Any] = {}
        config = folder / "config.json"
        self.config: dict[str, Any] = {}
        if config.is_file():
            try:
                self.config = json.loads(config.read_text(encoding="utf-8"))
            except ValueError:
                raise UserError(f"{config}: not valid JSON") from None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self) -> Iterator[str]:
        """Every tensor name."""
        return iter(self.where)

    def get(self, name: str) -> torch.Tensor:
        """The tensor called ``name``."""
        file = self.where[name]
        if not file.is_file():
            raise UserError(f"tensor {name}: its shard {file} is missing")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._open_file(file)
            self._handles[file] = handle
        return handle.get_tensor(name)

    def _open_file(self, file: Path) -> Any:
        """``safe_open`` of one file; a one-line error when it is not a safetensors file."""
        from safetensors import SafetensorError

        try:
            return self._open(str(file), framework="pt")
        except (SafetensorError, OSError) as error:
            raise UserError(f"{file}: not a readable safetensors file ({error}); save the "
                            "checkpoint again, or point --weights at another") from None


def leaf_candidates(logical: str) -> list[str]:
    """Checkpoint names (without the model prefix) that may hold logical weight ``logical``."""
    if logical in _GLOBAL:
        return list(_GLOBAL[logical])
    if not logical.startswith("layers."):
        return [f"{logical}.weight", logical]
    parts = logical.split(".", 2)
    head, rest = f"{parts[0]}.{parts[1]}", parts[2]
    bodies = [rest]
    for old, new in _LAYER_RENAMES:
        if rest == old:
            bodies.append(new)
    if rest.startswith("mlp."):
        bodies += [f"block_sparse_moe.{b[4:]}" for b in list(bodies)]
    names = []
    for body in bodies:
        names += [f"{head}.{body}.weight", f"{head}.{body}"]
    return names


def full_names(logical: str, leaf: str) -> list[str]:
    """``leaf`` under every model prefix a checkpoint may use."""
    prefixes = HEAD_PREFIXES if logical == "lm_head" else MODEL_PREFIXES
    return [f"{prefix}{leaf}" for prefix in prefixes]


def find(reader: CheckpointReader, logical: str) -> str | None:
    """The checkpoint name holding logical weight ``logical`` (None if absent)."""
    for leaf in leaf_candidates(logical):
        for name in full_names(logical, leaf):
            if name in reader:
                return name
    return None


def check_dtype(name: str, tensor: torch.Tensor, expected: str) -> None:
    """Refuse a non-float (quantized, integer, fp8) tensor with a one-line message."""
    if tensor.dtype not in FLOAT_DTYPES:
        found = str(tensor.dtype).removeprefix("torch.")
        raise UserError(f"tensor {name}: wrong dtype: expected {expected} (or another of "
                        f"float32/bfloat16/float16), found {found}")


def fit_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` as ``shape`` when only singleton dims differ (conv [W,1,K] -> [W,K],
    A_log [1,1,H,1] -> [H], AttnRes proj [1,H] -> [H]); K3's A_log padded with zeros past the
    head count is cut; anything else is a one-line error."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if tensor.numel() == _numel(shape) and [d for d in tensor.shape if d != 1] == [
            d for d in shape if d != 1]:
        return tensor.reshape(shape)
    flat = tensor.reshape(-1)
    if (len(shape) == 1 and name.endswith("A_log") and flat.numel() > shape[0]
            and bool((flat[shape[0]:] == 0).all())):
        return flat[: shape[0]].clone()
    raise UserError(f"tensor {name}: wrong shape: expected {list(shape)}, "
                    f"found {list(tensor.shape)}")


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
