"""What every reference op receives (:class:`OpCall`) and the numerics they share:
RMSNorm, the gated-MLP activations, projections and rotary embedding, in plain torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepgraph.ir.nodes import Node
from stepgraph.ir.types import TensorType


@dataclass
class OpCall:
    """One node to execute: its inputs (weights already in their run dtype, states as the
    caller's cache tensors, to be updated in place), the IR type and run dtype of each output,
    the compute dtype and the step's row count."""

    node: Node
    ins: list[torch.Tensor]
    out_types: list[TensorType]
    out_dtypes: list[torch.dtype]
    compute: torch.dtype
    rows: int

    @property
    def attrs(self) -> dict:
        """The node's attributes."""
        return self.node.attrs


OpFn = Callable[[OpCall], list[torch.Tensor]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (returns float32)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight.float()


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T``: in float32 when the output is float32 (router logits, lm_head),
    else in the output dtype."""
    if out_dtype == torch.float32:
        return F.linear(x.float(), weight.float())
    return F.linear(x.to(out_dtype), weight.to(out_dtype))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, attrs: dict) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` or SiTU ``b tanh(gate/b) sigmoid(gate) * bl tanh(up/bl)``
    (SiTU in float32, as K3 computes it); returns the dtype of ``gate``."""
    if attrs["activation"] == "situ":
        beta, beta_linear = float(attrs["beta"]), float(attrs["beta_linear"])
        g, u = gate.float(), up.float()
        bounded_up = beta_linear * torch.tanh(u / beta_linear)
        out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * bounded_up
        return out.to(gate.dtype)
    return F.silu(gate) * up


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Non-interleaved (rotate-half) rotary embedding of the last dim of ``x`` at
    ``positions`` (one per leading row; extra middle dims broadcast)."""
    dim = x.shape[-1]
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device=x.device)
    inv_freq = 1.0 / (theta ** (steps / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim,)
    cos, sin = emb.cos().view(shape).to(x.dtype), emb.sin().view(shape).to(x.dtype)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
