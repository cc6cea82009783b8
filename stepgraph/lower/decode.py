"""Drive decode (and verify) steps of a graph over requests with the reference executor.

:class:`DecodeRunner` owns what a serving engine owns: request state slots, KV-cache blocks
and block tables, sequence lengths, and the caches. ``step`` takes the q tokens of some
requests, builds the step inputs (rows grouped by request, q consecutive rows each), pads
the rows up to the graph's next batch bin with rows that touch no real slot or block, runs
the executor and returns each request's logits.

With a cache shard (``cache_shard=(member, ways)``: decode context parallelism), token
position p of a request lives in the cache of member ``p % ways`` at local index
``p // ways``: this runner's ``seq_lens`` count the request's tokens in its member's shard and
``slot_mapping`` is -1 for tokens another member stores.

Verify steps (q > 1): each request owns q state slots; the state after its token j lands in
slot j, and the next step resumes from the slot of the last accepted token
(``num_accepted_tokens``). :meth:`accept` says how many of a request's last q tokens were
accepted (all of them when it is not called).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage
from stepgraph.lower.caches import allocate_caches, reset_slots
from stepgraph.lower.reference import ReferenceExecutor
from stepgraph.lower.weights import Weights

BLOCK_SIZE = 16


@dataclass
class _Request:
    slots: list[int]
    blocks: list[int]
    length: int = 0  # tokens committed to the caches
    accepted: int = 1  # tokens of the previous step accepted (selects the start state slot)
    pending: int | None = None  # tokens of the last step not yet committed
    extra: dict = field(default_factory=dict)


class DecodeRunner:
    """Decode / verify steps of ``graph`` on the reference executor for up to
    ``max_requests`` requests of up to ``max_tokens`` tokens each."""

    def __init__(
        self,
        graph: Graph,
        weights: Weights,
        max_requests: int,
        max_tokens: int,
        device: torch.device | str = "cpu",
        dtype: str | torch.dtype = "float32",
        block_size: int = BLOCK_SIZE,
        cache_shard: tuple[int, int] = (0, 1),
    ) -> None:
        deployment = graph.meta.get("deployment", {})
        self.cache_shard = cache_shard
        self.q = int(deployment.get("q", 1))
        self.bins = sorted(int(b) for b in deployment.get("batches", (self.q,)))
        self.graph = graph
        self.block_size = block_size
        self.blocks_per_request = math.ceil((max_tokens + self.q) / block_size)
        self.device = torch.device(device)
        self.caches = allocate_caches(
            graph, max_requests * self.q, max_requests * self.blocks_per_request, block_size,
            self.device, self.executor_dtype(dtype),
        )
        self.executor = ReferenceExecutor(graph, weights, self.caches, self.device, dtype)
        self.inputs = {v.name for v in graph.values_of(Storage.INPUT)}
        self.free = list(range(max_requests))
        self.requests: dict[int, _Request] = {}

    @staticmethod
    def executor_dtype(dtype: str | torch.dtype) -> torch.dtype:
        """The torch dtype of a dtype name."""
        if isinstance(dtype, torch.dtype):
            return dtype
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)

    @property
    def max_rows(self) -> int:
        """The largest bin: the most rows one step takes."""
        return self.bins[-1]

    def add(self, request: int) -> None:
        """Start request ``request`` with empty caches."""
        if request in self.requests:
            raise UserError(f"request {request} already runs")
        if not self.free:
            raise UserError("no free request slot")
        index = self.free.pop(0)
        slots = [index * self.q + j for j in range(self.q)]
        blocks = [index * self.blocks_per_request + j for j in range(self.blocks_per_request)]
        reset_slots(self.graph, self.caches, slots)
        self.requests[request] = _Request(slots=slots, blocks=blocks)

    def remove(self, request: int) -> None:
        """Finish ``request`` and free its slots."""
        state = self.requests.pop(request)
        self.free.append(state.slots[0] // self.q)

    def accept(self, request: int, count: int) -> None:
        """Commit only the first ``count`` (1..q) tokens of ``request``'s last step."""
        state = self.requests[request]
        if state.pending is None or not 1 <= count <= state.pending:
            raise UserError(f"request {request}: cannot accept {count} tokens")
        state.pending = count

    def _commit(self, state: _Request) -> None:
        if state.pending is not None:
            state.length += state.pending
            state.accepted = state.pending
            state.pending = None

    def step(self, work: list[tuple[int, list[int]]], rows: int | None = None
             ) -> dict[int, torch.Tensor]:
        """One step: ``work`` lists (request, its q tokens) in row order; ``rows`` pads to
        that many rows (default: the smallest bin that holds them). Returns each request's
        logits [q, vocab] (float32)."""
        q = self.q
        used = len(work) * q
        if rows is None:
            fitting = [b for b in self.bins if b >= used]
            if not fitting:
                raise UserError(f"{len(work)} requests x q={q} exceed the largest bin "
                                f"{self.bins[-1]}")
            rows = fitting[0]
        if rows < used or rows % q:
            raise UserError(f"cannot run {used} rows in a step of {rows} rows (q={q})")
        table_width = self.blocks_per_request
        tokens = np.zeros(rows, dtype=np.int32)
        positions = np.zeros(rows, dtype=np.int32)
        seq_lens = np.zeros(rows, dtype=np.int32)
        slot_mapping = np.full(rows, -1, dtype=np.int64)
        state_indices = np.full(rows, -1, dtype=np.int32)
        accepted = np.ones(rows, dtype=np.int32)
        block_tables = np.zeros((rows, table_width), dtype=np.int32)
        member, ways = self.cache_shard
        for index, (request, ids) in enumerate(work):
            state = self.requests[request]
            self._commit(state)
            if len(ids) != q:
                raise UserError(f"request {request}: a step takes q={q} tokens, got {len(ids)}")
            for j, token in enumerate(ids):
                row = index * q + j
                position = state.length + j
                local = position // ways  # this token's index in its owner's cache shard
                if local // self.block_size >= table_width:
                    raise UserError(f"request {request} exceeds its cache ({position} tokens)")
                tokens[row] = token
                positions[row] = position
                seq_lens[row] = (position + ways - member) // ways
                if position % ways == member:
                    block = state.blocks[local // self.block_size]
                    slot_mapping[row] = block * self.block_size + local % self.block_size
                state_indices[row] = state.slots[j]
                accepted[row] = state.accepted
                block_tables[row] = state.blocks
        inputs = {
            "tokens": tokens, "positions": positions, "seq_lens": seq_lens,
            "slot_mapping": slot_mapping, "kda_state_indices": state_indices,
            "num_accepted_tokens": accepted, "block_tables": block_tables,
        }
        feed = {k: torch.from_numpy(v) for k, v in inputs.items() if k in self.inputs}
        logits = self.executor.step(feed)["logits"]
        result = {}
        for index, (request, _) in enumerate(work):
            self.requests[request].pending = q
            result[request] = logits[index * q : (index + 1) * q].float().cpu()
        return result


def run_prompts(runner: DecodeRunner, prompts: list[list[int]], order: list[int] | None = None,
                agree: Callable[[int], int] | None = None) -> np.ndarray:
    """Feed every prompt one token per step, all requests together (a request leaves the
    batch after its last token); returns logits [requests, max tokens, vocab] float32 with NaN
    where a request has no token. ``order`` permutes the requests' rows in each step.

    ``agree``: for ranks that step together (data-parallel ranks, each with its own
    prompts): the largest of a count over the ranks, so that every rank runs as many steps
    (and chunks of a step) as the busiest one; a rank with nothing left runs padding rows."""
    if runner.q != 1:
        raise UserError(f"prompts run one token per step; this graph has q={runner.q}")
    agree = agree or (lambda count: count)
    count, longest = len(prompts), max((len(p) for p in prompts), default=0)
    vocab = None
    out: np.ndarray | None = None
    for request in range(count):
        runner.add(request)
    row_order = order if order is not None else list(range(count))
    for t in range(agree(longest)):
        active = [r for r in row_order if t < len(prompts[r])]
        chunks = agree(math.ceil(len(active) / runner.max_rows))
        for start in range(0, chunks * runner.max_rows, runner.max_rows):
            chunk = active[start : start + runner.max_rows]
            logits = runner.step([(r, [prompts[r][t]]) for r in chunk])
            for request, values in logits.items():
                if out is None:
                    vocab = values.shape[-1]
                    out = np.full((count, longest, vocab), np.nan, dtype=np.float32)
                out[request, t] = values[0].numpy()
    for request in range(count):
        runner.remove(request)
    if out is None:
        out = np.full((count, longest, vocab or 0), np.nan, dtype=np.float32)
    return out
