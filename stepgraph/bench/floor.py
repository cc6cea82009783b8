"""The floor of a decode step: the bytes it must move through HBM, launch by launch.

The bytes of one bin (``rows`` rows, each request attending over ``context`` cached tokens)
are counted from the graph alone, per launch, in four categories:

* ``weights``: every weight byte the launch reads: whole weights, except the embedding
  (only the rows of the step's tokens) and MLA's ``kv_b`` (``mla_query`` reads its W_UK rows,
  ``mla_value`` its W_UV rows). A weight two launches read counts twice (each launch reads it).
* ``experts``: the routed experts' stacked weights, only the experts the routing touches:
  ``touched[node]`` distinct local experts when the caller measured them (the bench counts
  them from the router's outputs of its run) or estimated them (:func:`uniform_touched`,
  the count uniform routing is expected to touch), else the compile-time upper bound
  ``min(local experts, rows x top_k)``.
* ``cache``: state and cache bytes: a KDA request's recurrent and conv states read once and
  written back once per row; an MLA request's latent cache read over the ``context`` tokens
  (split over the DCP group when the cache is) plus the new tokens written; DSA reads the
  indexer keys over the context and only each row's top-k latent entries.
* ``activations``: every non-weight, non-state input a launch reads and every output it
  writes, at the value's own shape (a column view counts its columns only).

L2 prefetches count nothing (the launch they warm counts the bytes once); collectives of a
world of one are no-ops and count nothing (a collective over more ranks counts its local
reads and writes, not the link traffic). The floor time is the total divided by a measured
copy bandwidth (bytes read plus written per second). No torch here: this module runs
wherever the compiler does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, eval_dim
from stepgraph.ir.values import Value

CATEGORIES = ("weights", "experts", "cache", "activations")
COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "dcp_gather",
                         "lse_merge", "ep_dispatch", "ep_combine"})
DEFAULT_BLOCK_SIZE = 16  # tokens per cache block (sizes only the block-table reads)


@dataclass(frozen=True)
class LaunchBytes:
    """The bytes one launch moves, by category."""

    node: str
    op: str
    layer: int | None
    weights: int = 0
    experts: int = 0
    cache: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """All bytes of the launch."""
        return self.weights + self.experts + self.cache + self.activations


@dataclass(frozen=True)
class StepBytes:
    """The bytes of every launch of one bin; ``exact_experts`` says whether every routed
    expert count was measured (False: some are compile-time upper bounds)."""

    rows: int
    context: int
    launches: tuple[LaunchBytes, ...]
    exact_experts: bool

    @property
    def total(self) -> int:
        """All bytes of the step."""
        return sum(launch.total for launch in self.launches)

    def by_category(self) -> dict[str, int]:
        """Total bytes per category (keys: :data:`CATEGORIES`)."""
        return {c: sum(getattr(launch, c) for launch in self.launches) for c in CATEGORIES}

    def floor_us(self, bandwidth: float) -> float:
        """The floor in microseconds at ``bandwidth`` bytes per second."""
        return floor_us(self.total, bandwidth)


def floor_us(nbytes: int, bandwidth: float) -> float:
    """Microseconds to move ``nbytes`` at ``bandwidth`` bytes per second."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return nbytes / bandwidth * 1e6


def expert_nodes(graph: Graph) -> list[Node]:
    """The routed-experts launches of ``graph`` in program order."""
    return [node for node in graph if node.op == "routed_experts"]


def touched_upper_bound(graph: Graph, node: Node, rows: int) -> int:
    """The most distinct local experts a routed-experts launch can touch at ``rows`` rows:
    min(local experts, rows reaching the launch x top_k)."""
    x = graph.values[node.inputs[0]]
    reaching = eval_dim(x.type.shape[0], rows)
    return min(int(node.attrs["local_experts"]), reaching * int(node.attrs["top_k"]))


def expected_touched(graph: Graph, node: Node, rows: int) -> float:
    """The distinct local experts a routed-experts launch is expected to touch at ``rows``
    rows under uniform routing: each row reaching the launch picks ``top_k`` distinct experts
    of all ``experts``, so it misses a given one with probability 1 - top_k / experts:
    local x (1 - (1 - top_k / experts) ** rows reaching). Exact at one row (top_k)."""
    x = graph.values[node.inputs[0]]
    reaching = eval_dim(x.type.shape[0], rows)
    local = int(node.attrs["local_experts"])
    share = int(node.attrs["top_k"]) / int(node.attrs.get("experts", local))
    return local * (1.0 - (1.0 - share) ** reaching)


def uniform_touched(graph: Graph, rows: int) -> dict[str, float]:
    """:func:`expected_touched` of every routed-experts launch of ``graph``, by node name (the
    ``touched`` argument of :func:`step_bytes` for an estimate made without a run)."""
    return {node.name: expected_touched(graph, node, rows) for node in expert_nodes(graph)}


class _Counter:
    """Per-launch accounting for one bin of one graph."""

    def __init__(self, graph: Graph, rows: int, context: int, block_size: int) -> None:
        self.graph = graph
        self.rows = rows
        self.context = context
        q = int(graph.meta.get("deployment", {}).get("q", 1))
        self.requests = math.ceil(rows / q)
        self.symbols = {"T": math.ceil(context / block_size)}

    def value(self, name: str) -> Value:
        return self.graph.values[name]

    def nbytes(self, name: str) -> int:
        """Bytes of a non-state value at this bin's rows."""
        return self.value(name).type.nbytes(self.rows, self.symbols)

    def unit_bytes(self, name: str) -> int:
        """Bytes of one slot / one token of a state (its symbolic dims sized 1)."""
        value = self.value(name)
        total = value.type.itemsize
        for dim in value.type.shape:
            total *= dim if isinstance(dim, int) else 1
        return total

    def activations(self, node: Node) -> int:
        """Bytes of the launch's non-weight, non-state inputs and of its outputs."""
        total = 0
        for name in node.inputs:
            if self.value(name).storage not in (Storage.WEIGHT, Storage.STATE):
                total += self.nbytes(name)
        return total + sum(self.nbytes(name) for name in node.outputs)

    def weights(self, node: Node) -> list[str]:
        """The launch's weight inputs in order."""
        return [n for n in node.inputs if self.value(n).storage is Storage.WEIGHT]

    def states(self, node: Node) -> list[str]:
        """The launch's state inputs in order."""
        return [n for n in node.inputs if self.value(n).storage is Storage.STATE]

    def tokens_on_rank(self, state: str) -> int:
        """Context tokens of one request held in ``state`` here (split over DCP ranks)."""
        split = self.value(state).split
        ways = split.ways if split is not None and split.group == "dcp" else 1
        return math.ceil(self.context / ways)


def _kv_b_part(counter: _Counter, node: Node, weight: str, part: str) -> int:
    """Bytes of the W_UK (``part`` = "k") or W_UV ("v") rows of kv_b."""
    attrs = node.attrs
    nope, v = int(attrs["qk_nope_head_dim"]), int(attrs["v_head_dim"])
    share = nope if part == "k" else v
    return counter.value(weight).nbytes_static * share // (nope + v)


def launch_bytes(counter: _Counter, node: Node, touched: float | None) -> LaunchBytes:
    """The bytes of one launch (see the module docstring for what counts)."""
    c = counter
    base = {"node": node.name, "op": node.op, "layer": node.layer}
    op = node.op
    if op == "prefetch":
        return LaunchBytes(**base)
    if op in COLLECTIVES:
        ways = int(node.attrs.get("ways", node.placement.ways))
        return LaunchBytes(**base, activations=c.activations(node) if ways > 1 else 0)
    activations = c.activations(node)
    weights = c.weights(node)
    if op == "embed":
        table = c.value(node.inputs[1])
        row_bytes = table.nbytes_static // int(table.type.shape[0])
        return LaunchBytes(**base, weights=c.rows * row_bytes, activations=activations)
    if op == "routed_experts":
        count = touched if touched is not None else touched_upper_bound(c.graph, node, c.rows)
        per_expert = sum(c.value(name).nbytes_static // int(c.value(name).type.shape[0])
                         for name in weights)
        return LaunchBytes(**base, experts=round(per_expert * count), activations=activations)
    if op in ("mla_query", "mla_value"):
        kv_b = weights[-1] if op == "mla_query" else node.inputs[1]
        part = "k" if op == "mla_query" else "v"
        total = sum(c.value(n).nbytes_static for n in weights if n != kv_b)
        total += _kv_b_part(c, node, kv_b, part)
        return LaunchBytes(**base, weights=total, activations=activations)
    weight_bytes = sum(c.value(n).nbytes_static for n in weights)
    cache = 0
    if op == "kda_core":
        for state in c.states(node):
            cache += (c.requests + c.rows) * c.unit_bytes(state)  # read once, write per row
    elif op == "mla_core":
        for state in c.states(node):
            cache += (c.requests * c.tokens_on_rank(state) + c.rows) * c.unit_bytes(state)
    elif op == "dsa_core":
        latent, keys = c.states(node)[:2]
        top = min(int(node.attrs["index_top_k"]), c.context)
        cache += (c.rows * top + c.rows) * c.unit_bytes(latent)
        cache += (c.requests * c.tokens_on_rank(keys) + c.rows) * c.unit_bytes(keys)
    else:
        for state in c.states(node):  # an op updating a state we do not model: read + write
            cache += 2 * c.rows * c.unit_bytes(state)
    return LaunchBytes(**base, weights=weight_bytes, cache=cache, activations=activations)


def step_bytes(
    graph: Graph,
    rows: int,
    context: int,
    touched: Mapping[str, float] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> StepBytes:
    """The bytes of one step of ``graph`` at ``rows`` rows, each request attending over
    ``context`` cached tokens. ``touched`` maps routed-experts node names to the distinct
    local experts the run's routing touched (or an estimate of them); nodes it omits use the
    upper bound."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    touched = touched or {}
    counter = _Counter(graph, rows, context, block_size)
    launches = []
    exact = True
    for node in graph:
        count = touched.get(node.name)
        if node.op == "routed_experts" and count is None:
            exact = False
        launches.append(launch_bytes(counter, node, count))
    return StepBytes(rows=rows, context=context, launches=tuple(launches), exact_experts=exact)


def format_bytes(nbytes: float) -> str:
    """``1.50 GB`` style (decimal units, as bandwidths are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
