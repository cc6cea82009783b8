"""The measurement protocol of shared/BENCHMARKS.md, torch side: the copy bandwidth, CUDA-event
timing, random caches, rotating input sets, the relative error, the routed experts a run
touched, a float32 reference executor that reads BF16 weights without copying them, and
routing imposed on reference executors.

Why impose routing: a router's top-k is a discrete choice; where two experts' scores are
within BF16 rounding of each other, any BF16 step may pick the other one than a float32
step does, and that row's MoE output then differs by a whole expert. The numerical check
therefore runs the references on the compiled step's own expert choices (read from its
launches) and reports how many row decisions the float32 reference would have made
differently, next to the error with its own routing.

Input sets: set ``s`` of a ``rows``-row bin serves requests ``s * requests .. (s + 1) *
requests - 1``; request ``r`` owns state slots ``r * q ..`` and cache blocks ``r * width ..``
(``width`` = the runtime's block-table width), so sets touch disjoint states and cache
blocks and no replay finds the previous one's caches in L2. Every row attends over
``context`` tokens (its own new token included: ``seq_lens`` = context).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.lower.ref_common import OpCall, OpFn
from stepgraph.lower.ref_dense import route_weights, router_scores
from stepgraph.lower.reference import ReferenceExecutor
from stepgraph.lower.tensors import storage_dtype

Feed = dict[str, np.ndarray]
UPCAST_LIMIT = 1 << 22  # weights above this many elements stay BF16 in the fp32 reference
STATE_SCALE = 0.1  # std of the random KDA recurrent states (fp32 [H, K, V] per slot)


def bench_device(name: str = "cuda") -> torch.device:
    """The current CUDA device (a one-line UserError where there is none), or the CPU for a
    dry run of the protocol (``name`` = "cpu": its times mean nothing)."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise UserError(f"--device {name!r}: choose cuda (or cpu for a dry run)")
    if not torch.cuda.is_available():
        raise UserError("stepgraph bench needs a CUDA GPU and none is available here "
                        "(run it on the GPU machine; --device cpu is a dry run)")
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20,
                   warmup: int = 3) -> float:
    """Bytes read + written per second of a device-to-device copy of ``nbytes`` (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    buffers = [src, torch.empty_like(src)]
    del src
    times = time_calls(lambda _: buffers[1].copy_(buffers[0]), [None], repeats, warmup, device)
    buffers.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (float(np.median(times)) * 1e-6)


def time_calls(call: Callable[[Any], Any], args: Sequence[Any], replays: int, warmup: int,
               device: torch.device) -> list[float]:
    """Microseconds of each of ``replays`` calls ``call(args[i % len(args)])`` measured with
    CUDA events on the current stream, after ``warmup`` untimed calls. Calls are not
    synchronized one by one: the host runs ahead as a serving loop would, so an event pair
    measures the GPU's time for the call, plus any time the GPU waits for the host. On the
    CPU (a dry run) each call is timed with the host clock."""
    for i in range(warmup):
        call(args[i % len(args)])
    synchronize(device)
    if device.type != "cuda":
        times = []
        for i in range(replays):
            started = time.perf_counter()
            call(args[i % len(args)])
            times.append((time.perf_counter() - started) * 1e6)
        return times
    pairs = []
    for i in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call(args[i % len(args)])
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in pairs]


def serving_call(step: Any) -> Callable[[Any], Any]:
    """The call a benchmark times for a compiled step (a
    :class:`~stepgraph.runtime.step.CompiledStep`), as a serving loop makes it: inputs ->
    the inputs' copy and the replay, the logits left in the step's output buffer (no copy
    of them; the sampler reads them there)."""
    return lambda inputs: step.step(inputs, clone=False)


def decode_loop_call(step: Any, inputs: Any) -> Callable[[Any], Any]:
    """The call a decode loop with its sampler on the GPU makes of a compiled step: the
    step's tokens are the argmax of the last step's logits, written on the device into the
    token buffer the next replay reads (everything else as ``inputs`` left it: one fill,
    here). So no step can start before the one before has ended, which the serving call's
    ready inputs do not force; the argmax's own launches are in the time. The call's
    argument is ignored."""
    step.step(inputs, clone=False)  # fills one block of input buffers, which replays read
    rows = inputs.rows
    size = step.bin_for(rows)
    tokens = step.filler.buffers["tokens"][:rows]
    logits = step.bindings.outputs[step.output_name][:rows]

    def call(_: Any) -> None:
        step.replay(size)
        tokens.copy_(logits.argmax(-1))

    return call


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (inf when ``ref`` is all zeros and ``out`` is
    not; NaN propagates)."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: out {list(out.shape)}, ref {list(ref.shape)}")
    a, b = out.double(), ref.double()
    diff = torch.linalg.vector_norm(a - b).item()
    norm = torch.linalg.vector_norm(b).item()
    if norm == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / norm


def fill_caches(caches: Mapping[str, torch.Tensor], seed: int) -> None:
    """Random caches, as after a long context: N(0, 1) latent and conv entries, N(0, 0.1^2)
    recurrent states (float32); seeded by ``seed`` and the cache's place in name order."""
    for index, (name, tensor) in enumerate(sorted(caches.items())):
        if not tensor.is_floating_point():
            continue
        generator = torch.Generator(device=tensor.device)
        generator.manual_seed(seed * 1000003 + index)
        scale = STATE_SCALE if name.endswith("recurrent_state") else 1.0
        flat = tensor.view(-1)
        chunk = 1 << 26
        for start in range(0, flat.numel(), chunk):
            stop = min(start + chunk, flat.numel())
            draw = torch.randn(stop - start, generator=generator, device=tensor.device)
            flat[start:stop] = (draw * scale).to(tensor.dtype)


def clone_caches(caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every cache tensor."""
    return {name: tensor.clone() for name, tensor in caches.items()}


def build_feeds(rows: int, q: int, sets: int, context: int, block_size: int, width: int,
                vocab: int, seed: int) -> list[Feed]:
    """``sets`` input sets of a ``rows``-row step (numpy; see the module docstring): every
    row of request ``r`` attends over ``context`` tokens of its own cache blocks."""
    if rows % q:
        raise UserError(f"{rows} rows are not whole requests of q={q}")
    if context > width * block_size:
        raise UserError(f"context {context} exceeds the block tables' {width} x {block_size}")
    requests = rows // q
    feeds = []
    for s in range(sets):
        rng = np.random.default_rng(seed * 7919 + s)
        first = s * requests
        request = first + np.arange(rows) // q
        step = np.arange(rows) % q
        position = context - q + step
        tables = request[:, None] * width + np.arange(width)[None, :]
        feed = {
            "tokens": rng.integers(0, vocab, size=rows).astype(np.int32),
            "positions": position.astype(np.int32),
            "kda_state_indices": (request * q + step).astype(np.int32),
            "num_accepted_tokens": np.full(rows, q, dtype=np.int32),
            "block_tables": tables.astype(np.int32),
            "seq_lens": (position + 1).astype(np.int32),
        }
        feed["slot_mapping"] = slot_mapping(feed, block_size)
        feeds.append(feed)
    return feeds


def slot_mapping(feed: Feed, block_size: int) -> np.ndarray:
    """The flat cache slot of each row's new token (from its position and block table)."""
    position = feed["positions"].astype(np.int64)
    rows = np.arange(position.shape[0])
    block = feed["block_tables"][rows, position // block_size].astype(np.int64)
    return block * block_size + position % block_size


def next_feed(feed: Feed, q: int, block_size: int, seed: int) -> Feed:
    """The same requests' next step: q tokens later, new random tokens (same vocabulary
    bound as the tokens given)."""
    rng = np.random.default_rng(seed)
    nxt = {k: v.copy() for k, v in feed.items()}
    nxt["tokens"] = rng.permutation(feed["tokens"]).astype(np.int32)
    nxt["positions"] = feed["positions"] + q
    nxt["seq_lens"] = feed["seq_lens"] + q
    nxt["slot_mapping"] = slot_mapping(nxt, block_size)
    return nxt


def device_feed(graph: Graph, feed: Feed, device: torch.device) -> dict[str, torch.Tensor]:
    """The feed's arrays the graph reads, as tensors on ``device`` (reference executor)."""
    wanted = {v.name: v for v in graph.values.values() if v.storage.value == "input"}
    out = {}
    for name, value in wanted.items():
        if name not in feed:
            raise UserError(f"the step reads input {name}, which the bench does not build")
        dtype = storage_dtype(value.type.dtype, torch.float32)
        out[name] = torch.from_numpy(np.ascontiguousarray(feed[name])).to(device, dtype)
    return out


def touched_experts(graph: Graph, values: Mapping[str, torch.Tensor], rows: int
                    ) -> dict[str, int]:
    """Distinct local experts each routed-experts node's ids touch over the first ``rows``
    rows (``values``: a step's values by name, e.g. the reference executor's
    ``last_values``)."""
    touched = {}
    for node in graph:
        if node.op != "routed_experts":
            continue
        ids = values[node.inputs[1]][:rows].reshape(-1).long()
        offset, local = int(node.attrs["expert_offset"]), int(node.attrs["local_experts"])
        here = ids[(ids >= offset) & (ids < offset + local)]
        touched[node.name] = int(torch.unique(here).numel())
    return touched


def router_ids(graph: Graph) -> dict[str, str]:
    """Each router node's name -> the temp holding its expert ids."""
    return {node.name: node.outputs[0] for node in graph if node.op == "router"}


def launched_step(compiled: Any, inputs: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step of ``compiled`` (a :class:`~stepgraph.runtime.step.CompiledStep`) on
    ``inputs`` with its launches run one by one, its arena poisoned and its output NaN
    first: each router node's expert ids of the real rows and the logits (copies). The
    caches are left as the step wrote them."""
    rows = inputs.rows
    size = compiled.bin_for(rows)
    routers = router_ids(compiled.graph)
    compiled.poison_arena()
    output = compiled.bindings.outputs[compiled.output_name]
    output.fill_(float("nan"))
    compiled.filler.fill(inputs, size)
    temps = compiled.temps(size)
    plan = compiled.plan(size)
    ids = {}
    for name, launch in zip(plan.names, plan.launches, strict=True):
        launch()
        if name in routers:
            ids[name] = temps[routers[name]][:rows].clone()
    return ids, output[:rows].float().clone()


def same_routing_rows(ids: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
                      ) -> torch.Tensor:
    """Rows (a bool mask) whose expert choices equal ``base``'s at every router (as sets:
    the order of a row's top-k does not matter)."""
    same = None
    for name, theirs in base.items():
        mine = ids[name].long().sort(-1).values
        row_same = (mine == theirs.long().sort(-1).values).all(-1)
        same = row_same if same is None else same & row_same
    if same is None:
        raise ValueError("no router in the step: every row routes the same")
    return same


def fp32_reference(graph: Graph, weights: Mapping[str, torch.Tensor],
                   caches: Mapping[str, torch.Tensor], device: torch.device
                   ) -> ReferenceExecutor:
    """The reference executor computing in float32 over BF16 weights without a float32 copy
    of the large ones (above :data:`UPCAST_LIMIT` elements; the values are the same)."""
    return ReferenceExecutor(graph, weights, dict(caches), device, "float32",
                             keep_dtype_above=UPCAST_LIMIT)


class Routing:
    """Routing decisions imposed on reference executors (see :meth:`forced`): the expert ids
    of each router node, and the count of row decisions the reference would have made
    differently on its own (``flips`` of ``decisions``, summed over the runs; per router node
    in ``flips_by_node``)."""

    def __init__(self, ids: Mapping[str, torch.Tensor]) -> None:
        self.ids = dict(ids)
        self.flips_by_node: dict[str, int] = {}
        self.decisions = 0

    @property
    def flips(self) -> int:
        """Row decisions where the reference's own choice differed from the imposed one."""
        return sum(self.flips_by_node.values())

    def _router(self, original: OpFn) -> OpFn:
        def router(call: OpCall) -> list[torch.Tensor]:
            own = original(call)
            forced = self.ids.get(call.node.name)
            if forced is None:
                return own
            forced = forced.to(own[0].device)
            rows = forced.shape[0]
            mine = own[0][:rows].long().sort(-1).values
            theirs = forced.long().sort(-1).values
            name = call.node.name
            flips = int((mine != theirs).any(-1).sum())
            self.flips_by_node[name] = self.flips_by_node.get(name, 0) + flips
            self.decisions += rows
            ids = own[0].clone()
            ids[:rows] = forced.to(ids.dtype)
            weights = route_weights(router_scores(call.ins[0], call.attrs), ids, call.attrs)
            return [ids, weights.to(call.out_dtypes[1])]

        return router

    @contextmanager
    def forced(self, executor: ReferenceExecutor) -> Iterator[None]:
        """Within the block, ``executor``'s router returns these ids (for the rows given)
        with the weights the reference computes for them."""
        original = executor.ops["router"]
        executor.ops["router"] = self._router(original)
        try:
            yield
        finally:
            executor.ops["router"] = original


def compiled_step(executor: ReferenceExecutor) -> Callable[[Mapping[str, torch.Tensor]],
                                                            torch.Tensor]:
    """``executor``'s step under ``torch.compile(mode="reduce-overhead")`` with torch's
    defaults otherwise (what a user would write; a second row count recompiles once with
    dynamic shapes, later ones reuse it): feed -> logits. The weights and caches are marked
    as static addresses (as an ``nn.Module``'s parameters and buffers would be), so that
    the step's in-place cache writes do not make CUDA graphs skip it."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for tensor in executor.fixed.values():
        torch._dynamo.mark_static_address(tensor)

    def eager(feed: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return executor.step(feed)["logits"]

    return torch.compile(eager, mode="reduce-overhead")


def compile_stats() -> str:
    """What torch.compile did so far in this process: graphs compiled, graph breaks (the
    most frequent reasons) and CUDA graph skips, from dynamo's counters."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    top = "; ".join(f"{n}x {' '.join(reason.split())[:80]}"
                    for reason, n in breaks.most_common(3))
    skips = sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
                if "cudagraph_skip" in k)
    return (f"{counters['stats'].get('unique_graphs', 0)} graphs, "
            f"{sum(breaks.values())} graph breaks{f' ({top})' if top else ''}, "
            f"{skips} CUDA graph skips")
