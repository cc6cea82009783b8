"""Triton providers of the dense ops: ``splitk`` for projection / o_proj (the split-K skinny
GEMM with the bin's tactic, with the fuse pass's input norm) and for
the gated MLPs (shared_expert, dense_mlp: two split-K GEMMs around the gated activation,
all with PDL), ``triton`` for embed, rmsnorm, add, attn_res_mix, attn_res_norm and router.

Each factory binds the node's tensors once and returns the prepared launch (a callable that
enqueues the kernels, capturable); all kernels take PDL when ``ctx.pdl`` allows it. A
factory declines (``NotImplementedError``, the runtime then tries the next provider) what
its kernels do not handle: a sharded rmsnorm over several ranks, rows that are not contiguous
or wider than 32768. The kernels live in :mod:`stepgraph.runtime.kernels`.
"""

from __future__ import annotations

from dataclasses import replace

from stepgraph.runtime.kernels.activation import gated_activation
from stepgraph.runtime.kernels.elementwise import Add, AttnResMix, AttnResNorm, Embed, RmsNorm
from stepgraph.runtime.kernels.launch_utils import scratch
from stepgraph.runtime.kernels.routing import Router
from stepgraph.runtime.kernels.splitk_gemm import InputNorm, SplitKGemm, SplitKTactic
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register
from stepgraph.runtime.providers.torch_ops import input_combine_dtype, input_norm_dtype


def _projection(ctx: PrepareContext) -> Launch:
    """``out = x @ W.T`` by the split-K skinny GEMM with the bin's tactic (of the rows'
    RMSNorm when the fuse pass gave the node an input norm; x the sum of the routed experts'
    slots when it gave the node their combine)."""
    x, weight = ctx.inputs()[:2]
    (out,) = ctx.outputs()
    tactic = SplitKTactic.from_mapping(ctx.tactic, x.shape[0])
    attrs = ctx.node.attrs
    norm = (InputNorm(ctx.inputs()[2], float(attrs["input_norm_eps"]),
                      input_norm_dtype(attrs, weight)) if "input_norm_eps" in attrs else None)
    return SplitKGemm(x, weight, out, tactic, pdl=ctx.pdl, norm=norm,
                      combine=input_combine_dtype(attrs, weight))


register("projection", "splitk", note="Triton split-K skinny GEMM, PDL")(_projection)
register("o_proj", "splitk", note="Triton split-K skinny GEMM, PDL")(_projection)
register("lm_head", "splitk", note="Triton split-K skinny GEMM, PDL")(_projection)


def down_tactic(up: SplitKTactic, up_k: int, down_k: int) -> SplitKTactic:
    """The down GEMM's tactic from the gate_up GEMM's (the table holds gate_up's shape): the
    same tiles and stages, the K splits scaled by ``down_k / up_k`` (at least one)."""
    return replace(up, split=max(1, round(up.split * down_k / up_k)))


def _gated_mlp(ctx: PrepareContext) -> Launch:
    """``act(x @ gate_up.T) @ down.T``: split-K gate_up with the bin's tactic, the gated
    activation, split-K down, all with PDL; the two intermediates live in shared,
    stream-ordered scratch buffers."""
    x, gate_up, down = ctx.inputs()
    (out,) = ctx.outputs()
    if not x.dtype == gate_up.dtype == down.dtype == out.dtype:
        raise NotImplementedError(f"node {ctx.node.name}: mixed dtypes (the cuBLAS path takes "
                                  "them)")
    rows, width = x.shape[0], int(ctx.node.attrs["width"])
    up = SplitKTactic.from_mapping(ctx.tactic, rows)
    h = scratch(x.device, "gated_mlp_h", rows * 2 * width, x.dtype).view(rows, 2 * width)
    act = scratch(x.device, "gated_mlp_act", rows * width, x.dtype).view(rows, width)
    first = SplitKGemm(x, gate_up, h, up, pdl=ctx.pdl)
    second = SplitKGemm(act, down, out, down_tactic(up, x.shape[1], width), pdl=ctx.pdl)
    attrs = dict(ctx.node.attrs)

    def launch() -> None:
        first()
        gated_activation(h, act, attrs, pdl=ctx.pdl)
        second()

    return launch


for _op in ("shared_expert", "dense_mlp"):
    register(_op, "splitk", note="split-K gate_up, gated activation, split-K down; PDL")(
        _gated_mlp)


@register("embed", "triton", note="gather of the tokens' rows, PDL (its dependents launch at once)")
def embed(ctx: PrepareContext) -> Launch:
    """Rows of the embedding table for the step's tokens (one rank's whole table; the
    vocab-split form is the collectives module's)."""
    if int(ctx.node.attrs.get("vocab_split", {}).get("ways", 1)) > 1:
        raise NotImplementedError(f"node {ctx.node.name}: a vocab-split embedding (the "
                                  "collectives module masks and all-reduces it)")
    tokens, table = ctx.inputs()
    (out,) = ctx.outputs()
    return Embed(tokens, table, out, pdl=ctx.pdl)


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
    """The fuse pass's node: prefix sum, AttnRes mix and RMSNorm in one kernel; the sources
    load before the PDL wait when the pdl pass marks them all readable there; with the
    context's ``wait_flag`` (a signalled side-stream branch) it waits on that flag."""
    attrs = ctx.node.attrs
    count, deltas = int(attrs["sources"]), int(attrs["deltas"])
    ins = ctx.inputs()
    outs = ctx.outputs()
    query, mix_norm, weight = ins[count + deltas:]
    early = all(name in ctx.pre_wait for name in ctx.node.inputs[:count])
    return AttnResNorm(ins[:count], ins[count:count + deltas], query, mix_norm, weight,
                       outs[0], outs[1] if deltas else None, attrs["eps"],
                       attrs["norm_eps"], pdl=ctx.pdl, pre_sources=early,
                       wait=getattr(ctx, "wait_flag", None))


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
