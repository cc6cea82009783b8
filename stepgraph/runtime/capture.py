"""Preparing and capturing a bin: the provider of every node (the bin pass's decision, else the
next available in the op's preference order, else ``torch``), its launch, a warm-up, and one
CUDA graph per bin.

A provider factory that raises ``NotImplementedError`` declines the node (a shape or
attribute it does not handle); the next candidate is tried and the reason is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.memory.liveness import side_branches
from stepgraph.passes.pdl import uses_pdl_at
from stepgraph.runtime.binding import regroup_launches
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.kernels.launch_utils import scratch, scratch_namespace
from stepgraph.runtime.kernels.sync import signal_kernel
from stepgraph.runtime.providers.registry import (
    REGISTRY,
    Launch,
    Registry,
    candidates,
)
from stepgraph.runtime.side_stream import fork, fork_empty, join


@dataclass
class BinContext:
    """What a provider factory sees for one node at one bin (a
    :class:`~stepgraph.runtime.providers.registry.PrepareContext`), plus the step's compute
    ``dtype``, the ``graph`` and, for a multi-rank step, its communicator ``comm``;
    ``pre_wait``: the inputs it may read before its PDL wait (the pdl pass's
    ``pre_wait_inputs``; empty without PDL); ``wait_flag``: the flag of a side-stream branch
    the node reads (the streams pass's ``signal``), for a launch that can wait on it instead
    of a graph join (it sets its ``awaits`` to the flag; else the runtime joins)."""

    node: Node
    rows: int
    tactic: Mapping[str, Any]
    pdl: bool
    device: torch.device
    dtype: torch.dtype
    graph: Graph
    bound: Mapping[str, torch.Tensor]
    comm: Communicator | None = None
    pre_wait: frozenset[str] = frozenset()
    wait_flag: torch.Tensor | None = None  # a signalled branch's flag this launch waits on

    def tensor(self, name: str) -> torch.Tensor:
        """The bound tensor of value ``name``."""
        return self.bound[name]

    def inputs(self) -> list[torch.Tensor]:
        """The node's input tensors in order."""
        return [self.bound[name] for name in self.node.inputs]

    def outputs(self) -> list[torch.Tensor]:
        """The node's output tensors in order."""
        return [self.bound[name] for name in self.node.outputs]


@dataclass(frozen=True)
class Choice:
    """The provider a node runs with at a bin: ``wanted`` (the plan's decision) and
    ``provider`` (the one used), with ``reason`` when they differ."""

    node: str
    op: str
    rows: int
    wanted: str
    provider: str
    pdl: bool
    reason: str = ""


@dataclass
class BinPlan:
    """A bin's launches in program order, the provider choices, and its CUDA graph once
    captured."""

    rows: int
    launches: list[Launch]
    choices: list[Choice]
    graph: Any = None  # torch.cuda.CUDAGraph
    names: list[str] = field(default_factory=list)
    device: torch.device | None = None  # where forked launches are joined (None: none)
    root_fork: bool = False  # an empty launch forked onto the side stream first

    def run_eager(self) -> None:
        """Enqueue every launch (no graph; the root fork first), then join the side
        stream's forked launches."""
        if self.root_fork and self.device is not None:
            fork_empty(self.device)
        for launch in self.launches:
            launch()
        if self.device is not None:
            join(self.device)


def decision(graph: Graph, node: Node, rows: int) -> tuple[str | None, Mapping[str, Any]]:
    """The bin pass's provider and tactic for ``node`` at ``rows`` (None: no decision)."""
    per_bin = graph.meta.get("decisions", {}).get(node.name, {})
    chosen = per_bin.get(str(rows))
    if chosen is None:
        return None, {}
    return chosen.get("provider"), chosen.get("tactic") or {}


def node_pdl(graph: Graph, node: Node, rows: int, enabled: bool) -> bool:
    """Whether ``node`` may launch with PDL at bin ``rows`` (the pdl pass's mark)."""
    return enabled and uses_pdl_at(graph.meta.get("pdl", {}).get(node.name), str(rows))


def node_pre_wait(graph: Graph, node: Node) -> frozenset[str]:
    """The inputs ``node`` may read before its PDL wait (the pdl pass's mark)."""
    entry = graph.meta.get("pdl", {}).get(node.name) or {}
    return frozenset(entry.get("pre_wait_inputs", ()))


def prepare_node(ctx: BinContext, wanted: str | None, preference: Sequence[str],
                 registry: Registry = REGISTRY, allowed: Collection[str] | None = None
                 ) -> tuple[Launch, Choice]:
    """The launch of ``ctx.node`` from the first candidate that accepts it, and the choice;
    ``allowed`` restricts the candidates to these provider names (``torch`` always stays)."""
    node = ctx.node
    label = wanted or (preference[0] if preference else "torch")
    reasons = []
    entry = registry.get(node.op, label)
    if entry is None:
        reasons.append(f"{label} is not registered for {node.op}")
    elif ctx.device.type not in entry.devices:
        reasons.append(f"{label} does not run on {ctx.device.type}")
    elif allowed is not None and label not in allowed and label != "torch":
        reasons.append(f"{label} is excluded by providers={sorted(allowed)}")
    found = candidates(node.op, label, preference, ctx.device.type, registry)
    if allowed is not None:
        found = [e for e in found if e.provider in allowed or e.provider == "torch"]
    for entry in found:
        try:
            launch = entry.factory(ctx)
        except NotImplementedError as error:
            reasons.append(f"{entry.provider} declined: {error}")
            continue
        except Exception as error:
            error.add_note(f"while preparing node {node.name} ({node.op}) at bin {ctx.rows} "
                           f"with provider {entry.provider}")
            raise
        return launch, Choice(node.name, node.op, ctx.rows, label, entry.provider, ctx.pdl,
                              "; ".join(reasons))
    raise LookupError(f"no provider of op {node.op!r} runs node {node.name} on "
                      f"{ctx.device.type} ({'; '.join(reasons) or 'none registered'})")


def prepare_bin(graph: Graph, rows: int, bound: Mapping[str, torch.Tensor],
                device: torch.device, dtype: torch.dtype,
                preferences: Callable[[str], Sequence[str]], pdl: bool,
                advance: Callable[[int, str], None] | None = None,
                registry: Registry = REGISTRY, allowed: Collection[str] | None = None,
                comm: Communicator | None = None,
                kept: Mapping[str, torch.Tensor] | None = None) -> BinPlan:
    """Every node's launch at bin ``rows`` in program order (``preferences(op)``: the op's
    providers from the tactic tables, preferred first; ``allowed``: see
    :func:`prepare_node`; ``comm``: the ranks of a multi-rank step; ``kept``: buffers that
    keep a copy of these temps' first ``rows`` rows after the step). A node whose output has
    views of column groups refreshes their buffers right after it runs."""
    launches, choices = [], []
    regroups = regroup_launches(graph, bound)
    for name, buffer in (kept or {}).items():
        regroups.setdefault(name, []).append(
            lambda src=bound[name], dst=buffer[:rows]: dst.copy_(src))
    side = device_side_branches(graph, device)
    joins = {join for join in side.values() if join is not None}
    flags = signal_flags(graph, side, device)
    branch_of = {side[name]: name for name in flags}  # reader -> its signalled branch
    # a branch sets its flag only if its reader's launch waits on it (decided later, when
    # the reader is prepared): a flag set and never cleared would release a later wait early
    signals: dict[str, list[Launch]] = {name: [] for name in flags}
    for node in graph:
        wanted, tactic = decision(graph, node, rows)
        node_uses_pdl = node_pdl(graph, node, rows, pdl)
        ctx = BinContext(node, rows, tactic, node_uses_pdl, device, dtype, graph, bound, comm,
                         node_pre_wait(graph, node) if node_uses_pdl else frozenset(),
                         flags.get(branch_of.get(node.name, "")))
        with scratch_namespace("side" if node.name in side else ""):
            launch, choice = prepare_node(ctx, wanted, preferences(node.op), registry,
                                          allowed)
        waited = ctx.wait_flag is not None and getattr(launch, "awaits", None) is ctx.wait_flag
        refresh = [copy for name in node.outputs for copy in regroups.get(name, ())]
        if refresh:
            launch = _then(launch, refresh)
        if node.name in flags:
            launch = _then(launch, signals[node.name])
        if node.name in side:
            launch = _forked(launch, device)
        if waited:
            signals[branch_of[node.name]].append(partial(signal, ctx.wait_flag))
        if node.name in joins and not waited:
            launch = _joined(launch, device)
        launches.append(launch)
        choices.append(choice)
        if advance is not None:
            advance(1, f"bin {rows}: {node.name}")
    root_fork = bool(side) and bool(graph.meta.get("streams", {}).get("root_fork"))
    return BinPlan(rows, launches, choices, names=[n.name for n in graph], device=device,
                   root_fork=root_fork)


def signal_flags(graph: Graph, side: Mapping[str, str | None], device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """The streams pass's signalled branches (``meta["streams"]["signal"]``) -> the flag
    (int32 [2], zeroed, one a branch) its last launch sets and its reader waits on; a
    reader that more than one branch joins before keeps its graph joins."""
    if not graph.meta.get("streams", {}).get("signal"):
        return {}
    readers = [join for join in side.values() if join is not None]
    return {name: scratch(device, f"streams.signal.{name}", 2, torch.int32, zeroed=True)
            for name, join in side.items() if join is not None and readers.count(join) == 1}


def signal(flag: torch.Tensor) -> None:
    """Set a signalled branch's flag, on the current (side) stream after its last launch."""
    signal_kernel[(1,)](flag)


def device_side_branches(graph: Graph, device: torch.device) -> dict[str, str | None]:
    """The streams pass's side-stream nodes -> the node their branch joins before (None:
    the step's end); none off CUDA, where every launch runs in program order."""
    return side_branches(graph) if device.type == "cuda" else {}


def _forked(launch: Launch, device: torch.device) -> Launch:
    def run() -> None:
        fork(device, launch)

    return run


def _joined(launch: Launch, device: torch.device) -> Launch:
    def run() -> None:
        join(device)
        launch()

    return run


def _then(launch: Launch, more: Sequence[Launch]) -> Launch:
    def run() -> None:
        launch()
        for extra in more:
            extra()

    return run


def warm(plan: BinPlan, device: torch.device, times: int = 1) -> None:
    """Run the bin's launches ``times`` times (on a side stream on CUDA, as capture wants)."""
    if device.type != "cuda":
        for _ in range(times):
            plan.run_eager()
        return
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(times):
            plan.run_eager()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


def capture(plan: BinPlan, pool: Any, thread_local: bool = False) -> None:
    """Capture the bin's launches into one CUDA graph in memory pool ``pool``;
    ``thread_local``: only this thread's CUDA calls must be capture-safe (a multi-rank step:
    the NCCL watchdog thread keeps polling while a rank captures)."""
    graph = torch.cuda.CUDAGraph()
    mode = "thread_local" if thread_local else "global"
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        plan.run_eager()
    plan.graph = graph
