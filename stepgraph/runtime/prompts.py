"""Decode prompts through a compiled artifact on one rank or several (``stepgraph run
ARTIFACT ... [--nproc N]``): every rank loads its shard and steps in lockstep; with
data-parallel ranks (DEP) request ``i`` runs on rank ``i % dep``, otherwise every rank runs
every request (tensor and context parallel ranks share them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stepgraph.artifact import load_artifact
from stepgraph.lower.decode import run_prompts
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.decode import CompiledDecodeRunner
from stepgraph.runtime.loader import artifact_target, check_target, load
from stepgraph.runtime.rank_check import rank_device


@dataclass(frozen=True)
class PromptRun:
    """How to run: ``weights`` (a checkpoint folder or ``random``), ``seed``, ``device``
    (``cuda`` or ``cpu``), compute ``dtype``, CUDA graphs or not."""

    weights: str = "random"
    seed: int = 0
    device: str = "cuda"
    dtype: str = "bfloat16"
    capture: bool = True


def rank_requests(count: int, dep: int, member: int) -> list[int]:
    """The requests rank ``member`` of ``dep`` data-parallel ranks serves."""
    return [i for i in range(count) if i % dep == member] if dep > 1 else list(range(count))


def decode_on_rank(comm: Communicator | None, artifact_path: str, prompts: list[list[int]],
                   run: PromptRun) -> tuple[list[int], np.ndarray]:
    """This rank's requests and their logits [requests, tokens, vocab] (float32, NaN where a
    request has no token)."""
    artifact = load_artifact(artifact_path)
    device = rank_device(run.device)
    check_target(artifact_target(artifact.graph), device, escape=None)
    longest = max(len(p) for p in prompts)
    dep = int(artifact.document["deployment"].get("dep", 1))
    member = comm.member(dep) if comm is not None and dep > 1 else 0
    mine = rank_requests(len(prompts), dep, member)
    compiled = load(artifact, weights=run.weights, seed=run.seed, device=device,
                    dtype=run.dtype, max_requests=max(len(mine), 1), max_context=longest + 1,
                    block_size=16, capture=run.capture, progress=False, comm=comm)
    agree = comm.max_int if comm is not None else None
    with torch.inference_mode():
        runner = CompiledDecodeRunner(compiled, max_requests=max(len(mine), 1))
        logits = run_prompts(runner, [prompts[i] for i in mine], agree=agree)
    return mine, logits


def gather_logits(parts: list[tuple[list[int], np.ndarray]], count: int) -> np.ndarray:
    """Every request's logits in request order from the ranks' parts (the first rank that
    ran a request gives its logits)."""
    filled = next(p[1] for p in parts if len(p[0]))
    out = np.full((count, *filled.shape[1:]), np.nan, dtype=np.float32)
    seen: set[int] = set()
    for requests, logits in parts:
        for row, request in enumerate(requests):
            if request not in seen:
                out[request, : logits.shape[1]] = logits[row]
                seen.add(request)
    return out
