"""``load``: an artifact -> a :class:`~stepgraph.runtime.step.CompiledStep` on a device.

Checks the artifact against the device (target, ranks, free memory), allocates the arena
and the caches, binds weights, inputs and outputs, prepares every node's launch for every
bin, warms them, and captures one CUDA graph per bin in one shared memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stepgraph.artifact import Artifact, load_artifact
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph, vocab_size
from stepgraph.ir.types import Storage
from stepgraph.lower.caches import allocate_caches
from stepgraph.lower.tensors import compute_dtype
from stepgraph.lower.weights import load_weights, random_weights
from stepgraph.memory.arena import bin_rows
from stepgraph.runtime.binding import (
    Arena,
    Bindings,
    arena_scale,
    bind_temps,
    bind_weights,
    static_buffers,
    static_shapes,
)
from stepgraph.runtime.capture import BinPlan, prepare_bin, warm
from stepgraph.runtime.capture import capture as capture_bin
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.inputs import InputFiller, Limits
from stepgraph.runtime.memory_check import cache_extent, check_fits, step_memory
from stepgraph.runtime.progress import progress as progress_bar
from stepgraph.runtime.providers import REGISTRY, load_providers
from stepgraph.runtime.providers.registry import Registry
from stepgraph.runtime.step import CompiledStep

GPU_NAMES = {"h200": "H200", "h100": "H100", "b200": "B200"}
BLOCK_SIZE = 64  # tokens a cache block, unless the caller says otherwise
LOAD_REMEDY = ("shard it over more GPUs (compile with a higher --tp or --dep), size the caches "
               "smaller (max_requests, max_context) or use a GPU with more memory")


def _graph_of(artifact: Artifact | Graph | str | Path) -> tuple[Graph, dict[str, Any] | None]:
    if isinstance(artifact, Graph):
        return artifact, None
    if isinstance(artifact, Artifact):
        return artifact.graph, artifact.document
    loaded = load_artifact(artifact)
    return loaded.graph, loaded.document


def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda[:n]``; a one-line error where CUDA is absent."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {device}: choose cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device cuda: no CUDA device is available here; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_target(device: torch.device) -> str | None:
    """The compile target whose artifacts run on ``device``: ``cpu``, or the target whose GPU
    name is in the device's name (``h200`` on an "NVIDIA H200"); None for a GPU that no target
    names."""
    if device.type == "cpu":
        return "cpu"
    found = torch.cuda.get_device_name(device).lower()
    return next((target for target, name in GPU_NAMES.items() if name.lower() in found), None)


def artifact_target(graph: Graph) -> str:
    """The target an artifact's graph was compiled for (its deployment's ``target``)."""
    return str(graph.meta.get("deployment", {}).get("target", "default"))


def check_target(target: str, device: torch.device, allow_mismatch: bool = False,
                 escape: str | None = "load with allow_target_mismatch=True") -> None:
    """Refuse running an artifact compiled for ``target`` on ``device`` unless they match
    (target ``cpu`` on the CPU, ``h200`` on an H200, ...) or ``allow_mismatch``; the refusal
    names the ``--target`` to recompile with and, where the caller has one, the ``escape``."""
    if allow_mismatch:
        return
    own = device_target(device)
    if own == target:
        return
    found = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    fix = f"recompile with --target {own}" if own else "recompile for a target of this device"
    raise UserError(f"the artifact was compiled for target {target} but the device is "
                    f"{found}: {fix}" + (f", or {escape}" if escape else ""))


def check_world(graph: Graph, comm: Communicator | None) -> None:
    """Refuse a plan whose ranks do not match the communicator's world (a plan for more than
    one rank needs one), or a plan without a memory plan."""
    world = int(graph.meta.get("world", 1))
    if world > 1 and comm is None:
        raise UserError(f"the artifact's step runs on {world} ranks: start one process a GPU "
                        f"(stepgraph run/bench --nproc {world}, or stepgraph.runtime.launch) "
                        f"and load with comm=")
    if comm is not None and comm.world != world:
        raise UserError(f"the artifact's step runs on {world} ranks but {comm.world} processes "
                        f"were started: use --nproc {world}")
    if "memory" not in graph.meta:
        raise UserError("the artifact has no memory plan (compile it through the alias pass)")


def rank_graph(graph: Graph, rank: int) -> Graph:
    """The graph as rank ``rank`` runs it: each expert-split node computes the experts of the
    rank's member of its group (``expert_offset``; member = rank % ways, as the weight
    slicing takes); the graph itself when nothing differs."""
    nodes, changed = [], False
    for node in graph:
        split = node.attrs.get("expert_split")
        if isinstance(split, dict) and int(split.get("ways", 1)) > 1:
            offset = rank % int(split["ways"]) * int(split["local_experts"])
            node = node.evolve(attrs={**node.attrs, "expert_offset": offset})
            changed = True
        nodes.append(node)
    if not changed:
        return graph
    ranked = graph.copy()
    ranked.set_nodes(nodes)
    return ranked


def group_sizes(graph: Graph) -> list[int]:
    """The sizes of the groups the graph's collectives and split nodes run over."""
    sizes = set()
    for node in graph:
        attrs = node.attrs
        sizes.add(int(attrs.get("ways", 1)))
        for key in ("vocab_split", "expert_split"):
            if isinstance(attrs.get(key), dict):
                sizes.add(int(attrs[key].get("ways", 1)))
    return sorted(sizes - {1})


def _weights(graph: Graph, weights: Any, seed: int, dtype: torch.dtype,
             device: torch.device, rank: int) -> dict[str, torch.Tensor]:
    if isinstance(weights, Mapping):
        return dict(weights)
    if weights == "random":
        return random_weights(graph, seed, rank=rank, dtype=dtype, device=device)
    return load_weights(graph, weights, rank=rank, dtype=dtype, device=device)


def _preferences(graph: Graph, target: str, notes: list[str]
                 ) -> Callable[[str], tuple[str, ...]]:
    """Each op's providers from the target's tactic tables, preferred first (a note when the
    tables changed since the artifact was compiled)."""
    from stepgraph.tactics import TacticsError, load_tables

    tactics = graph.meta.get("tactics", {})
    recorded, own = tactics.get("digest"), tactics.get("path")
    tables = load_tables(target)
    if own and recorded != tables.digest and Path(own).is_file():
        tables = load_tables(target, own)  # the table file it was compiled with
    if recorded and recorded != tables.digest:
        notes.append(f"the {target} tactic tables changed since this artifact was compiled "
                     f"(provider preferences come from the current {tables.version})")

    def providers(op: str) -> tuple[str, ...]:
        try:
            return tables.providers(op)
        except TacticsError:
            return ()

    return providers


def load(
    artifact: Artifact | Graph | str | Path,
    weights: str | Path | Mapping[str, torch.Tensor] = "random",
    device: str | torch.device = "cuda",
    dtype: str = "bfloat16",
    seed: int = 0,
    max_requests: int | None = None,
    max_context: int = 4096,
    block_size: int = BLOCK_SIZE,
    capture: bool = True,
    pdl: bool = True,
    progress: bool = True,
    allow_target_mismatch: bool = False,
    providers: Sequence[str] | None = None,
    comm: Communicator | None = None,
    registry: Registry = REGISTRY,
    keep: Sequence[str] = (),
    input_blocks: int | None = None,
) -> CompiledStep:
    """Load a compiled step onto ``device``.

    ``artifact``: a path, an :class:`~stepgraph.artifact.Artifact` or a compiled Graph;
    ``weights``: ``"random"`` (seeded by ``seed``), a safetensors checkpoint folder, or a
    mapping of graph weight names to tensors (packed as the graph says); ``dtype``: the
    compute dtype (``bfloat16`` or ``float32``); ``max_requests`` (default: the largest bin's
    requests) and ``max_context`` / ``block_size`` size the caches and block tables;
    ``capture``: one CUDA graph per bin (CUDA only; eager launches otherwise); ``pdl``:
    launch with PDL where the plan allows; ``progress``: show a progress bar;
    ``allow_target_mismatch``: run an artifact compiled for another target; ``providers``:
    use only these providers (e.g. ``("torch", "cublas")``: the torch baseline; ``torch`` is
    always the last resort); ``comm``: this process's rank of a multi-rank step (every rank
    calls ``load`` with the same arguments; weights given by path or ``"random"`` are sliced
    to the rank's shard, a mapping must hold the rank's shard already); ``registry``: the
    providers to choose from (a benchmark's ablation swaps some); ``keep``: temps whose
    values the step copies into ``CompiledStep.kept`` as they are produced (a check reads
    the step's routing there); ``input_blocks``: device blocks of input buffers the steps
    take in turn, each bin prepared (and captured) once per block, so that a step's input
    copy overlaps the step before it (default: 2 with CUDA graphs, else 1).
    """
    graph, document = _graph_of(artifact)
    check_world(graph, comm)
    vocab = vocab_size(graph)
    rank = comm.rank if comm is not None else 0
    graph = rank_graph(graph, rank)
    device = resolve_device(device)
    target = artifact_target(graph)
    check_target(target, device, allow_target_mismatch)
    compute = compute_dtype(dtype)
    if max_context < 1 or block_size < 1:
        raise UserError("max_context and block_size must be positive")
    notes = [f"provider module {s}" for s in load_providers()]
    if allow_target_mismatch:
        try:
            check_target(target, device)
        except UserError:
            notes.append(f"compiled for target {target}; running on this device anyway "
                         f"(allow_target_mismatch)")

    bins = bin_rows(graph)
    q = int(graph.meta.get("deployment", {}).get("q", 1))
    requests = max_requests if max_requests is not None else max(bins[-1] // q, 1)
    if requests < 1:
        raise UserError("max_requests must be at least 1")
    extent = cache_extent(requests, q, max_context, block_size)
    check_fits(step_memory(graph, compute, extent, weights=not isinstance(weights, Mapping)),
               device, LOAD_REMEDY)
    slots, blocks, width = extent.slots, extent.blocks, extent.width
    caches = allocate_caches(graph, extent.held_slots, extent.held_blocks, block_size, device,
                             compute)
    fixed = bind_weights(graph, _weights(graph, weights, seed, compute, device, rank), compute,
                         device)
    fixed.update(caches)
    symbols = {"T": width}
    use_graphs = capture and device.type == "cuda"
    if input_blocks is None:
        input_blocks = 2 if use_graphs else 1
    filler = InputFiller(static_shapes(graph, Storage.INPUT, bins[-1], symbols, compute),
                         Limits(slots, blocks, block_size, width, vocab, q), device,
                         blocks=input_blocks)
    bindings = Bindings(
        fixed=fixed,
        inputs=filler.buffer_sets[0],
        outputs=static_buffers(graph, Storage.OUTPUT, bins[-1], symbols, compute, device),
    )
    unknown = [name for name in keep if name not in graph.values
               or graph.values[name].storage is not Storage.TEMP]
    if unknown:
        raise UserError(f"keep: {', '.join(unknown)} are not temps of this step")
    kept = static_buffers(graph, Storage.TEMP, bins[-1], symbols, compute, device, set(keep))
    scale = arena_scale(graph, compute)
    arena = Arena.allocate(int(graph.meta["memory"]["arena_bytes"]), scale, device)

    preferences = _preferences(graph, target, notes)
    pool = torch.cuda.graph_pool_handle() if use_graphs else None
    if comm is not None:
        comm.add_groups(group_sizes(graph))
        notes.append(f"rank {comm.rank} of {comm.world} ({comm.backend})")
    plan_sets: list[dict[int, BinPlan]] = [{} for _ in filler.blocks]
    label = "capturing" if use_graphs else "preparing"
    total = len(bins) * len(graph) * len(filler.blocks)
    with torch.no_grad(), progress_bar(total, label, progress) as advance:
        for size in bins:
            bindings.temps[size] = bind_temps(graph, size, arena, compute)
            for index, plans in enumerate(plan_sets):
                plan = prepare_bin(graph, size,
                                   bindings.for_bin(size, filler.buffer_sets[index]), device,
                                   compute, preferences, pdl, advance,
                                   allowed=None if providers is None else set(providers),
                                   comm=comm, registry=registry, kept=kept)
                filler.fill_padding(size, index)
                warm(plan, device)
                if use_graphs:
                    capture_bin(plan, pool, thread_local=comm is not None)
                plans[size] = plan
    return CompiledStep(graph=graph, device=device, dtype=compute, bins=bins, q=q,
                        plan_sets=plan_sets,
                        bindings=bindings, arena=arena, filler=filler, caches=caches,
                        target=target, notes=notes, document=document, pool=pool, comm=comm,
                        kept=kept)
