"""The gated activation (shared with the routed-experts kernels: :func:`gated_act`) and, for a
gated MLP, as one Triton kernel: ``act = f(gate, up)`` from the
[gate | up] rows of the first matmul, SiTU (``b tanh(g/b) sigmoid(g) * bl tanh(u/bl)``) or
SwiGLU (``silu(g) * up``), computed in float32 and stored in the output's dtype.

It replaces the handful of torch elementwise launches (casts, tanh, sigmoid, products) the
plain torch path takes per MLP. Between two cuBLAS matmuls (which never trigger dependents)
it is launched without PDL; between two split-K GEMMs with PDL (``pdl=True``: it waits on
griddepcontrol before reading and triggers its dependents, per the contract of
:mod:`stepgraph.runtime.kernels.launch_utils`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepgraph.runtime.kernels.launch_utils import pdl_allowed

BLOCK = 1024


@triton.jit
def tanh_f32(x):
    """tanh in float32 from the sigmoid, with a Taylor step near 0 (no cancellation)."""
    small = tl.abs(x) < 0.01
    return tl.where(small, x * (1.0 - x * x * (1.0 / 3.0)), 2.0 * tl.sigmoid(2.0 * x) - 1.0)


@triton.jit
def gated_act(g, u, beta, beta_linear, ACT: tl.constexpr):
    """SiTU ``b tanh(g/b) sigmoid(g) * bl tanh(u/bl)`` (ACT 1) or SiLU ``silu(g) * u``
    (ACT 0), in float32."""
    if ACT == 1:
        gate = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        return gate * (beta_linear * tanh_f32(u / beta_linear))
    return g * tl.sigmoid(g) * u


@triton.jit
def _gated_act_kernel(h_ptr, out_ptr, width, stride_h, stride_o, beta, beta_linear,
                      ACT: tl.constexpr, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < width
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + width + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    act = gated_act(gate, up, beta, beta_linear, ACT)
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation(h: torch.Tensor, out: torch.Tensor, attrs: dict, pdl: bool = False
                     ) -> None:
    """Write ``f(h[:, :W], h[:, W:])`` into ``out`` [R, W] (rows with a unit column stride);
    ``pdl``: launched with programmatic dependent launch where the device allows it."""
    rows, width = out.shape
    if h.shape != (rows, 2 * width) or h.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"gated activation of {list(h.shape)} into {list(out.shape)}: "
                         "rows of [gate | up] with unit column stride expected")
    situ = int(attrs["activation"] == "situ")
    beta = float(attrs.get("beta", 1.0))
    beta_linear = float(attrs.get("beta_linear", 1.0))
    grid = (rows, triton.cdiv(width, BLOCK))
    pdl = pdl_allowed(pdl, out.device)
    _gated_act_kernel[grid](h, out, width, h.stride(0), out.stride(0), beta, beta_linear,
                            ACT=situ, BLOCK_W=BLOCK, USE_PDL=pdl, launch_pdl=pdl)
