"""The benchmark of a multi-rank step (``stepgraph bench ARTIFACT --nproc N``): run in every
rank by the launcher, all ranks in lockstep.

Per rank, on seeded device random weights (one copy, shared by every mode):

1. **check**: fresh requests decoded through the compiled step at every chosen bin against
   the reference executor on the full weights (:mod:`stepgraph.runtime.rank_check`); a bin
   whose check fails reports the failure instead of times;
2. **floor**: the bytes this rank's plan moves at the bin (the experts the step's real
   routing touched, read from the expert launches' ids as they run), over the copy
   bandwidth measured in the same run;
3. **stepgraph**: replays of the bin's CUDA graph (collectives inside), inputs rotating over
   ``sets`` input sets, random caches of ``context`` tokens a request (split over the DCP
   ranks);
4. **no collectives**: the same step loaded with every collective a no-op (numerically
   meaningless): the difference to (3) is the time the collectives cost;
5. **eager**: the plan's ops as plain torch ops and NCCL calls, no graph (the torch
   providers; what an eager PyTorch implementation of the sharded step launches).

torch.compile(mode="reduce-overhead") is not run over ranks: the single-GPU bench found it
skips CUDA graphs on this step (the step mutates its caches) and recompiles per row count;
over ranks the NCCL calls add graph breaks. The report says so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.floor import step_bytes
from stepgraph.bench.protocol import (
    build_feeds,
    copy_bandwidth,
    fill_caches,
    router_ids,
    time_calls,
    touched_experts,
)
from stepgraph.bench.table import floor_bar
from stepgraph.bench.weights import device_random_weights
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.inputs import StepInputs
from stepgraph.runtime.loader import load
from stepgraph.runtime.providers import REGISTRY, load_providers
from stepgraph.runtime.providers.registry import Launch, PrepareContext, ProviderEntry, Registry
from stepgraph.runtime.rank_check import RankCheckOptions, compare_with_reference, rank_device
from stepgraph.runtime.step import CompiledStep

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "dcp_gather", "lse_merge",
               "ep_dispatch", "ep_combine")
TORCH_COMPILE_NOTE = ("torch.compile: not run over ranks (on one GPU it skips CUDA graphs "
                      "because the step mutates its caches, and recompiles per row count)")


@dataclass(frozen=True)
class RankBenchOptions:
    """Bins (None: all), timed replays and untimed warm-up calls, context tokens a request,
    input sets, seed, check steps, and whether to run the ablation and eager modes."""

    batches: tuple[int, ...] | None = None
    replays: int = 50
    warmup: int = 5
    context: int = 4096
    sets: int = 4
    seed: int = 0
    check_steps: int = 3
    ablation: bool = True
    eager: bool = True


@dataclass
class RankBin:
    """One rank's results at one bin (times in microseconds, medians)."""

    rows: int
    check_error: float = math.nan
    bf16_reference_error: float = math.nan
    check_nan: bool = False
    floor_us: float = math.nan
    step_bytes: int = 0
    stepgraph_us: float = math.nan
    no_collectives_us: float = math.nan
    eager_us: float = math.nan

    check_passed: bool = False
    routing_flips: int = 0

    @property
    def check_failed(self) -> bool:
        """Whether the numerical check failed (see ``RankCheck.passed``)."""
        return not self.check_passed


@dataclass
class RankBench:
    """One rank's benchmark: device, bandwidth, the bins, notes."""

    rank: int
    device: str
    bandwidth: float
    bins: list[RankBin] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return asdict(self)


def noop_collectives() -> Registry:
    """The provider registry with every collective a no-op (the ablation)."""
    load_providers()
    registry = Registry(dict(REGISTRY.entries))

    def nothing(ctx: PrepareContext) -> Launch:
        return lambda: None

    for op in COLLECTIVES:
        for (entry_op, name), _ in list(registry.entries.items()):
            if entry_op == op:
                registry.add(ProviderEntry(op, name, nothing, ("cuda", "cpu"), "ablation"))
    return registry


def touched_experts_of(compiled: CompiledStep, size: int) -> dict[str, int]:
    """Distinct local experts each routed-experts launch touches for the bin's current
    inputs (every row real): the bin's launches run eagerly once and each expert launch's
    ids are copied just before it runs (the arena reuses their bytes later in the step)."""
    plan = compiled.plan(size)
    bound = compiled.bindings.for_bin(size)
    nodes = {node.name: node for node in compiled.graph}
    seen: dict[str, torch.Tensor] = {}
    for name, launch in zip(plan.names, plan.launches, strict=True):
        node = nodes[name]
        if node.op == "routed_experts":
            seen[node.inputs[1]] = bound[node.inputs[1]].clone()
        launch()
    rows = max((ids.shape[0] for ids in seen.values()), default=size)  # dispatched: n x size
    return touched_experts(compiled.graph, seen, rows)


def _median(call: Any, args: list[Any], options: RankBenchOptions, comm: Communicator,
            device: torch.device) -> float:
    comm.barrier()
    times = time_calls(call, args, options.replays, options.warmup, device)
    return float(np.median(times))


def run_rank_bench(comm: Communicator, artifact_path: str, options: RankBenchOptions
                   ) -> RankBench:
    """This rank's benchmark (see the module docstring)."""
    artifact = load_artifact(artifact_path)
    graph, document = artifact.graph, artifact.document
    device = rank_device("cuda")
    deployment = document["deployment"]
    dcp = int(deployment.get("dcp", 1))
    bins = sorted(int(b) for b in deployment["batches"])
    chosen = [b for b in bins if options.batches is None or b in options.batches]
    weights = device_random_weights(graph, options.seed, torch.bfloat16, device, comm.rank)
    q = int(deployment.get("q", 1))
    common = dict(weights=weights, device=device, dtype="bfloat16", comm=comm,
                  max_context=options.context, block_size=64, progress=comm.rank == 0,
                  max_requests=options.sets * max(chosen) // q)  # the input sets' requests
    compiled = load(artifact, **common, keep=list(router_ids(graph).values()))
    checks = compare_with_reference(compiled, comm, document, RankCheckOptions(
        seed=options.seed, steps=options.check_steps, bins=tuple(chosen),
        block_size=compiled.block_size))
    bench = RankBench(comm.rank, torch.cuda.get_device_name(device), copy_bandwidth(device),
                      notes=[TORCH_COMPILE_NOTE])
    fill_caches(compiled.caches, options.seed)
    ablated = load(artifact, **common, registry=noop_collectives()) if options.ablation \
        else None
    eager = load(artifact, **common, capture=False, providers=("torch", "cublas")) \
        if options.eager else None
    local_context = max(options.context // dcp, 1)
    with torch.inference_mode():
        for size in chosen:
            result = RankBin(size, checks.errors[size],
                             checks.bf16_reference.get(size, math.nan), checks.nan[size],
                             check_passed=checks.passed(size),
                             routing_flips=checks.flips.get(size, 0))
            bench.bins.append(result)
            feeds = build_feeds(size, compiled.q, options.sets, local_context,
                                compiled.block_size, compiled.limits.width,
                                compiled.limits.vocab, options.seed)
            inputs = [StepInputs.from_feed(f) for f in feeds]
            compiled.filler.fill(inputs[0], size)
            nbytes = step_bytes(compiled.graph, size, options.context,
                                touched_experts_of(compiled, size),
                                compiled.block_size)
            result.step_bytes = nbytes.total
            result.floor_us = nbytes.floor_us(bench.bandwidth)
            if result.check_failed:
                continue
            for name, step in (("stepgraph_us", compiled), ("no_collectives_us", ablated),
                               ("eager_us", eager)):
                if step is None:
                    continue

                def call(inp: StepInputs, step: CompiledStep = step, size: int = size) -> None:
                    step.filler.fill(inp, size)
                    step.replay(size)

                setattr(result, name, _median(call, inputs, options, comm, device))
    return bench


def format_rank_bench(results: list[RankBench], header: str) -> str:
    """The Markdown report: per bin the slowest rank's medians, the floor (largest over
    ranks), the check, the collectives' time (stepgraph minus no-collectives)."""
    lines = [header, "", f"device: {results[0].device} x {len(results)}; copy bandwidth "
             f"{min(r.bandwidth for r in results) / 1e12:.2f} TB/s (slowest rank)", ""]
    head = ["B", "check (max over ranks)", "bf16 ref", "flips", "floor us", "stepgraph us",
            "floor/time", "of the floor", "no-collectives us", "collectives us", "eager us",
            "eager/stepgraph"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for index, first in enumerate(results[0].bins):
        per = [r.bins[index] for r in results]
        error = max(b.check_error for b in per)
        noise = max(b.bf16_reference_error for b in per)
        failed = any(b.check_failed for b in per)
        floor = max(b.floor_us for b in per)
        step = max(b.stepgraph_us for b in per)
        ablated = max(b.no_collectives_us for b in per)
        eager = max(b.eager_us for b in per)
        check = f"{error:.2e}" + (" FAILED" if failed else "")
        flips = max(b.routing_flips for b in per)
        timed = (["-"] * 3 if failed else
                 [f"{step:.1f}", f"{100 * floor / step:.1f} %", f"`{floor_bar(floor / step)}`"])
        cells = [str(first.rows), check, f"{noise:.2e}", str(flips), f"{floor:.1f}", *timed,
                 _us(ablated), _us(step - ablated), _us(eager),
                 "-" if math.isnan(eager) or failed else f"{eager / step:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {note}" for note in results[0].notes)]
    return "\n".join(lines) + "\n"


def _us(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"
