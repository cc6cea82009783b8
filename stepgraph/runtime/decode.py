"""Multi-step decode on a compiled step: :class:`CompiledDecodeRunner` is the reference
:class:`~stepgraph.lower.decode.DecodeRunner` (request slots, cache blocks, block tables,
verify acceptance) driving a :class:`~stepgraph.runtime.step.CompiledStep` and its caches
instead of the reference executor, so the same decode runs on both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepgraph.errors import UserError
from stepgraph.ir.types import Storage
from stepgraph.lower.decode import DecodeRunner
from stepgraph.runtime.inputs import StepInputs
from stepgraph.runtime.step import CompiledStep


class StepExecutor:
    """The reference executor's ``step(feed) -> {"logits": ...}`` over a compiled step."""

    def __init__(self, compiled: CompiledStep) -> None:
        self.compiled = compiled

    def step(self, feed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run the feed's rows (padding rows included) and return a copy of the logits."""
        inputs = StepInputs.from_feed(feed)
        return {self.compiled.output_name: self.compiled.step(inputs)}


class CompiledDecodeRunner(DecodeRunner):
    """A DecodeRunner over ``compiled``: its caches, its block size and block-table width;
    up to ``max_requests`` requests (default: all the compiled step's slots hold)."""

    def __init__(self, compiled: CompiledStep, max_requests: int | None = None) -> None:
        requests = compiled.max_requests if max_requests is None else max_requests
        if not 1 <= requests <= compiled.max_requests:
            raise UserError(f"max_requests {requests}: the compiled step holds 1.."
                            f"{compiled.max_requests} requests")
        graph = compiled.graph
        self.q = compiled.q
        self.bins = list(compiled.bins)
        self.graph = graph
        self.block_size = compiled.block_size
        self.blocks_per_request = compiled.limits.width
        self.device = compiled.device
        self.caches = compiled.caches
        self.executor = StepExecutor(compiled)  # type: ignore[assignment]
        self.inputs = {v.name for v in graph.values_of(Storage.INPUT)}
        self.free = list(range(requests))
        self.requests = {}
        dcp = int(graph.meta.get("deployment", {}).get("dcp", 1))
        comm = compiled.comm
        self.cache_shard = (comm.member(dcp), dcp) if comm is not None and dcp > 1 else (0, 1)
