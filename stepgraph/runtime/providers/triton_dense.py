"""Triton providers of the dense ops: ``splitk`` for projection / o_proj (the split-K skinny
GEMM with the bin's tactic), ``triton`` for rmsnorm, add, attn_res_mix, attn_res_norm and
router.

Each factory binds the node's tensors once and returns the prepared launch (a callable that
enqueues the kernels, capturable); all kernels take PDL when ``ctx.pdl`` allows it. A
factory declines (``NotImplementedError``, the runtime then tries the next provider) what
its kernels do not handle: a sharded rmsnorm over several ranks, rows that are not contiguous
or wider than 32768. The kernels live in :mod:`stepgraph.runtime.kernels`.
"""

from __future__ import annotations

from stepgraph.runtime.kernels.elementwise import Add, AttnResMix, AttnResNorm, RmsNorm
from stepgraph.runtime.kernels.moe import Router
from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register


def _projection(ctx: PrepareContext) -> Launch:
    """``out = x @ W.T`` by the split-K skinny GEMM with the bin's tactic."""
    x, weight = ctx.inputs()
    (out,) = ctx.outputs()
    tactic = SplitKTactic.from_mapping(ctx.tactic, x.shape[0])
    return SplitKGemm(x, weight, out, tactic, pdl=ctx.pdl)


register("projection", "splitk", note="Triton split-K skinny GEMM, PDL")(_projection)
register("o_proj", "splitk", note="Triton split-K skinny GEMM, PDL")(_projection)


@register("rmsnorm", "triton", note="one program a row, PDL")
def rmsnorm(ctx: PrepareContext) -> Launch:
    """RMSNorm of each row (the sharded form only over one rank)."""
    ways = int(ctx.node.attrs.get("ways", 1))
    if ways != 1:
        raise NotImplementedError(f"node {ctx.node.name}: a sharded rmsnorm over {ways} "
                                  "ranks: the collectives module all-reduces its mean square")
    x, weight = ctx.inputs()
    (out,) = ctx.outputs()
    return RmsNorm(x, weight, out, ctx.node.attrs["eps"], pdl=ctx.pdl)


@register("add", "triton", note="sum of the operands in float32, PDL")
def add(ctx: PrepareContext) -> Launch:
    """The elementwise sum of the node's operands."""
    (out,) = ctx.outputs()
    return Add(ctx.inputs(), out, pdl=ctx.pdl)


@register("attn_res_mix", "triton", note="AttnRes softmax mix, one program a row, PDL")
def attn_res_mix(ctx: PrepareContext) -> Launch:
    """The AttnRes mix of the node's sources with its query and norm weights."""
    count = int(ctx.node.attrs["sources"])
    ins = ctx.inputs()
    (out,) = ctx.outputs()
    return AttnResMix(ins[:count], ins[count], ins[count + 1], out, ctx.node.attrs["eps"],
                      pdl=ctx.pdl)


@register("attn_res_norm", "triton",
          note="prefix sum + AttnRes mix + RMSNorm in one launch, one program a row, PDL")
def attn_res_norm(ctx: PrepareContext) -> Launch:
    """The fuse pass's node: prefix sum, AttnRes mix and RMSNorm in one kernel."""
    attrs = ctx.node.attrs
    count, deltas = int(attrs["sources"]), int(attrs["deltas"])
    ins = ctx.inputs()
    outs = ctx.outputs()
    query, mix_norm, weight = ins[count + deltas:]
    return AttnResNorm(ins[:count], ins[count:count + deltas], query, mix_norm, weight,
                       outs[0], outs[1] if deltas else None, attrs["eps"],
                       attrs["norm_eps"], pdl=ctx.pdl)


@register("router", "triton", note="scores + biased top-k + renormalise in one kernel, PDL")
def router(ctx: PrepareContext) -> Launch:
    """Top-k routing of each row's logits into (ids, weights)."""
    attrs = ctx.node.attrs
    ins = ctx.inputs()
    bias = ins[1] if attrs.get("correction_bias") else None
    ids, weights = ctx.outputs()
    return Router(ins[0], bias, ids, weights, top_k=int(attrs["top_k"]), score=attrs["score"],
                  renormalize=bool(attrs.get("renormalize")),
                  scaling=float(attrs.get("scaling_factor", 1.0)), pdl=ctx.pdl)
