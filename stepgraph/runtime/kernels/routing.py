"""The MoE router in Triton (:class:`Router`, one program a row): scores (sigmoid or
softmax), the biased top-k, renormalised and scaled weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.launch_utils import next_pow2, pdl_allowed


@triton.jit
def _pick_best(v0, i0, s0, v1, i1, s1):
    """The combine of the top-k's pick: the larger ``choice`` (the lower id among ties),
    carrying its id and unbiased score."""
    take = (v1 > v0) | ((v1 == v0) & (i1 < i0))
    return tl.where(take, v1, v0), tl.where(take, i1, i0), tl.where(take, s1, s0)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, wts_ptr, E, TOPK,
                   stride_lr, stride_le, stride_ir, stride_ij, stride_wr, stride_wj,
                   scaling,
                   E_PAD: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: scores (sigmoid or softmax), top-k of ``scores + bias`` (largest first, the
    lowest id among ties), the unbiased scores of the chosen, renormalised and scaled."""
    row = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    valid = offs < E
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    logits = tl.load(logits_ptr + row * stride_lr + offs * stride_le, mask=valid,
                     other=float("-inf")).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SOFTMAX:
        top = tl.max(logits, 0)
        ex = tl.where(valid, tl.exp(logits - top), 0.0)
        scores = ex / tl.sum(ex, 0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + bias
    choice = tl.where(valid, choice, float("-inf"))
    ks = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.int32)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    for i in range(0, TOPK):
        # one reduction a pick (not a max, the lowest id at it and its score: three; -1.7
        # us a k3-rank-tp8 B=1 step on the H200, docs/perf.md, nineteenth session)
        _, index, score = tl.reduce((choice, offs, scores), 0, _pick_best)
        hit = offs == index
        chosen = tl.where(ks == i, index, chosen)
        weights = tl.where(ks == i, score, weights)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * scaling
    k_ok = ks < TOPK
    tl.store(ids_ptr + row * stride_ir + ks * stride_ij, chosen, mask=k_ok)
    tl.store(wts_ptr + row * stride_wr + ks * stride_wj, weights, mask=k_ok)


class Router:
    """A prepared router launch: ``logits [R, E]`` (float32, may be a strided view),
    optional correction ``bias [E]`` -> ``ids [R, k]`` int32 and ``weights [R, k]``."""

    def __init__(self, logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                 weights: torch.Tensor, *, top_k: int, score: str, renormalize: bool,
                 scaling: float, pdl: bool = False) -> None:
        rows, experts = logits.shape
        if tuple(ids.shape) != (rows, top_k) or tuple(weights.shape) != (rows, top_k):
            raise UserError(f"router: outputs {list(ids.shape)} / {list(weights.shape)} do "
                            f"not hold {rows} rows x top-{top_k}")
        if score not in ("sigmoid", "softmax"):
            raise NotImplementedError(f"router: score {score!r} is not sigmoid or softmax")
        if top_k > experts:
            raise UserError(f"router: top-{top_k} of {experts} experts")
        if bias is not None and tuple(bias.shape) != (experts,):
            raise UserError(f"router: bias {list(bias.shape)} for {experts} experts")
        self.logits, self.bias, self.ids, self.weights = logits, bias, ids, weights
        self.rows, self.experts, self.top_k = rows, experts, top_k
        self.softmax, self.renorm, self.scaling = score == "softmax", renormalize, scaling
        self.pdl = pdl_allowed(pdl, logits.device)
        self.e_pad = max(2, next_pow2(experts))
        self.k_pad = max(2, next_pow2(top_k))
        self.warps = 4 if self.e_pad <= 512 else 8

    def __call__(self) -> None:
        """Enqueue the launch (one program a row)."""
        if self.rows == 0:
            return
        lg, ids, wts = self.logits, self.ids, self.weights
        bias = self.bias if self.bias is not None else lg
        _router_kernel[(self.rows,)](
            lg, bias, ids, wts, self.experts, self.top_k,
            lg.stride(0), lg.stride(1), ids.stride(0), ids.stride(1), wts.stride(0),
            wts.stride(1), float(self.scaling),
            E_PAD=self.e_pad, K_PAD=self.k_pad, SOFTMAX=self.softmax,
            HAS_BIAS=self.bias is not None, RENORM=bool(self.renorm), USE_PDL=self.pdl,
            num_warps=self.warps, launch_pdl=self.pdl)
