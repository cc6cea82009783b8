"""The multi-rank correctness check: a compiled multi-rank step against the single-GPU
reference executor on the same full weights.

Run in every rank (through :func:`stepgraph.runtime.launch.launch`): each rank loads its
shard of seeded random weights and its caches, decodes prompts through the compiled step
(every bin: as many requests as the bin holds, ``steps`` tokens each, CUDA graphs replayed
where captured), and compares its requests' logits with the reference executor's, which runs
the world-of-one graph of the same spec over the full weights (every rank's requests where
the ranks are data-parallel) in float32 over the same (BF16-rounded) weight values.

The error of a bin is ``||out - ref|| / ||ref||`` over every logit of its requests and steps.
With ``dtype`` bfloat16 the check also runs the reference executor itself in BF16, whose
error is the BF16 noise floor of the model at these weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.protocol import fp32_reference
from stepgraph.bench.weights import device_random_weights
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.lower.decode import DecodeRunner, run_prompts
from stepgraph.lower.tensors import compute_dtype
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.decode import CompiledDecodeRunner
from stepgraph.runtime.loader import load
from stepgraph.runtime.step import CompiledStep
from stepgraph.spec import Deployment, Model


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
    reference's own error (BF16 runs only), and whether any logit was NaN."""

    rank: int
    errors: dict[int, float] = field(default_factory=dict)
    bf16_reference: dict[int, float] = field(default_factory=dict)
    nan: dict[int, bool] = field(default_factory=dict)
    report: str = ""


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


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` over the entries where the reference is defined."""
    defined = ~np.isnan(ref)
    diff = np.nan_to_num(out[defined] - ref[defined], nan=np.inf)
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref[defined]), 1e-30))


def _reference_logits(graph: Graph, weights: dict[str, torch.Tensor], prompts: list[list[int]],
                      device: torch.device, dtype: str, block_size: int) -> np.ndarray:
    runner = DecodeRunner(graph, weights, max_requests=len(prompts),
                          max_tokens=max(len(p) for p in prompts), device=device, dtype=dtype,
                          block_size=block_size)
    if dtype == "float32":  # float32 compute over the (possibly BF16) weights, no copies
        runner.executor = fp32_reference(graph, weights, runner.caches, device)
    return run_prompts(runner, prompts)


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
                    providers=options.providers)
    return compare_with_reference(compiled, comm, artifact.document, options)


def compare_with_reference(compiled: CompiledStep, comm: Communicator,
                           document: dict[str, Any], options: RankCheckOptions) -> RankCheck:
    """Decode ``options.steps`` tokens of fresh requests at every chosen bin through
    ``compiled`` (loaded on seed ``options.seed``'s device random weights) and compare this
    rank's logits with the reference executor's (see the module docstring)."""
    device = compiled.device
    deployment = document["deployment"]
    dep = int(deployment.get("dep", 1))
    bins = sorted(int(b) for b in deployment["batches"])
    chosen = [b for b in bins if options.bins is None or b in options.bins]
    vocab = compiled.limits.vocab
    reference = reference_graph(document, [b * dep for b in bins])
    full = device_random_weights(reference, options.seed, compiled.dtype, device, 0)
    result = RankCheck(comm.rank, report=compiled.report())
    member = comm.member(dep) if dep > 1 else 0
    with torch.inference_mode():
        for size in chosen:
            everyone = prompts_for(options.seed, size, size * dep, options.steps, vocab)
            mine = everyone[member * size:(member + 1) * size]
            runner = CompiledDecodeRunner(compiled, max_requests=size)
            got = run_prompts(runner, mine, agree=comm.max_int)
            want = _reference_logits(reference, full, everyone, device, "float32",
                                     options.block_size)[member * size:(member + 1) * size]
            result.errors[size] = relative_error(got, want)
            result.nan[size] = bool(np.isnan(got[~np.isnan(want)]).any())
            if compiled.dtype == torch.bfloat16:
                plain = _reference_logits(reference, full, everyone, device, "bfloat16",
                                          options.block_size)
                result.bf16_reference[size] = relative_error(
                    plain[member * size:(member + 1) * size], want)
    del full
    return result


def format_checks(checks: list[RankCheck], limit: float) -> str:
    """A Markdown table: per bin, each rank's error, the BF16 reference's, pass or fail."""
    bins = sorted(checks[0].errors)
    ranks = [c.rank for c in checks]
    head = ["bin", *(f"rank {r}" for r in ranks), "bf16 reference", f"< {limit:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in bins:
        errors = [c.errors[size] for c in checks]
        noise = [c.bf16_reference.get(size) for c in checks if size in c.bf16_reference]
        ok = all(e < limit for e in errors) and not any(c.nan[size] for c in checks)
        cells = [str(size), *(f"{e:.2e}" for e in errors),
                 f"{max(noise):.2e}" if noise else "-", "pass" if ok else "FAIL"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
