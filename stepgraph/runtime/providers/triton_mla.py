"""MLA providers: ``triton_splitkv`` for ``mla_core`` (cache write, split-KV partial
attention, LSE merge: :mod:`stepgraph.runtime.kernels.mla`), with DCP's two outputs (the
rank's o_latent and LSE, merged over its splits, not across ranks); ``triton`` for
``mla_query`` (q_a's RMSNorm in Triton, q_b as one split-K launch (PDL, the GEMV form at one
and two rows), the W_UK absorption and the rope part in Triton; DSA's indexer query as one
torch matmul; tactic ``norm_inside`` 1, not for DSA: the RMSNorm is q_b's input norm
instead, so at one and two rows the GEMV normalizes while it streams and the norm launch is
gone) and
``mla_value`` (W_UV and the output gate in one Triton kernel).

``dsa_core`` (``triton_sparse``): the latent and indexer-key cache writes, the indexer's
scores over every token of the block table (-inf past a row's tokens) in Triton, the top-k as
one ``torch.topk`` of fixed k = min(top_k, block table tokens) (capturable), then the split-KV
kernels over the selected tokens. Ties among equal finite scores may pick other tokens than
the reference's top-k.

The split count is fixed when the launch is prepared (capturable): the tactic's ``split``
when given, else enough (row, head block, split) programs to fill the GPU four times
(:data:`WAVES`), at most one split per ``block_n`` tokens of the block table and at most
64. Each split covers ``ceil(seq_len / splits)`` tokens (rounded up to ``block_n``) of its
row, so short rows leave splits empty (LSE -inf, merged with weight 0). Partial outputs
live in scratch shared by every MLA launch of the device (stream-ordered).

A layout the kernels do not take (a cache without a unit last stride, a non-contiguous kv_b,
...) makes a provider decline (NotImplementedError): the runtime then tries the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stepgraph.errors import UserError
from stepgraph.runtime.kernels import mla as kernels
from stepgraph.runtime.kernels.elementwise import RmsNorm
from stepgraph.runtime.kernels.launch_utils import dot_in_f32, interpreting, pdl_allowed, scratch
from stepgraph.runtime.kernels.splitk_gemm import InputNorm, SplitKGemm, SplitKTactic
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register

DEVICES = ("cuda", "cpu") if interpreting() else ("cuda",)


class Declined(NotImplementedError):
    """The provider does not take this node's tensors (a layout its kernels cannot read):
    the runtime tries the next provider."""
MAX_SPLITS = 64
# Programs per SM the split count aims at. Measured on the H200 (2026-12-01, 4096 cached
# tokens, scripts/ab_replay.py): k3-rank-tp8 at B=1 (12 heads) 64 splits 1673 us a step,
# 32: 1684, 16: 1715, 8: 1784; k3-slice-tp1 at B=16 (64 heads) 5 splits (two waves) 6164
# us, 8: 6070-6099, 16: 6089-6105. Four waves gives 64 and 9. Eleventh session (tactic
# split): k3-rank-tp8 B=1 128 splits 1500.2-1504.3 against 1504.5-1508.1 (96: 1509-1511;
# 16-token blocks with 64 / 128 / 256 splits 1513-1526), but k3-slice-tp1 B=1 (96 heads)
# 2745.5-2746.0 against 2740.6-2742.2: the cap stays. At one row the H200 table's mla_core
# row sets 128 splits with one pipeline stage (faster on both workloads, sixteenth session).
WAVES = 4


def last_dim_operand(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Callable[[], None]]:
    """``tensor`` when its last dim has unit stride (a kernel reads it through its other
    strides), else a contiguous buffer and the copy that fills it (run in the launch)."""
    if tensor.stride(-1) == 1 or tensor.shape[-1] == 1:
        return tensor, lambda: None
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)

    def fill() -> None:
        buffer.copy_(tensor)

    return buffer, fill


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on the CPU, for the interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def choose_splits(rows: int, heads: int, max_tokens: int, device: torch.device,
                  tactic: dict[str, Any]) -> int:
    """The number of KV splits of a launch (see the module docstring)."""
    if "split" in tactic:
        return max(1, int(tactic["split"]))
    block_h = int(tactic.get("block_h", 16))
    block_n = int(tactic.get("block_n", 32))
    programs = rows * -(-heads // block_h)
    wanted = -(-WAVES * sm_count(device) // max(programs, 1))
    most = max(1, -(-max_tokens // block_n))
    return max(1, min(wanted, most, MAX_SPLITS))


def split_kv_plan(rows: int, heads: int, lora: int, max_tokens: int, cache_dtype: torch.dtype,
                  device: torch.device, tactic: dict[str, Any]
                  ) -> tuple[int, torch.Tensor, torch.Tensor, dict[str, int]]:
    """The split-KV partial attention's plan, shared by MLA and DSA: the number of KV
    splits over ``max_tokens`` cached (or selected) tokens, the float32 partial outputs
    ``[rows, heads, splits, lora]`` and LSEs ``[rows, heads, splits]`` (shared scratch), and
    the kernel options of ``tactic`` (head and token blocks, warps, stages)."""
    splits = choose_splits(rows, heads, max_tokens, device, tactic)
    partial_o = scratch(device, "mla.partial_o", rows * heads * splits * lora, torch.float32)
    partial_lse = scratch(device, "mla.partial_lse", rows * heads * splits, torch.float32)
    options = dict(block_h=int(tactic.get("block_h", 16)),
                   block_n=int(tactic.get("block_n", 16 if cache_dtype == torch.float32 else 32)),
                   num_warps=int(tactic.get("num_warps", 4)),
                   num_stages=int(tactic.get("stages", 2)))
    return (splits, partial_o.view(rows, heads, splits, lora),
            partial_lse.view(rows, heads, splits), options)


def mla_core_launch(attrs: dict[str, Any], ins: list[torch.Tensor], outs: list[torch.Tensor],
                    device: torch.device, pdl: bool, tactic: dict[str, Any] | None = None
                    ) -> Launch:
    """The launch of one mla_core node over bound tensors (inputs in the order of
    :func:`stepgraph.frontend.build_mla`)."""
    tactic = dict(tactic or {})
    has_rope = attrs.get("rope_theta") is not None
    expected = 8 if has_rope else 7
    if len(ins) != expected:
        raise UserError(f"mla_core: expected {expected} inputs, found {len(ins)}")
    q_latent, kv_a, norm, cache, block_tables, seq_lens, slot_mapping = ins[:7]
    positions = ins[7] if has_rope else None
    out = outs[0]
    lse = outs[1] if len(outs) > 1 else None
    lora = int(attrs["kv_lora_rank"])
    rows, heads, width = q_latent.shape
    if cache.dim() != 3 or cache.shape[2] != width or cache.stride(2) != 1:
        raise Declined(f"mla_core: the latent cache must be [NB, BS, {width}] with a unit "
                        f"last stride, found shape {list(cache.shape)} strides "
                        f"{list(cache.stride())}")
    if tuple(out.shape) != (rows, heads, lora) or out.stride(2) != 1:
        raise Declined(f"mla_core: o_latent must be [{rows}, {heads}, {lora}] with a unit "
                        f"last stride, found {list(out.shape)} strides {list(out.stride())}")
    if lse is not None and (tuple(lse.shape) != (rows, heads) or lse.dtype != torch.float32
                            or lse.stride(1) != 1):
        raise Declined(f"mla_core: the LSE output must be float32 [{rows}, {heads}], found "
                        f"{lse.dtype} {list(lse.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != rows:
        raise UserError(f"mla_core: block tables must be [{rows}, T], found "
                        f"{list(block_tables.shape)}")
    for name, tensor in (("seq_lens", seq_lens), ("slot_mapping", slot_mapping),
                         ("block_tables", block_tables)):
        if tensor.stride(-1) != 1:
            raise Declined(f"mla_core: {name} must have a unit last stride")
    fills = []
    q_latent, fill = last_dim_operand(q_latent, "q_latent")
    fills.append(fill)
    kv_a, fill = last_dim_operand(kv_a, "kv_a")
    fills.append(fill)
    max_tokens = block_tables.shape[1] * cache.shape[1]
    splits, partial_o, partial_lse, options = split_kv_plan(rows, heads, lora, max_tokens,
                                                            cache.dtype, device, tactic)
    use_pdl = pdl_allowed(pdl, device)
    dot_f32 = dot_in_f32(cache.dtype)

    def launch() -> None:
        for fill in fills:
            fill()
        kernels.launch_cache_write(kv_a, norm, cache, slot_mapping, positions, lora=lora,
                                   eps=float(attrs["eps"]), rope_theta=attrs.get("rope_theta"),
                                   pdl=use_pdl)
        kernels.launch_partial(q_latent, cache, block_tables, seq_lens, partial_o,
                               partial_lse, lora=lora,
                               softmax_scale=float(attrs["softmax_scale"]), splits=splits,
                               dot_f32=dot_f32, pdl=use_pdl, **options)
        kernels.launch_merge(partial_o, partial_lse, out, lse, pdl=use_pdl)

    return launch


@register("mla_core", "triton_splitkv", DEVICES,
          note="cache write + split-KV partial attention + LSE merge, Triton")
def mla_core_splitkv(ctx: PrepareContext) -> Launch:
    """mla_core over the paged latent cache (see the module docstring)."""
    return mla_core_launch(dict(ctx.node.attrs), list(ctx.inputs()), list(ctx.outputs()),
                           ctx.device, ctx.pdl, dict(ctx.tactic or {}))


def _absorb_dims(attrs: dict[str, Any]) -> tuple[int, int, int, int]:
    return (int(attrs["heads"]), int(attrs["qk_nope_head_dim"]),
            int(attrs["qk_rope_head_dim"]), int(attrs["v_head_dim"]))


def mla_query_launch(attrs: dict[str, Any], ins: list[torch.Tensor], outs: list[torch.Tensor],
                     device: torch.device, pdl: bool, tactic: dict[str, Any] | None = None
                     ) -> Launch:
    """The launch of one mla_query node (inputs in the order of
    :func:`stepgraph.frontend.build_mla`); tactic ``norm_inside`` 1: q_a's RMSNorm is q_b's
    input norm (see the module docstring)."""
    ins = list(ins)
    heads, nope, rope, v_dim = _absorb_dims(attrs)
    has_rope = attrs.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    kv_b = ins.pop()
    dsa = len(outs) > 1
    index_wq_b = ins.pop() if dsa else None
    q_latent = outs[0]
    rows = q_latent.shape[0]
    lora = kv_b.shape[1]
    if tuple(q_latent.shape) != (rows, heads, lora + rope) or q_latent.stride(2) != 1:
        raise Declined(f"mla_query: q_latent must be [{rows}, {heads}, {lora + rope}] with a "
                        f"unit last stride, found {list(q_latent.shape)}")
    if not kv_b.is_contiguous() or kv_b.shape[0] != heads * (nope + v_dim):
        raise Declined(f"mla_query: kv_b must be a contiguous [{heads * (nope + v_dim)}, "
                        f"{lora}], found {list(kv_b.shape)}")
    act = q_latent.dtype
    fills: list[Callable[[], None]] = []
    use_pdl = pdl_allowed(pdl, device)
    if attrs.get("q_lora", True):
        q_a, q_norm, q_b = ins
        q_a, fill = last_dim_operand(q_a, "q_a")
        fills.append(fill)
        query = scratch(device, "mla.q", rows * q_b.shape[0], act).view(rows, -1)
        eps = float(attrs["eps"])
        q_b_tactic = SplitKTactic.from_mapping(None, rows)
        if dsa or not int((tactic or {}).get("norm_inside", 0)):
            # the normed rows stored (DSA's indexer query reads them too)
            q_resid = scratch(device, "mla.q_resid", rows * q_a.shape[1], act).view(rows, -1)
            q_b_gemm = SplitKGemm(q_resid, q_b, query, q_b_tactic, pdl=pdl)
            q_a_norm = RmsNorm(q_a, q_norm, q_resid, eps, pdl=pdl)

            def project() -> None:
                q_a_norm()
                q_b_gemm()
        else:  # the norm inside q_b's GEMV at one or two rows (SplitKGemm's input norm)
            project = SplitKGemm(q_a, q_b, query, q_b_tactic, pdl=pdl,
                                 norm=InputNorm(q_norm, eps, act))
    else:
        (query,) = ins
        query, fill = last_dim_operand(query, "q")
        fills.append(fill)
        q_resid = query

        def project() -> None:
            pass
    index_out = None
    if dsa:
        index_q = outs[1]
        index_out = index_q.view(rows, -1) if index_q.is_contiguous() else torch.empty(
            (rows, index_q[0].numel()), dtype=index_q.dtype, device=index_q.device)
    dot_f32 = dot_in_f32(kv_b.dtype)
    theta = attrs.get("rope_theta")

    def launch() -> None:
        for fill in fills:
            fill()
        project()
        kernels.launch_absorb(query, kv_b, positions, q_latent, heads=heads, nope=nope,
                              rope=rope, v_dim=v_dim, rope_theta=theta, dot_f32=dot_f32,
                              pdl=use_pdl)
        if index_out is not None:
            torch.matmul(q_resid, index_wq_b.t(), out=index_out)  # type: ignore[union-attr]
            if index_out.data_ptr() != outs[1].data_ptr():
                outs[1].copy_(index_out.view(outs[1].shape))

    return launch


def mla_value_launch(attrs: dict[str, Any], ins: list[torch.Tensor], out: torch.Tensor,
                     device: torch.device, pdl: bool) -> Launch:
    """The launch of one mla_value node: W_UV per head, times sigmoid(gate) when gated."""
    heads, nope, _, v_dim = _absorb_dims(attrs)
    o_latent, kv_b = ins[:2]
    gated = bool(attrs.get("gated"))
    if gated != (len(ins) > 2):
        raise UserError(f"mla_value: gated={gated} but {len(ins)} inputs")
    if not kv_b.is_contiguous() or kv_b.shape[0] != heads * (nope + v_dim):
        raise Declined(f"mla_value: kv_b must be a contiguous [{heads * (nope + v_dim)}, "
                        f"{kv_b.shape[1]}], found {list(kv_b.shape)}")
    if tuple(out.shape) != (o_latent.shape[0], heads * v_dim) or out.stride(1) != 1:
        raise Declined(f"mla_value: the output must be [{o_latent.shape[0]}, "
                        f"{heads * v_dim}] with a unit column stride, found {list(out.shape)}")
    fills = []
    o_latent, fill = last_dim_operand(o_latent, "o_latent")
    fills.append(fill)
    gate = None
    if gated:
        gate, fill = last_dim_operand(ins[2], "gate")
        fills.append(fill)
    use_pdl = pdl_allowed(pdl, device)
    dot_f32 = dot_in_f32(kv_b.dtype)

    def launch() -> None:
        for fill in fills:
            fill()
        kernels.launch_value(o_latent, kv_b, gate, out, heads=heads, nope=nope, v_dim=v_dim,
                             dot_f32=dot_f32, pdl=use_pdl)

    return launch


@register("mla_query", "triton", DEVICES,
          note="RMSNorm + cuBLAS q_b + Triton W_UK absorption (+ DSA indexer query)")
def mla_query_triton(ctx: PrepareContext) -> Launch:
    """mla_query: the absorbed query (see the module docstring)."""
    return mla_query_launch(dict(ctx.node.attrs), list(ctx.inputs()), list(ctx.outputs()),
                            ctx.device, ctx.pdl, dict(ctx.tactic or {}))


@register("mla_value", "triton", DEVICES, note="W_UV and the output gate, one Triton kernel")
def mla_value_triton(ctx: PrepareContext) -> Launch:
    """mla_value: W_UV of the attended latent (see the module docstring)."""
    (out,) = ctx.outputs()
    return mla_value_launch(dict(ctx.node.attrs), list(ctx.inputs()), out, ctx.device, ctx.pdl)


def dsa_core_launch(attrs: dict[str, Any], ins: list[torch.Tensor], outs: list[torch.Tensor],
                    device: torch.device, pdl: bool, tactic: dict[str, Any] | None = None
                    ) -> Launch:
    """The launch of one dsa_core node over bound tensors (inputs in the order of
    :func:`stepgraph.frontend.build_mla` for DSA)."""
    tactic = dict(tactic or {})
    ins = list(ins)
    has_rope = attrs.get("rope_theta") is not None
    positions = ins.pop() if has_rope else None
    if len(ins) != 13 or len(outs) != 1:
        raise Declined(f"dsa_core: expected 13 inputs (+ positions) and one output, found "
                        f"{len(ins)} and {len(outs)} (DSA with DCP is not supported)")
    (q_latent, kv_a, norm, index_q, index_k, index_w, k_norm, k_norm_bias, cache, k_cache,
     block_tables, seq_lens, slot_mapping) = ins
    (out,) = outs
    lora = int(attrs["kv_lora_rank"])
    rows, heads, width = q_latent.shape
    if cache.dim() != 3 or cache.shape[2] != width or cache.stride(2) != 1:
        raise Declined(f"dsa_core: the latent cache must be [NB, BS, {width}] with a unit "
                        f"last stride, found {list(cache.shape)}")
    if k_cache.dim() != 3 or k_cache.stride(2) != 1 or k_cache.shape[1] != cache.shape[1]:
        raise Declined(f"dsa_core: the key cache must be [NB, {cache.shape[1]}, d] with a "
                        f"unit last stride, found {list(k_cache.shape)}")
    if tuple(out.shape) != (rows, heads, lora) or out.stride(2) != 1:
        raise Declined(f"dsa_core: o_latent must be [{rows}, {heads}, {lora}] with a unit "
                        f"last stride, found {list(out.shape)}")
    fills = []
    operands = []
    for name, tensor in (("q_latent", q_latent), ("kv_a", kv_a), ("index_q", index_q),
                         ("index_k", index_k), ("index_weights", index_w)):
        operand, fill = last_dim_operand(tensor, name)
        operands.append(operand)
        fills.append(fill)
    q_latent, kv_a, index_q, index_k, index_w = operands
    capacity = block_tables.shape[1] * cache.shape[1]
    top = max(1, min(int(attrs["index_top_k"]), capacity))
    scores = scratch(device, "dsa.scores", rows * capacity, torch.float32).view(rows, capacity)
    picked_scores = scratch(device, "dsa.top_scores", rows * top, torch.float32).view(rows, top)
    picks = scratch(device, "dsa.picks", rows * top, torch.int64).view(rows, top)
    splits, partial_o, partial_lse, options = split_kv_plan(rows, heads, lora, top,
                                                            cache.dtype, device, tactic)
    use_pdl = pdl_allowed(pdl, device)
    dot_f32 = dot_in_f32(cache.dtype)
    rope = int(attrs["qk_rope_head_dim"])
    theta = attrs.get("rope_theta")

    def launch() -> None:
        for fill in fills:
            fill()
        kernels.launch_cache_write(kv_a, norm, cache, slot_mapping, positions, lora=lora,
                                   eps=float(attrs["eps"]), rope_theta=theta, pdl=use_pdl)
        kernels.launch_dsa_key_write(index_k, k_norm, k_norm_bias, k_cache, slot_mapping,
                                     positions, rope=rope, rope_theta=theta, pdl=use_pdl)
        kernels.launch_dsa_index(index_q, index_w, k_cache, block_tables, seq_lens, positions,
                                 scores, rope=rope, rope_theta=theta, dot_f32=dot_f32,
                                 pdl=use_pdl)
        torch.topk(scores, top, dim=1, largest=True, sorted=False, out=(picked_scores, picks))
        kernels.launch_partial(q_latent, cache, block_tables, seq_lens, partial_o,
                               partial_lse, lora=lora,
                               softmax_scale=float(attrs["softmax_scale"]), splits=splits,
                               dot_f32=dot_f32, picks=picks, pdl=use_pdl, **options)
        kernels.launch_merge(partial_o, partial_lse, out, None, pdl=use_pdl)

    return launch


@register("dsa_core", "triton_sparse", DEVICES,
          note="indexer scores (Triton) + torch top-k + sparse split-KV MLA (Triton)")
def dsa_core_sparse(ctx: PrepareContext) -> Launch:
    """dsa_core: the lightning indexer, top-k, sparse MLA (see the module docstring)."""
    return dsa_core_launch(dict(ctx.node.attrs), list(ctx.inputs()), list(ctx.outputs()),
                           ctx.device, ctx.pdl, dict(ctx.tactic or {}))
