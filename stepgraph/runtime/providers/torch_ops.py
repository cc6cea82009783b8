"""The torch baseline providers: ``torch`` for every op of a world-of-one plan, ``cublas`` for
the dense matmul ops (projection, o_proj, lm_head, shared_expert, dense_mlp).

Every launch writes its outputs in place into the bound output tensors and is capturable in a
CUDA graph: no host synchronization, no shape or allocation that depends on data. Where the
reference op (``stepgraph.lower.ref_*``) already is capturable, the launch runs it and copies
the result into the outputs, so the numerics are the reference's. The stateful and routed ops
are rewritten capturably with the reference's math:

* ``kda_core``: the state slots are gathered (``index_select``) and scattered back
  (``index_copy_``); a negative slot is the caches' scratch slot (the last one), which reads
  zeros, so padded rows compute what the reference computes for them;
* ``mla_core`` / ``dsa_core``: the new latent is written at ``slot_mapping`` (a negative slot
  writes into the scratch block, the cache's last block, never a real one); attention runs
  over the whole block table (``T x BS`` tokens) masked by ``seq_lens``;
* ``routed_experts``: every local expert runs on every row (two batched matmuls) and each row
  sums its experts weighted by the router (zero for experts it did not pick): correct for any
  routing, slow; the Triton provider is the fast one.

The collectives, the vocab-parallel embedding and the sharded RMSNorm live in
:mod:`stepgraph.runtime.providers.collectives`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from stepgraph.errors import UserError
from stepgraph.ir.types import TensorType
from stepgraph.lower import ref_dense, ref_mla
from stepgraph.lower.ref_common import OpCall, OpFn, gated_activation, linear, rms_norm, rope
from stepgraph.lower.ref_kda import decay_gate, kda_token
from stepgraph.lower.tensors import storage_dtype
from stepgraph.runtime.providers.collectives import sharded_rmsnorm, vocab_parallel_embed
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register

BOTH = ("cuda", "cpu")
MULTI_RANK = ("the torch provider runs it on one rank only (the collectives module runs it "
              "over several)")

_IR_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}


# ---------------------------------------------------------------------- helpers


def check_one_rank(node: Any) -> None:
    """Refuse a node whose computation spans ranks (a grouped op, a vocab-split embedding):
    those run through :mod:`stepgraph.runtime.providers.collectives`. An expert-split node
    computes its local experts only (the loader sets each rank's ``expert_offset``)."""
    attrs = node.attrs
    ways = [attrs.get("ways", 1)]
    if isinstance(attrs.get("vocab_split"), dict):
        ways.append(attrs["vocab_split"].get("ways", 1))
    if max(int(w) for w in ways) > 1:
        raise UserError(f"node {node.name} ({node.op} over {max(ways)} ranks): {MULTI_RANK}")


def compute_dtype_of(ctx: PrepareContext) -> torch.dtype:
    """The step's compute dtype: ``ctx.dtype`` when the context has one, else the first
    floating output's dtype."""
    dtype = getattr(ctx, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for out in ctx.outputs():
        if out.is_floating_point():
            return out.dtype
    return torch.float32


def op_call(ctx: PrepareContext) -> OpCall:
    """The reference :class:`OpCall` of the context's node over its bound tensors."""
    outs = ctx.outputs()
    return OpCall(
        node=ctx.node,
        ins=list(ctx.inputs()),
        out_types=[TensorType(tuple(o.shape), _IR_DTYPES[o.dtype]) for o in outs],
        out_dtypes=[o.dtype for o in outs],
        compute=compute_dtype_of(ctx),
        rows=ctx.rows,
    )


def reference_launch(ctx: PrepareContext, fn: OpFn) -> Launch:
    """A launch that runs the reference op ``fn`` and copies its results into the outputs."""
    call = op_call(ctx)
    outs = ctx.outputs()

    def launch() -> None:
        for out, result in zip(outs, fn(call), strict=True):
            out.copy_(result)

    return launch


def _reference(fn: OpFn) -> Callable[[PrepareContext], Launch]:
    def factory(ctx: PrepareContext) -> Launch:
        if ctx.node.op == "rmsnorm" and int(ctx.node.attrs.get("ways", 1)) > 1:
            return sharded_rmsnorm(ctx)
        check_one_rank(ctx.node)
        return reference_launch(ctx, fn)

    factory.__doc__ = f"The reference {fn.__name__} into the bound outputs."
    return factory


for _op, _fn in (
    ("rmsnorm", ref_dense.rmsnorm),
    ("attn_res_mix", ref_dense.attn_res_mix),
    ("attn_res_norm", ref_dense.attn_res_norm),
    ("projection", ref_dense.projection),
    ("o_proj", ref_dense.projection),
    ("lm_head", ref_dense.projection),
    ("router", ref_dense.router),
    ("shared_expert", ref_dense.gated_mlp),
    ("dense_mlp", ref_dense.gated_mlp),
    ("mla_query", ref_mla.mla_query),
    ("mla_value", ref_mla.mla_value),
):
    register(_op, "torch", BOTH, note="the reference op, copied into the bound outputs")(
        _reference(_fn))


# ---------------------------------------------------------------------- simple ops


@register("embed", "torch", BOTH)
def embed(ctx: PrepareContext) -> Launch:
    """Rows of the embedding table (``index_select`` straight into the output); this rank's
    part of the vocabulary when the table is split."""
    if int(ctx.node.attrs.get("vocab_split", {}).get("ways", 1)) > 1:
        return vocab_parallel_embed(ctx)
    check_one_rank(ctx.node)
    tokens, table = ctx.inputs()
    (out,) = ctx.outputs()
    if out.dtype != table.dtype or not out.is_contiguous():
        return reference_launch(ctx, ref_dense.embed)
    return lambda: torch.index_select(table, 0, tokens, out=out)


@register("add", "torch", BOTH)
def add(ctx: PrepareContext) -> Launch:
    """Elementwise sum of the operands into the output."""
    check_one_rank(ctx.node)
    ins = ctx.inputs()
    (out,) = ctx.outputs()
    if any(t.dtype != out.dtype for t in ins) or not out.is_contiguous():
        return reference_launch(ctx, ref_dense.add)
    first, second, rest = ins[0], ins[1], ins[2:]

    def launch() -> None:
        torch.add(first, second, out=out)
        for other in rest:
            out.add_(other)

    return launch


@register("prefetch", "torch", BOTH, note="no L2 prefetch: a no-op")
def prefetch(ctx: PrepareContext) -> Launch:
    """An L2 prefetch has no numerical effect: nothing is launched."""
    return lambda: None


# ---------------------------------------------------------------------- cuBLAS matmuls


def _mixed_mm(x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``torch.mm(x, wt, out_dtype=out.dtype, out=out)`` (BF16 in, FP32 out, cuBLAS
    accumulating in FP32) works here; it computes once to find out."""
    if x.device.type != "cuda" or not out.is_contiguous():
        return False
    try:
        torch.mm(x, wt, out_dtype=out.dtype, out=out)
    except (RuntimeError, TypeError):
        return False
    return True


def matmul_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  fallback: Callable[[], torch.Tensor]) -> Launch:
    """``out = x @ w.T`` through cuBLAS (``out=`` when dtypes agree, FP32 output of BF16
    operands through ``out_dtype``), else ``fallback()`` copied into ``out``."""
    wt = w.t()
    if x.dtype == w.dtype == out.dtype and out.is_contiguous():
        return lambda: torch.matmul(x, wt, out=out)
    if x.dtype == w.dtype and out.dtype == torch.float32 and _mixed_mm(x, wt, out):
        return lambda: torch.mm(x, wt, out_dtype=out.dtype, out=out)
    return lambda: out.copy_(fallback())


def input_norm_dtype(attrs: dict[str, Any], weight: torch.Tensor) -> torch.dtype:
    """The dtype a projection's fused input norm rounds to in this run: the unfused norm's
    output dtype as the run holds it (the model's activation dtype takes the run's compute
    dtype, which the projection's ``weight`` is bound in)."""
    return storage_dtype(attrs["input_norm_dtype"], weight.dtype)


def input_combine_dtype(attrs: dict[str, Any], weight: torch.Tensor) -> torch.dtype | None:
    """The dtype a projection's fused input combine (the routed experts' slot sum) stores the
    summed rows in this run, or None without one."""
    if "input_combine_top_k" not in attrs:
        return None
    return storage_dtype(attrs["input_combine_dtype"], weight.dtype)


def input_norm_launch(ctx: PrepareContext, x: torch.Tensor, weight: torch.Tensor
                      ) -> tuple[torch.Tensor, Launch]:
    """A projection's input norm (the fuse pass's ``input_norm_eps``) into a buffer of its
    own: the rows the product then reads, and the launch writing them (the Triton RMSNorm
    kernel on a GPU, the reference's torch ops elsewhere)."""
    attrs = ctx.node.attrs
    eps = float(attrs["input_norm_eps"])
    normed = torch.empty(x.shape, dtype=input_norm_dtype(attrs, ctx.inputs()[1]),
                         device=x.device)
    if x.device.type == "cuda":
        try:
            from stepgraph.runtime.kernels.elementwise import RmsNorm
        except ImportError:  # no triton: the torch ops below
            pass
        else:
            return normed, RmsNorm(x, weight, normed, eps, pdl=ctx.pdl)
    return normed, lambda: normed.copy_(rms_norm(x, weight, eps))


def _cublas_projection(ctx: PrepareContext) -> Launch:
    check_one_rank(ctx.node)
    x, w = ctx.inputs()[:2]
    (out,) = ctx.outputs()
    before: list[Launch] = []
    combine = input_combine_dtype(ctx.node.attrs, w)
    if combine is not None:
        slots, x = x, torch.empty(x.shape[0], x.shape[2], dtype=combine, device=x.device)
        before.append(lambda s=slots, d=x: d.copy_(ref_dense.combined_slots(s, d.dtype)))
    if "input_norm_eps" in ctx.node.attrs:
        x, norm_launch = input_norm_launch(ctx, x, ctx.inputs()[2])
        before.append(norm_launch)
    product = matmul_launch(x, w, out, lambda r=x: linear(r, w, out.dtype))
    if not before:
        return product

    def launch() -> None:
        for step in before:
            step()
        product()

    return launch


for _op in ("projection", "o_proj", "lm_head"):
    register(_op, "cublas", BOTH, note="torch.matmul into the output (cuBLAS on GPU)")(
        _cublas_projection)


def _cublas_gated_mlp(ctx: PrepareContext) -> Launch:
    check_one_rank(ctx.node)
    x, gate_up, down = ctx.inputs()
    (out,) = ctx.outputs()
    if not (x.dtype == gate_up.dtype == down.dtype == out.dtype):
        return reference_launch(ctx, ref_dense.gated_mlp)
    width, attrs = ctx.node.attrs["width"], ctx.node.attrs
    direct = out.is_contiguous()
    fused = fused_activation(x.device)

    def launch() -> None:
        h = torch.matmul(x, gate_up.t())
        if fused is not None:
            act = torch.empty((h.shape[0], width), dtype=h.dtype, device=h.device)
            fused(h, act, attrs)
        else:
            act = gated_activation(h[:, :width], h[:, width:], attrs)
        if direct:
            torch.matmul(act, down.t(), out=out)
        else:
            out.copy_(torch.matmul(act, down.t()))

    return launch


def fused_activation(device: torch.device):
    """The one-kernel Triton gated activation on a CUDA device where triton imports (None:
    the torch elementwise path)."""
    if device.type != "cuda":
        return None
    try:
        from stepgraph.runtime.kernels.activation import gated_activation as kernel
    except ImportError:
        return None
    return kernel


for _op in ("shared_expert", "dense_mlp"):
    register(_op, "cublas", BOTH, note="two torch.matmul (cuBLAS on GPU) around the activation")(
        _cublas_gated_mlp)


# ---------------------------------------------------------------------- routed experts


@register("routed_experts", "torch", BOTH, note="every local expert on every row (slow)")
def routed_experts(ctx: PrepareContext) -> Launch:
    """Each row's top-k experts, weighted and summed: every local expert runs on every row
    (batched matmuls in the weights' dtype) and rows weigh the experts they did not pick by
    zero, so no shape depends on the routing. With the fuse pass's ``slots`` each row's k
    weighted expert outputs are written side by side ``[R, k, H]`` instead of summed. Both
    forms keep the experts' outputs in float32 until they are summed (here, or by the
    slots' consumer) and round once, as the Triton kernels do; the reference rounds each
    expert's rows first, where HF's ``index_add_`` does (a tolerance-level difference)."""
    check_one_rank(ctx.node)
    x, ids, weights, gate_up, down = ctx.inputs()
    (out,) = ctx.outputs()
    attrs = ctx.node.attrs
    offset, local, width = attrs["expert_offset"], attrs["local_experts"], attrs["width"]
    experts = torch.arange(offset, offset + local, device=x.device)
    dtype = gate_up.dtype
    gate_up_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)

    def launch() -> None:
        picked = ids.long().unsqueeze(-1) == experts  # [R, k, E]
        combine = (weights.float().unsqueeze(-1) * picked).sum(1)  # [R, E]
        rows = x.to(dtype).unsqueeze(0).expand(local, -1, -1)  # [E, R, H]
        h = torch.bmm(rows, gate_up_t)  # [E, R, 2W]
        act = gated_activation(h[..., :width], h[..., width:], attrs)
        y = torch.bmm(act, down_t)  # [E, R, H_out]
        if attrs.get("slots"):
            chosen = weights.float().unsqueeze(-1) * picked  # [R, k, E]
            out.copy_(torch.einsum("rke,erh->rkh", chosen, y.float()))
            return
        out.copy_((y.float() * combine.t().unsqueeze(-1)).sum(0))

    return launch


# ---------------------------------------------------------------------- KDA


def scratch_slots(indices: torch.Tensor, scratch: int) -> torch.Tensor:
    """``indices`` as int64 with every negative index replaced by ``scratch``."""
    indices = indices.long()
    return torch.where(indices >= 0, indices, torch.full_like(indices, scratch))


def _read_slots(cache: torch.Tensor, slots: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The rows of ``cache`` at ``slots`` (a copy), zeros where ``real`` is false."""
    picked = cache.index_select(0, slots)
    mask = real.view(-1, *([1] * (picked.dim() - 1)))
    return torch.where(mask, picked, torch.zeros_like(picked))


@register("kda_core", "torch", BOTH, note="the reference KDA step over gathered state slots")
def kda_core(ctx: PrepareContext) -> Launch:
    """One decode / verify step of the KDA core (the reference's math, see
    :mod:`stepgraph.lower.ref_kda`): states gathered from and scattered to their slots; the
    scratch slot (the last; negative indices map to it) reads zeros."""
    check_one_rank(ctx.node)
    a = ctx.node.attrs
    heads, dim, q_len = a["heads"], a["head_dim"], a.get("q", 1)
    low_rank = a["output_gate"] == "low_rank"
    ins = ctx.inputs()
    (out,) = ctx.outputs()
    q_in, k_in, v_in, g_in, f_a, b = ins[:6]
    count = 8 if low_rank else 7
    q_conv, k_conv, v_conv, f_b, dt_bias, a_log, o_norm = ins[6:13]
    g_b = ins[13] if low_rank else None
    rec_state, q_state, k_state, v_state = ins[6 + count : 10 + count]
    meta = ins[10 + count :]
    rows = q_in.shape[0]
    width = heads * dim
    requests = rows // q_len
    act_dtype = q_in.dtype
    scratch = rec_state.shape[0] - 1
    conv_weights = (q_conv, k_conv, v_conv)
    conv_caches = (q_state, k_state, v_state)

    def launch() -> None:
        slots = scratch_slots(meta[0], scratch).view(requests, q_len)
        if q_len > 1:
            accepted = meta[1].long().view(requests, q_len)[:, 0]
            start = slots.gather(1, (accepted - 1).clamp(0, q_len - 1)[:, None])[:, 0]
            start = torch.where(slots[:, 0] != scratch, start, slots[:, 0])
        else:
            start = slots[:, 0]
        real = start != scratch
        f = linear(f_a, f_b, act_dtype)
        gate = decay_gate(f, dt_bias, a_log, heads, a["gate_form"], a.get("gate_lower_bound"))
        gate = gate.view(requests, q_len, heads, dim)
        beta = torch.sigmoid(b.float()).view(requests, q_len, heads)
        out_gate = g_in if g_b is None else linear(g_in, g_b, act_dtype)
        inputs = [t.reshape(requests, q_len, width) for t in (q_in, k_in, v_in)]
        conv_states = [_read_slots(c, start, real) for c in conv_caches]
        state = _read_slots(rec_state, start, real).float()  # [n, H, K, V]
        outputs = []
        for j in range(q_len):
            state, token = kda_token(conv_states, [x[:, j] for x in inputs], conv_weights,
                                     state, gate[:, j], beta[:, j], heads, dim, act_dtype)
            outputs.append(token)
            if q_len > 1 or j == q_len - 1:
                dest = slots[:, j]
                rec_state.index_copy_(0, dest, state.to(rec_state.dtype))
                for cache, value in zip(conv_caches, conv_states, strict=True):
                    cache.index_copy_(0, dest, value.to(cache.dtype))
        o = torch.stack(outputs, dim=1).reshape(rows, heads, dim).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + a["eps"]) * o_norm.float()
        o = o * torch.sigmoid(out_gate.float().view(rows, heads, dim))
        out.copy_(o.reshape(rows, width))

    return launch


# ---------------------------------------------------------------------- MLA / DSA


class PagedCache:
    """Capturable writes into and reads from one paged cache [NB, BS, C] whose last block is
    the scratch block, for a bin of ``rows`` rows and a block table of ``width`` blocks."""

    def __init__(self, cache: torch.Tensor, rows: int, width: int) -> None:
        self.cache = cache
        self.flat = cache.view(-1, cache.shape[-1])
        block_size = cache.shape[1]
        self.block_size = block_size
        device = cache.device
        scratch = (cache.shape[0] - 1) * block_size
        self.scratch = scratch + torch.arange(rows, device=device) % block_size
        t = torch.arange(width * block_size, device=device)
        self.t = t
        self.t_block = t // block_size
        self.t_offset = t % block_size

    def write(self, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
        """Store ``entries`` [R, C] at ``slot_mapping`` (negative: the scratch block)."""
        slots = slot_mapping.long()
        slots = torch.where(slots >= 0, slots, self.scratch)
        self.flat.index_copy_(0, slots, entries.to(self.flat.dtype))

    def read(self, block_tables: torch.Tensor, seq_lens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's entries over the whole table [R, T*BS, C] and the mask of its first
        ``seq_lens`` tokens (as the reference's ``_gather_tokens``, at a fixed width)."""
        valid = self.t[None, :] < seq_lens.long()[:, None]
        blocks = block_tables.long()[:, self.t_block]
        valid = valid & (blocks >= 0)
        index = torch.where(valid, blocks * self.block_size + self.t_offset[None, :],
                            torch.zeros_like(blocks))
        return self.flat[index], valid


def _split_meta(ctx: PrepareContext, count: int) -> tuple[list[torch.Tensor], Any]:
    ins = list(ctx.inputs())
    has_rope = ctx.node.attrs.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    if len(ins) != count:
        raise UserError(f"node {ctx.node.name}: {ctx.node.op} expects {count} inputs "
                        f"(+ positions), got {len(ins)}")
    return ins, positions


@register("mla_core", "torch", BOTH, note="dense attention over the whole block table")
def mla_core(ctx: PrepareContext) -> Launch:
    """MLA decode over the paged latent cache: writes the new latents, then attends over the
    block table's tokens masked by ``seq_lens``."""
    check_one_rank(ctx.node)
    ins, positions = _split_meta(ctx, 7)
    q_latent, kv_a, norm, cache, block_tables, seq_lens, slot_mapping = ins
    outs = ctx.outputs()
    call = op_call(ctx)
    paged = PagedCache(cache, ctx.rows, block_tables.shape[1])

    def launch() -> None:
        paged.write(slot_mapping, ref_mla._latent_entries(call, kv_a, norm, positions))
        entries, mask = paged.read(block_tables, seq_lens)
        for out, result in zip(outs, ref_mla._attend(call, q_latent, entries, mask),
                               strict=True):
            out.copy_(result)

    return launch


@register("dsa_core", "torch", BOTH, note="dense indexer + top-k over the whole block table")
def dsa_core(ctx: PrepareContext) -> Launch:
    """DSA: the indexer scores every cached token of the table, each row keeps its top-k,
    then MLA attends over the selection (the reference's math at a fixed width)."""
    check_one_rank(ctx.node)
    a = ctx.node.attrs
    ins, positions = _split_meta(ctx, 13)
    (q_latent, kv_a, norm, index_q, index_k, index_w, k_norm, k_norm_bias, cache, k_cache,
     block_tables, seq_lens, slot_mapping) = ins
    outs = ctx.outputs()
    call = op_call(ctx)
    width = block_tables.shape[1]
    latents = PagedCache(cache, ctx.rows, width)
    keys_cache = PagedCache(k_cache, ctx.rows, width)
    rope_dim = a["qk_rope_head_dim"]
    rotate = positions is not None and rope_dim > 0
    top = min(a["index_top_k"], width * cache.shape[1])

    def launch() -> None:
        latents.write(slot_mapping, ref_mla._latent_entries(call, kv_a, norm, positions))
        key = F.layer_norm(index_k.float(), (index_k.shape[-1],), k_norm.float(),
                           k_norm_bias.float(), ref_mla.INDEXER_NORM_EPS)
        if rotate:
            key = torch.cat([rope(key[:, :rope_dim], positions, a["rope_theta"]),
                             key[:, rope_dim:]], dim=-1)
        keys_cache.write(slot_mapping, key.to(index_k.dtype))
        entries, mask = latents.read(block_tables, seq_lens)
        keys, _ = keys_cache.read(block_tables, seq_lens)
        chosen = ref_mla.indexer_selection(
            index_q, keys, index_w, mask, top,
            (positions, a["rope_theta"], rope_dim) if rotate else None)
        for out, result in zip(outs, ref_mla._attend(call, q_latent, entries, mask & chosen),
                               strict=True):
            out.copy_(result)

    return launch
