"""The collective providers and the two sharded compute forms of a multi-rank plan.

Registered for every collective op under ``torch`` (so the last-resort provider runs them
too), ``torch_distributed`` (the portable tables' name) and ``nccl`` (the H200 table's):
over one rank each is a copy; over more it calls the step's
:class:`~stepgraph.runtime.comm.Communicator` (``ctx.comm``). With NCCL the launches are
captured into the bins' CUDA graphs like any kernel.

What each op means (the IR's, see ``stepgraph.ir.ops``; R rows, n ranks of the group):

* ``all_reduce`` [R, C]: the sum over the group;
* ``all_gather`` [R, c] -> [R, n c]: the members' columns side by side;
* ``reduce_scatter`` [R, n c] -> [R, c]: this member's columns of the sum;
* ``dcp_gather`` [R, h, D] -> [R, n h, D]: every member's query heads;
* ``lse_merge`` (o [R, n h, D], lse [R, n h]) -> [R, h, D]: the partial attentions of the
  members' cache shards merged by their log-sum-exp, this member's heads kept; the lse are
  all-gathered (small), each member scales its own partial by ``exp(lse - lse_total)`` and
  a reduce-scatter over heads sums them (half the bytes of gathering every partial);
* ``ep_dispatch`` (x, ids, weights) [R, ...] -> [n R, ...]: every member's rows;
* ``ep_combine`` [n R, C] -> [R, C]: the sum over members of this member's rows.

The sharded compute forms: the vocab-parallel embedding (rows outside this member's part of
the vocabulary are zero; an all-reduce follows) and the RMSNorm of a row split over the
group (the mean square is all-reduced before the scale).

Rows are a collective's dimension 0, so a gather or scatter over columns stages through a
contiguous [n, R, ...] buffer; at one row the layouts coincide and the collective reads or
writes the node's tensors directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stepgraph.errors import UserError
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register

MULTI_RANK = ("runs over {ways} ranks, but the step was loaded without a communicator: load "
              "it with rank/world (stepgraph.runtime.load(..., comm=...)) or start the ranks "
              "with --nproc")
NAMES = ("torch", "torch_distributed", "nccl")
DEVICES = ("cuda", "cpu")


def ways_of(ctx: PrepareContext) -> int:
    """The group size of the context's node (1: no group)."""
    return int(ctx.node.attrs.get("ways", 1))


def comm_of(ctx: PrepareContext, ways: int) -> Communicator:
    """The step's communicator; a one-line error when the step has none."""
    comm = getattr(ctx, "comm", None)
    if comm is None:
        raise UserError(f"node {ctx.node.name} ({ctx.node.op}) "
                        + MULTI_RANK.format(ways=ways))
    if ways > comm.world:
        raise UserError(f"node {ctx.node.name} runs over {ways} ranks; the world has "
                        f"{comm.world}")
    return comm


def _staged_source(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                  Callable[[], None]]:
    """``x`` itself when contiguous and of ``dtype``, else a contiguous ``dtype`` buffer and
    the copy that fills it (run in the launch: a collective's two sides share one dtype)."""
    if x.is_contiguous() and x.dtype == dtype:
        return x, lambda: None
    buffer = torch.empty(x.shape, dtype=dtype, device=x.device)
    return buffer, lambda: buffer.copy_(x)


def _contiguous_target(out: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """``out`` itself when contiguous, else a contiguous buffer and the copy back."""
    if out.is_contiguous():
        return out, lambda: None
    buffer = torch.empty_like(out, memory_format=torch.contiguous_format)
    return buffer, lambda: out.copy_(buffer)


def _collective(build: Callable[[PrepareContext, Communicator, int], Launch]
                ) -> Callable[[PrepareContext], Launch]:
    """A factory: a copy over one rank, ``build(ctx, comm, ways)`` over more."""

    def factory(ctx: PrepareContext) -> Launch:
        ways = ways_of(ctx)
        if ways == 1:
            pairs = list(zip(ctx.inputs(), ctx.outputs(), strict=False))

            def copy() -> None:
                for source, out in pairs:
                    out.copy_(source)

            return copy
        return build(ctx, comm_of(ctx, ways), ways)

    factory.__doc__ = build.__doc__
    return factory


def _register(op: str, build: Callable[[PrepareContext, Communicator, int], Launch]) -> None:
    factory = _collective(build)
    for name in NAMES:
        register(op, name, DEVICES, note="torch.distributed (NCCL on CUDA, Gloo on CPU); "
                                         "one rank: a copy")(factory)


# ---------------------------------------------------------------------- the collectives


def all_reduce(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """The group's sum, in the output."""
    (x,), (out,) = ctx.inputs(), ctx.outputs()
    target, back = _contiguous_target(out)

    def launch() -> None:
        target.copy_(x)
        comm.all_reduce(target, ways)
        back()

    return launch


def gather_columns(x: torch.Tensor, out: torch.Tensor, comm: Communicator, ways: int,
                   axis: int) -> Launch:
    """``out`` = the members' ``x`` concatenated along ``axis`` (1 for [R, c] columns or
    [R, h, D] heads); ``out``'s dimension ``axis`` is ``ways`` times ``x``'s."""
    rows = x.shape[0]
    source, stage_source = _staged_source(x, out.dtype)
    if rows == 1 and out.is_contiguous():
        flat = out.view(ways, *x.shape)

        def direct() -> None:
            stage_source()
            comm.all_gather_rows(flat.view(ways * rows, *x.shape[1:]), source, ways)

        return direct
    stage = torch.empty((ways, *x.shape), dtype=out.dtype, device=x.device)
    split = out.view(*out.shape[:axis], ways, x.shape[axis], *out.shape[axis + 1:])

    def launch() -> None:
        stage_source()
        comm.all_gather_rows(stage.view(ways * rows, *x.shape[1:]), source, ways)
        split.copy_(stage.movedim(0, axis))

    return launch


def scatter_columns(x: torch.Tensor, out: torch.Tensor, comm: Communicator, ways: int,
                    axis: int) -> Launch:
    """``out`` = this member's block along ``axis`` of the group's sum of ``x``."""
    rows = x.shape[0]
    part = (*x.shape[:axis], ways, x.shape[axis] // ways, *x.shape[axis + 1:])
    stage = torch.empty((ways, *out.shape), dtype=x.dtype, device=x.device)
    if out.dtype != x.dtype:
        target = torch.empty(out.shape, dtype=x.dtype, device=x.device)

        def back() -> None:
            out.copy_(target)
    else:
        target, back = _contiguous_target(out)

    def launch() -> None:
        stage.copy_(x.reshape(part).movedim(axis, 0))
        comm.reduce_scatter_rows(target, stage.view(ways * rows, *out.shape[1:]), ways)
        back()

    return launch


def all_gather(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """The members' columns side by side."""
    (x,), (out,) = ctx.inputs(), ctx.outputs()
    return gather_columns(x, out, comm, ways, axis=1)


def reduce_scatter(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """This member's columns of the group's sum."""
    (x,), (out,) = ctx.inputs(), ctx.outputs()
    return scatter_columns(x, out, comm, ways, axis=1)


def dcp_gather(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """Every member's query heads."""
    (x,), (out,) = ctx.inputs(), ctx.outputs()
    return gather_columns(x, out, comm, ways, axis=1)


def lse_merge(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """The members' partial attentions merged by log-sum-exp; this member's heads."""
    (o, lse), (out,) = ctx.inputs(), ctx.outputs()
    rows = o.shape[0]
    lse_local = lse if lse.is_contiguous() else torch.empty_like(
        lse, memory_format=torch.contiguous_format)
    gathered = torch.empty((ways * rows, *lse.shape[1:]), dtype=torch.float32, device=o.device)
    scaled = torch.empty(o.shape, dtype=torch.float32, device=o.device)
    scatter = scatter_columns(scaled, out, comm, ways, axis=1)

    def launch() -> None:
        if lse_local is not lse:
            lse_local.copy_(lse)
        comm.all_gather_rows(gathered, lse_local.float(), ways)
        every = gathered.view(ways, *lse.shape)
        top = every.amax(0)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        total = top + torch.log(torch.exp(every - top).sum(0))
        weight = torch.exp(lse.float() - total).nan_to_num_(0.0)  # no tokens anywhere: 0
        torch.mul(o.float(), weight.unsqueeze(-1), out=scaled)
        scatter()

    return launch


def ep_dispatch(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """Every member's rows (latent, expert ids, expert weights) stacked in member order."""
    pairs = []
    for x, out in zip(ctx.inputs(), ctx.outputs(), strict=True):
        source, stage = _staged_source(x, out.dtype)
        target, back = _contiguous_target(out)
        pairs.append((stage, source, target, back))

    def launch() -> None:
        for stage, source, target, back in pairs:
            stage()
            comm.all_gather_rows(target, source, ways)
            back()

    return launch


def ep_combine(ctx: PrepareContext, comm: Communicator, ways: int) -> Launch:
    """The sum over members of this member's rows."""
    (x,), (out,) = ctx.inputs(), ctx.outputs()
    # NCCL reads its input only; Gloo sums in place, so it works on a copy.
    if comm.is_nccl:
        source, stage = _staged_source(x, out.dtype)
    else:
        source = torch.empty(x.shape, dtype=out.dtype, device=x.device)

        def stage() -> None:
            source.copy_(x)
    target, back = _contiguous_target(out)

    def launch() -> None:
        stage()
        comm.reduce_scatter_rows(target, source, ways)
        back()

    return launch


for _op, _build in (("all_reduce", all_reduce), ("all_gather", all_gather),
                    ("reduce_scatter", reduce_scatter), ("dcp_gather", dcp_gather),
                    ("lse_merge", lse_merge), ("ep_dispatch", ep_dispatch),
                    ("ep_combine", ep_combine)):
    _register(_op, _build)


# ---------------------------------------------------------------------- sharded compute


def vocab_parallel_embed(ctx: PrepareContext) -> Launch:
    """Rows of this member's part of the embedding table; tokens outside it give zeros
    (the all-reduce that follows sums the members' rows)."""
    split = ctx.node.attrs["vocab_split"]
    ways, part = int(split["ways"]), int(split["rows"])
    offset = comm_of(ctx, ways).member(ways) * part
    tokens, table = ctx.inputs()
    (out,) = ctx.outputs()

    def launch() -> None:
        local = tokens.long() - offset
        inside = (local >= 0) & (local < part)
        rows = table.index_select(0, local.clamp(0, part - 1))
        torch.mul(rows, inside.unsqueeze(-1).to(rows.dtype), out=out)

    return launch


def sharded_rmsnorm(ctx: PrepareContext) -> Launch:
    """RMSNorm of rows split over the group: each member's sum of squares is all-reduced,
    then each member scales its own columns."""
    ways = ways_of(ctx)
    comm = comm_of(ctx, ways)
    x, weight = ctx.inputs()
    (out,) = ctx.outputs()
    width = x.shape[-1] * ways
    eps = float(ctx.node.attrs["eps"])
    squares = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)

    def launch() -> None:
        torch.sum(x.float().square(), dim=-1, keepdim=True, out=squares)
        comm.all_reduce(squares, ways)
        scale = torch.rsqrt(squares / width + eps)
        out.copy_(x.float() * scale * weight.float())

    return launch
