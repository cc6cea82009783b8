"""Torch-side helpers shared by the reference executor, the caches and the weight loader:
IR dtype names -> torch dtypes, the compute-dtype policy and reading/writing View values."""

from __future__ import annotations

import torch

from stepgraph.errors import UserError
from stepgraph.ir.values import View

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}

COMPUTE_DTYPES = ("float32", "bfloat16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name."""
    return TORCH_DTYPES[name]


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` choice; a one-line error for anything else."""
    if name not in COMPUTE_DTYPES:
        raise UserError(f"--dtype {name!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    return TORCH_DTYPES[name]


def storage_dtype(ir_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype a value is held in when the step runs in ``compute``: float32 values stay
    float32 (gates, router, recurrent states), integer values keep their type, and every other
    floating value (the model's activation dtype) takes the compute dtype."""
    if ir_dtype in ("float32", "int32", "int64", "uint8"):
        return TORCH_DTYPES[ir_dtype]
    return compute


def read_view(base: torch.Tensor, view: View) -> torch.Tensor:
    """The columns ``view`` selects from ``base`` [R, width]: a plain slice, or the
    concatenation of ``[start:stop]`` from each of ``groups`` blocks of ``pitch`` columns."""
    if view.groups == 1:
        return base[:, view.start : view.stop]
    rows = base.shape[0]
    blocks = base.reshape(rows, view.groups, view.pitch)
    return blocks[..., view.start : view.stop].reshape(rows, -1)


def write_view(base: torch.Tensor, view: View, value: torch.Tensor) -> None:
    """Write ``value`` into the columns of ``base`` that ``view`` selects (in place)."""
    if view.groups == 1:
        base[:, view.start : view.stop] = value
        return
    rows = base.shape[0]
    blocks = base.view(rows, view.groups, view.pitch)
    blocks[..., view.start : view.stop] = value.reshape(rows, view.groups, -1)


def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda`` (refused with a one-line message where CUDA is absent)."""
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: choose cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(name)
