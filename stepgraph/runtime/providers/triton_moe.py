"""The ``triton_fused_moe`` provider of ``routed_experts``: grouped Triton launches over the
experts the rows selected (gather by expert id in the kernel, SiTU/SiLU fused into the
gate_up epilogue, routing weights in the down epilogue, a deterministic combine). See
:mod:`stepgraph.runtime.kernels.moe`.

Experts held here are ``[expert_offset, expert_offset + local_experts)`` (attrs; the runtime
sets ``expert_offset`` per rank); ids outside contribute nothing, as in the reference.
The factory declines (``NotImplementedError``) more than 512 rows or expert weights not
contiguous in their last dim. An optional tactic (``block_m``, ``block_n_gate_up``,
``block_n_down``, ``block_k``, ``stages``, ``warps``) overrides the default block sizes.
"""

from __future__ import annotations

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.moe import MoeTactic, RoutedExperts
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register


@register("routed_experts", "triton_fused_moe", note="grouped gather-by-expert GEMMs, PDL")
def routed_experts(ctx: PrepareContext) -> Launch:
    """The node's local experts over the rows routed to them, weighted and summed (with the
    fuse pass's ``slots``, weighted into ``[R, k, W]`` for the consumer to sum)."""
    attrs = ctx.node.attrs
    x, ids, weights, gate_up, down = ctx.inputs()
    (out,) = ctx.outputs()
    local = int(attrs["local_experts"])
    if gate_up.shape[0] != local or gate_up.shape[1] != 2 * int(attrs["width"]):
        raise UserError(f"node {ctx.node.name}: gate_up {list(gate_up.shape)} does not hold "
                        f"{local} experts of width {attrs['width']}")
    return RoutedExperts(
        x, ids, weights, gate_up, down, out, activation=attrs["activation"],
        beta=float(attrs.get("beta", 1.0)), beta_linear=float(attrs.get("beta_linear", 1.0)),
        expert_offset=int(attrs.get("expert_offset", 0)),
        tactic=MoeTactic.from_mapping(ctx.tactic), pdl=ctx.pdl,
        slots=bool(attrs.get("slots")))
