"""KDA core providers: ``triton`` (our kernels, :mod:`stepgraph.runtime.kernels.kda`) and,
where fla-core is importable, ``fla_fused_recurrent`` (our prep and output kernels around
fla-core's ``fused_recurrent_kda`` recurrence, in place on the state pool).

Bins of at least ``GATE_KERNEL_ROWS`` rows (tactic key ``gate_rows``) compute the decay gate
in a separate GEMM kernel; smaller bins compute it inside the prep kernel (one launch less).
With tactic key ``out_norm`` 1 our recurrence also runs the gated output norm (its last V
block of each head) and the norm launch is gone; by default (0: measured ~4 us slower at one
row on the H200, docs/perf.md, tenth session), and always with fla's recurrence, the norm is
a launch of its own.
With tactic key ``prep_inside`` 1 (our recurrence, decode steps (q = 1) in a bin that computes
the gate in the prep, f_b's rank at most ``FB_PRE_RANK``) the prep and the recurrence are one
launch, and the output norm's launch (never inside the recurrence then) writes the conv
states.
Tactic keys: ``block_v`` and ``num_warps`` of the recurrence, ``gate_rows``, ``out_norm``,
``prep_inside``.

Both handle decode (q = 1) and verify (q > 1) steps. Slots: ``triton`` follows the
reference exactly (a negative slot reads zeros and writes nothing); fla-core cannot skip a
slot, so ``fla_fused_recurrent`` sends negative slots to the caches' scratch slot (the last
slot of the state pool, which the runtime allocates for padded rows). Scratch tensors
(q, k, v, g, beta, o of the step) are shared by every KDA launch of a device
(:func:`stepgraph.runtime.kernels.launch_utils.scratch`): launches are stream-ordered.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stepgraph.errors import UserError
from stepgraph.runtime.kernels import kda as kernels
from stepgraph.runtime.kernels.launch_utils import (
    dot_in_f32,
    interpreting,
    pdl_allowed,
    scratch,
)
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register

DEVICES = ("cuda", "cpu") if interpreting() else ("cuda",)


class Declined(NotImplementedError):
    """The provider does not take this node's tensors (a layout its kernels cannot read):
    the runtime tries the next provider."""
GATE_KERNEL_ROWS = 16  # bins from this many rows compute the decay gate in its own GEMM


def rows_operand(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Callable[[], None]]:
    """A [rows, width] operand with unit column stride that a kernel can read through its row
    stride: ``tensor`` itself when it is one, else a buffer and the copy that fills it (run
    inside the launch; allocated once, here)."""
    if tensor.dim() == 2 and (tensor.stride(1) == 1 or tensor.shape[1] == 1):
        return tensor, lambda: None
    if tensor.dim() < 1:
        raise UserError(f"{name}: expected a [rows, width] tensor, found a scalar")
    flat = tensor.reshape(tensor.shape[0], -1) if tensor.is_contiguous() else None
    if flat is not None:
        return flat, lambda: None
    buffer = torch.empty((tensor.shape[0], tensor[0].numel()), dtype=tensor.dtype,
                         device=tensor.device)

    def fill() -> None:
        buffer.view(tensor.shape).copy_(tensor)

    return buffer, fill


def require_contiguous(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` when contiguous (weights and states are read with packed strides); else
    the provider declines (NotImplementedError: the runtime tries the next provider)."""
    if not tensor.is_contiguous():
        raise Declined(f"{name}: the KDA kernels need a contiguous tensor, found shape "
                        f"{list(tensor.shape)} strides {list(tensor.stride())}")
    return tensor


@dataclass
class KdaOperands:
    """The bound tensors of one kda_core node, by role."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    f_a: torch.Tensor
    b: torch.Tensor
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    f_b: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    o_norm: torch.Tensor
    g_b: torch.Tensor | None
    state: torch.Tensor
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    slots: torch.Tensor
    accepted: torch.Tensor | None
    out: torch.Tensor
    fills: list[Callable[[], None]]


def kda_operands(attrs: dict[str, Any], ins: list[torch.Tensor], out: torch.Tensor
                 ) -> KdaOperands:
    """Split a kda_core node's inputs (order of :func:`stepgraph.frontend.build_kda`) and
    check their shapes; activations get a unit column stride (see :func:`rows_operand`)."""
    heads, dim = int(attrs["heads"]), int(attrs["head_dim"])
    q_len = int(attrs.get("q", 1))
    low_rank = attrs["output_gate"] == "low_rank"
    nweights = 8 if low_rank else 7
    expected = 6 + nweights + 4 + (2 if q_len > 1 else 1)
    if len(ins) != expected:
        raise UserError(f"kda_core: expected {expected} inputs (q={q_len}, output gate "
                        f"{attrs['output_gate']}), found {len(ins)}")
    fills: list[Callable[[], None]] = []
    acts = []
    for name, tensor in zip(("q", "k", "v", "g", "f_a", "b"), ins[:6], strict=True):
        operand, fill = rows_operand(tensor, f"kda_core input {name}")
        acts.append(operand)
        fills.append(fill)
    width = heads * dim
    conv = tuple(require_contiguous(t, "conv weight") for t in ins[6:9])
    f_b, dt_bias, a_log, o_norm = (require_contiguous(t, n) for t, n in zip(
        ins[9:13], ("f_b_proj", "dt_bias", "A_log", "o_norm"), strict=True))
    g_b = require_contiguous(ins[13], "g_b_proj") if low_rank else None
    state, *conv_states = (require_contiguous(t, "KDA state") for t in ins[6 + nweights:
                                                                          10 + nweights])
    meta = ins[10 + nweights:]
    rows = acts[0].shape[0]
    if rows % q_len:
        raise UserError(f"kda_core: {rows} rows are not whole requests of q={q_len}")
    checks = [
        ("q/k/v width", tuple(a.shape[1] for a in acts[:3]), (width,) * 3),
        ("conv weights", tuple(conv[0].shape), (width, int(attrs["conv_kernel"]))),
        ("state", tuple(state.shape[1:]), (heads, dim, dim)),
        ("conv state", tuple(conv_states[0].shape[1:]), (width, int(attrs["conv_kernel"]) - 1)),
        ("f_b_proj", tuple(f_b.shape), (width, acts[4].shape[1])),
        ("out", tuple(out.shape), (rows, width)),
    ]
    for what, found, want in checks:
        if found != want:
            raise UserError(f"kda_core: {what} has shape {list(found)}, expected {list(want)}")
    if state.dtype != torch.float32:
        raise Declined(f"kda_core: the recurrent state must be float32, found {state.dtype}")
    if out.dim() != 2 or out.stride(1) != 1:
        raise Declined(f"kda_core: the output needs a unit column stride, found strides "
                        f"{list(out.stride())}")
    slots = require_contiguous(meta[0], "kda_state_indices")
    accepted = require_contiguous(meta[1], "num_accepted_tokens") if q_len > 1 else None
    return KdaOperands(*acts, conv, f_b, dt_bias, a_log, o_norm, g_b, state,  # type: ignore[arg-type]
                       tuple(conv_states), slots, accepted, out, fills)  # type: ignore[arg-type]


@dataclass
class KdaScratch:
    """The step's intermediate tensors (float32): q, k, v, g [rows, H, D], beta [rows, H],
    o [rows, H, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    o: torch.Tensor


def kda_scratch(device: torch.device, rows: int, heads: int, dim: int) -> KdaScratch:
    """Shared scratch for one launch of ``rows`` rows."""
    size = rows * heads * dim
    parts = [scratch(device, f"kda.{name}", size, torch.float32).view(rows, heads, dim)
             for name in ("q", "k", "v", "g", "o")]
    beta = scratch(device, "kda.beta", rows * heads, torch.float32).view(rows, heads)
    return KdaScratch(parts[0], parts[1], parts[2], parts[3], beta, parts[4])


def kda_launch(attrs: dict[str, Any], ins: list[torch.Tensor], out: torch.Tensor,
               device: torch.device, pdl: bool, tactic: dict[str, Any] | None = None,
               recurrence: str = "triton") -> Launch:
    """The launch of one kda_core node over bound tensors: ``recurrence`` ``triton`` (ours)
    or ``fla`` (fla-core's fused_recurrent_kda)."""
    ops = kda_operands(attrs, ins, out)
    heads, dim = int(attrs["heads"]), int(attrs["head_dim"])
    q_len = int(attrs.get("q", 1))
    rows = out.shape[0]
    work = kda_scratch(device, rows, heads, dim)
    use_pdl = pdl_allowed(pdl, device)
    tactic = dict(tactic or {})
    # 32: k3-rank-tp8 B=1 (eleventh session) 16 1506.7-1508.7 us, 32 1505.2-1508.8, 64
    # 1510.6-1512.8 (docs/perf.md)
    block_v = int(tactic.get("block_v", 32))
    warps = int(tactic.get("num_warps", 4))
    gate_kernel = rows >= int(tactic.get("gate_rows", GATE_KERNEL_ROWS))
    prep_inside = (bool(int(tactic.get("prep_inside", 0))) and recurrence == "triton"
                   and q_len == 1 and not gate_kernel
                   and ops.f_b.shape[1] <= kernels.FB_PRE_RANK)
    conv_update = (kernels.ConvUpdate((ops.q, ops.k, ops.v), ops.conv_states, ops.slots)
                   if prep_inside else None)
    dot_f32 = dot_in_f32(ops.f_b.dtype)
    common = dict(heads=heads, head_dim=dim, q_len=q_len)
    requests = rows // q_len
    fla_slots = fla_accepted = None
    out_norm: kernels.OutNorm | None = None  # the triton recurrence runs the output norm
    recurrent: Callable[[], None]
    if recurrence == "fla":
        fla_slots = scratch(device, "kda.fla_slots", rows, torch.int32)
        fla_accepted = scratch(device, "kda.fla_accepted", requests, torch.int32)
        recurrent = _fla_recurrence(ops, work, fla_slots, fla_accepted, heads, dim, q_len)
    else:
        if int(tactic.get("out_norm", 0)) and not prep_inside:
            out_norm = kernels.OutNorm(ops.gate, ops.g_b, ops.o_norm, ops.out,
                                       requests=requests, heads=heads, eps=float(attrs["eps"]))

        def recurrent() -> None:
            if prep_inside:
                kernels.launch_prep_recurrent(
                    ops.q, ops.k, ops.v, ops.f_a, ops.b, ops.conv_weights, ops.conv_states,
                    ops.f_b, ops.dt_bias, ops.a_log, ops.state, ops.slots, work.o,
                    gate_form=attrs["gate_form"], lower_bound=attrs.get("gate_lower_bound"),
                    block_v=block_v, num_warps=warps, pdl=use_pdl, heads=heads,
                    head_dim=dim)
                return
            kernels.launch_recurrent(work.q, work.k, work.v, work.g, work.beta, ops.state,
                                     ops.slots, ops.accepted, work.o, block_v=block_v,
                                     num_warps=warps, out_norm=out_norm, pdl=use_pdl,
                                     **common)

    def launch() -> None:
        for fill in ops.fills:
            fill()
        if gate_kernel:
            kernels.launch_gate(ops.f_a, ops.f_b, ops.dt_bias, ops.a_log, work.g,
                                gate_form=attrs["gate_form"],
                                lower_bound=attrs.get("gate_lower_bound"), dot_f32=dot_f32,
                                pdl=use_pdl, heads=heads, head_dim=dim)
        if not prep_inside:
            kernels.launch_prep(
                ops.q, ops.k, ops.v, ops.f_a, ops.b, ops.conv_weights, ops.conv_states,
                ops.f_b, ops.dt_bias, ops.a_log, ops.slots, ops.accepted,
                (work.q, work.k, work.v, work.g, work.beta), gate_form=attrs["gate_form"],
                lower_bound=attrs.get("gate_lower_bound"), fla_slots=fla_slots,
                fla_accepted=fla_accepted, gate=not gate_kernel, pdl=use_pdl, **common)
        recurrent()
        if out_norm is None:
            kernels.launch_out_norm(work.o, ops.gate, ops.g_b, ops.o_norm, ops.out,
                                    eps=float(attrs["eps"]), conv=conv_update, pdl=use_pdl,
                                    heads=heads, head_dim=dim)

    return launch


def _fla_recurrence(ops: KdaOperands, work: KdaScratch, fla_slots: torch.Tensor,
                    fla_accepted: torch.Tensor, heads: int, dim: int, q_len: int
                    ) -> Callable[[], None]:
    """fla-core's fused recurrent KDA, in place on the state pool (prepared arguments)."""
    requests = work.q.shape[0] // q_len
    shape = (requests, q_len, heads, dim)
    indices = fla_slots.view(requests, q_len) if q_len > 1 else fla_slots
    kwargs = dict(
        q=work.q.view(shape), k=work.k.view(shape), v=work.v.view(shape),
        g=work.g.view(shape), beta=work.beta.view(requests, q_len, heads),
        scale=dim**-0.5, initial_state=ops.state, inplace_final_state=True,
        ssm_state_indices=indices,
        num_accepted_tokens=fla_accepted if q_len > 1 else None,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False, out=work.o.view(shape),
    )

    forward = fla_forward()
    assert forward is not None, "the fla factory declines when fla-core is unusable"

    def run() -> None:
        forward(**kwargs)

    return run


FLA_MIN_HEAD_DIM = 64


def _factory(recurrence: str) -> Callable[[PrepareContext], Launch]:
    def factory(ctx: PrepareContext) -> Launch:
        dim = int(ctx.node.attrs["head_dim"])
        if recurrence == "fla" and fla_forward() is None:
            raise Declined(f"fla-core's fused_recurrent_kda_fwd does not import here or lacks "
                           f"the keywords {', '.join(FLA_KEYWORDS)} (fla-core 0.6.0 has them)")
        if recurrence == "fla" and dim < FLA_MIN_HEAD_DIM and ctx.device.type == "cuda":
            raise Declined(f"fla's fused_recurrent_kda gave wrong outputs at head_dim {dim} on "
                           f"the H200 (2026-11-30); it is used from head_dim "
                           f"{FLA_MIN_HEAD_DIM} (checked at 128)")
        (out,) = ctx.outputs()
        return kda_launch(dict(ctx.node.attrs), list(ctx.inputs()), out, ctx.device,
                          ctx.pdl, dict(ctx.tactic or {}), recurrence)

    factory.__doc__ = f"kda_core with the {recurrence} recurrence (see the module docstring)."
    return factory


register("kda_core", "triton", DEVICES, "conv/gate prep + delta rule + gated RMSNorm, Triton")(
    _factory("triton"))


@functools.cache
def fla_forward() -> Callable[..., Any] | None:
    """fla-core's Triton ``fused_recurrent_kda_fwd`` when importable with the keywords used
    here: the function itself, unwrapped from fla's backend dispatch (which could route to
    another backend) and its torch.compile guard. Imported on first use: importing fla-core
    compiles hundreds of Triton functions' sources (~7 s), which a run that never prepares
    this provider (any CPU run) should not pay."""
    try:
        with warnings.catch_warnings():
            # fla-core warns at import on a machine without a GPU; the provider is CUDA-only
            warnings.filterwarnings("ignore", message="Triton is not supported on current")
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # fla-core missing or broken here: no fla provider
        return None
    function = inspect.unwrap(fused_recurrent_kda_fwd)
    params = inspect.signature(function).parameters
    if not all(name in params for name in FLA_KEYWORDS):
        return None
    return function


FLA_KEYWORDS = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "out",
                "use_gate_in_kernel", "use_beta_sigmoid_in_kernel")

if importlib.util.find_spec("fla") is not None:
    register("kda_core", "fla_fused_recurrent", DEVICES,
             "our prep/norm kernels around fla-core's fused_recurrent_kda")(_factory("fla"))
