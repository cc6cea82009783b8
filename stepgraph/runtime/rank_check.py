"""The multi-rank correctness check: a compiled multi-rank step against the single-GPU
reference executor on the same full weights.

Run in every rank (through :func:`stepgraph.runtime.launch.launch`): each rank loads its
shard of seeded random weights and its caches, decodes fresh requests through the compiled
step (every bin: as many requests as the bin holds, ``steps`` tokens each, CUDA graphs
replayed where captured), and compares its requests' logits with the reference executor's,
which runs the world-of-one graph of the same spec over the full weights (every rank's
requests where the ranks are data-parallel), in float32 over the same (BF16-rounded) weight
values.

Routing: a router's top-k is a discrete choice, and on random weights many rows have experts
within BF16 rounding of each other, so a BF16 step and a float32 one pick different experts
for some rows and those rows' logits then differ by far more than rounding (tens of percent
on tiny_k3). As in the single-GPU bench (:class:`stepgraph.bench.protocol.Routing`), the
reference runs each step on the compiled step's expert choices (its routers' ids, kept by the
step), and the check reports how many row decisions the reference would have made
differently (``flips``).

The error of a bin is ``||out - ref|| / ||ref||`` over every logit of its requests and steps.
With ``dtype`` bfloat16 the check also runs the reference executor itself in BF16 on the same
routing, whose error is the model's BF16 noise floor at these weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.protocol import Routing, fp32_reference, relative_error, router_ids
from stepgraph.bench.table import CHECK_LIMIT, NOISE_FACTOR, within_bf16_criterion
from stepgraph.bench.weights import device_random_weights
from stepgraph.errors import UserError
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.lower.decode import DecodeRunner
from stepgraph.lower.tensors import compute_dtype
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.decode import CompiledDecodeRunner
from stepgraph.runtime.loader import load
from stepgraph.runtime.step import CompiledStep
from stepgraph.spec import Deployment, Model

LIMIT = CHECK_LIMIT


@dataclass(frozen=True)
class RankCheckOptions:
    """What to check: ``dtype`` of the compiled step, ``seed`` of weights and prompts,
    ``steps`` tokens a request, ``bins`` (default: all), ``capture`` CUDA graphs,
    ``device`` (``cuda`` or ``cpu``)."""

    dtype: str = "bfloat16"
    seed: int = 0
    steps: int = 4
    bins: tuple[int, ...] | None = None
    capture: bool = True
    device: str = "cuda"
    block_size: int = 16
    providers: tuple[str, ...] | None = None


@dataclass
class RankCheck:
    """One rank's result: per bin the error against the float32 reference, the BF16
    reference's own error (BF16 runs only), whether any logit was NaN, and how many row
    decisions of the float32 reference's routers differed from the compiled step's
    (``flips``; the reference runs on the compiled step's choices)."""

    rank: int
    errors: dict[int, float] = field(default_factory=dict)
    bf16_reference: dict[int, float] = field(default_factory=dict)
    nan: dict[int, bool] = field(default_factory=dict)
    flips: dict[int, int] = field(default_factory=dict)
    report: str = ""

    def passed(self, size: int, limit: float = LIMIT) -> bool:
        """Bin ``size`` passed: no NaN, and :func:`~stepgraph.bench.table.within_bf16_criterion`
        (under ``limit``, or for a BF16 step within 1.5x of the BF16 reference's own error;
        the single-GPU bench and tests accept the same)."""
        if self.nan[size]:
            return False
        return within_bf16_criterion(self.errors[size], self.bf16_reference.get(size), limit)


def prompts_for(seed: int, bin_rows: int, requests: int, steps: int, vocab: int
                ) -> list[list[int]]:
    """The prompts of one bin's check: ``requests`` requests of ``steps`` random tokens
    (a function of the seed and the bin only, so every rank draws the same ones)."""
    rng = np.random.default_rng([seed, bin_rows])
    return rng.integers(0, vocab, size=(requests, steps)).tolist()


def reference_graph(document: dict[str, Any], bins: list[int]) -> Graph:
    """The world-of-one frontend graph of the artifact's spec with bins ``bins``."""
    model = Model.model_validate(document["spec"])
    deployment = Deployment.model_validate({**document["deployment"], "tp": 1, "dcp": 1,
                                            "dep": 1, "batches": sorted(set(bins))})
    return build_step(model, deployment)


def defined_error(out: np.ndarray, ref: np.ndarray) -> float:
    """The protocol's relative error over the entries where the reference is defined."""
    defined = ~np.isnan(ref)
    return relative_error(torch.from_numpy(out[defined]), torch.from_numpy(ref[defined]))


def _reference_runner(graph: Graph, weights: dict[str, torch.Tensor], requests: int,
                      steps: int, device: torch.device, dtype: str, block_size: int
                      ) -> DecodeRunner:
    runner = DecodeRunner(graph, weights, max_requests=requests, max_tokens=steps,
                          device=device, dtype=dtype, block_size=block_size)
    if dtype == "float32":  # float32 compute over the (possibly BF16) weights, no copies
        runner.executor = fp32_reference(graph, weights, runner.caches, device)
    return runner


def rank_device(name: str) -> torch.device:
    """This rank's device: its current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else \
        torch.device("cpu")


def check_rank(comm: Communicator, artifact_path: str, options: RankCheckOptions) -> RankCheck:
    """This rank's check (see the module docstring)."""
    artifact = load_artifact(artifact_path)
    device = rank_device(options.device)
    compute = compute_dtype(options.dtype)
    deployment = artifact.document["deployment"]
    max_context = options.steps + options.block_size * max(int(deployment.get("dcp", 1)), 1)
    weights = device_random_weights(artifact.graph, options.seed, compute, device, comm.rank)
    compiled = load(artifact, weights=weights, device=device, dtype=options.dtype,
                    max_context=max_context, block_size=options.block_size,
                    capture=options.capture, progress=False, comm=comm,
                    providers=options.providers, keep=list(router_ids(artifact.graph).values()))
    return compare_with_reference(compiled, comm, artifact.document, options)


def compare_with_reference(compiled: CompiledStep, comm: Communicator,
                           document: dict[str, Any], options: RankCheckOptions) -> RankCheck:
    """Decode ``options.steps`` tokens of fresh requests at every chosen bin through
    ``compiled`` (loaded on seed ``options.seed``'s device random weights, keeping its
    routers' ids: ``keep=router_ids(graph).values()``) and compare this rank's logits with the
    reference executor's, which runs every step on the compiled step's expert choices (see
    the module docstring)."""
    device = compiled.device
    deployment = document["deployment"]
    dep = int(deployment.get("dep", 1))
    bins = sorted(int(b) for b in deployment["batches"])
    chosen = [b for b in bins if options.bins is None or b in options.bins]
    routers = router_ids(compiled.graph)
    missing = [ids for ids in routers.values() if ids not in compiled.kept]
    if missing:
        raise UserError(f"the check reads the step's routing: load it with keep= "
                        f"{sorted(routers.values())} (missing {', '.join(missing)})")
    reference = reference_graph(document, [b * dep for b in bins])
    full = device_random_weights(reference, options.seed, compiled.dtype, device, 0)
    result = RankCheck(comm.rank, report=compiled.report())
    member = comm.member(dep) if dep > 1 else 0
    dtypes = ["float32"] + (["bfloat16"] if compiled.dtype == torch.bfloat16 else [])
    with torch.inference_mode():
        for size in chosen:
            everyone = prompts_for(options.seed, size, size * dep, options.steps,
                                   compiled.limits.vocab)
            mine = range(member * size, (member + 1) * size)
            runner = CompiledDecodeRunner(compiled, max_requests=size)
            references = [_reference_runner(reference, full, size * dep, options.steps,
                                            device, dtype, options.block_size)
                          for dtype in dtypes]
            for request in range(size):
                runner.add(request)
            for request in range(size * dep):
                for ref in references:
                    ref.add(request)
            got, want = [], [[] for _ in dtypes]
            for t in range(options.steps):
                logits = runner.step([(i, [everyone[r][t]]) for i, r in enumerate(mine)])
                got.append(np.stack([logits[i][0].numpy() for i in range(size)]))
                routing = Routing(_all_rows(comm, compiled, routers, size, dep))
                work = [(r, [everyone[r][t]]) for r in range(size * dep)]
                for ref, out in zip(references, want, strict=True):
                    with routing.forced(ref.executor):
                        step = ref.step(work)
                    out.append(np.stack([step[r][0].numpy() for r in mine]))
            result.flips[size] = routing.flips
            reached = np.stack(got, 1)
            expected = np.stack(want[0], 1)
            result.errors[size] = defined_error(reached, expected)
            result.nan[size] = bool(np.isnan(reached).any())
            if len(want) > 1:
                result.bf16_reference[size] = defined_error(np.stack(want[1], 1), expected)
    del full
    return result


def _all_rows(comm: Communicator, compiled: CompiledStep, routers: dict[str, str], size: int,
              dep: int) -> dict[str, torch.Tensor]:
    """Each router's ids of the step just run, for every rank's rows (gathered over the
    data-parallel ranks, in rank order)."""
    picked = {}
    for node, ids in routers.items():
        mine = compiled.kept[ids][:size].contiguous()
        if dep > 1:
            every = torch.empty((dep * size, *mine.shape[1:]), dtype=mine.dtype,
                                device=mine.device)
            comm.all_gather_rows(every, mine, dep)
            mine = every
        picked[node] = mine.clone()
    return picked


def format_checks(checks: list[RankCheck], limit: float = LIMIT) -> str:
    """A Markdown table: per bin, each rank's error, the BF16 reference's, the routing
    decisions the reference would have made differently, pass or fail."""
    bins = sorted(checks[0].errors)
    head = ["bin", *(f"rank {c.rank}" for c in checks), "bf16 reference", "flips",
            f"< max({limit:g}, {NOISE_FACTOR:g} x bf16 ref)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in bins:
        noise = [c.bf16_reference[size] for c in checks if size in c.bf16_reference]
        ok = all(c.passed(size, limit) for c in checks)
        cells = [str(size), *(f"{c.errors[size]:.2e}" + (" NaN" if c.nan[size] else "")
                              for c in checks),
                 f"{max(noise):.2e}" if noise else "-",
                 str(max(c.flips.get(size, 0) for c in checks)), "pass" if ok else "FAIL"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
