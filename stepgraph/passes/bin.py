"""The ``bin`` pass (policy binning): for every batch bin the deployment serves and every node,
the provider and tactic, looked up in the target's tactic tables, with the reason.

Results (JSON-able, in ``graph.meta``):

* ``bins``: ``[{"rows", "requests", "path", "reason"}]`` with rows = requests x q; ``path`` is
  ``specialized`` or ``stock`` (a bin above the step cap runs the stock, eager path; it is
  recorded, never dropped);
* ``caps``: ``{kind: cap, ..., "step": cap}`` for the kinds the model uses (None: uncapped);
  the step cap is the smallest cap over the model's attention kinds (the seeds' step_cap);
* ``decisions``: ``{node: {str(rows): {"provider", "tactic", "reason"}}}``; nodes of the
  same op, kind, rows dim and weight shape share one per-bin dict, and identical decisions
  are shared objects (this keeps ``Graph.copy`` cheap): treat them as read-only and assign
  new dicts rather than editing them in place;
* ``tactics``: ``{"target", "version", "digest", "file"}`` of the tables used (the file's
  name only, so that artifacts do not depend on where the checkout lives).

The pass reads per-rank shapes, so it gives the same answers whether or not ``pack`` ran
(a packed projection is looked up by its packed weight's shape).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, eval_dim, is_rows_dim
from stepgraph.passes.manager import CompileContext, PassResult
from stepgraph.tactics import TacticTables, load_tables, table_path
from stepgraph.units import human_bytes

ATTENTION_KINDS = ("kda", "mla", "dsa")
STOCK = "stock"


def tables_for(graph: Graph, ctx: CompileContext | None) -> TacticTables:
    """The tactic tables a pass uses: ``ctx.data["tactics"]`` when given, else the tables of
    the deployment's target."""
    if ctx is not None and isinstance(ctx.data.get("tactics"), TacticTables):
        return ctx.data["tactics"]
    if ctx is not None:
        return load_tables(ctx.deployment.target)
    return load_tables(graph.meta.get("deployment", {}).get("target", "default"))


def layer_kinds(graph: Graph) -> dict[int, dict[str, str]]:
    """Layer index -> {"attention": kind, "mlp": kind} from ``meta["layers"]``."""
    return {entry["index"]: entry for entry in graph.meta.get("layers", [])}


def node_kind(node: Node, layers: dict[int, dict[str, str]]) -> str | None:
    """The layer kind whose cap governs ``node``: the layer's attention kind for its
    attention unit, its MLP kind for its MLP unit, None elsewhere."""
    if node.layer is None or node.layer not in layers:
        return None
    if node.unit == "attention":
        return layers[node.layer]["attention"]
    if node.unit == "mlp":
        return layers[node.layer]["mlp"]
    return None


def rows_dim(graph: Graph, node: Node) -> str | None:
    """The rows dim (``B``, ``B*8``, ...) the node runs over: its first operand's leading
    rows dim, None when no operand scales with the rows."""
    for name in (*node.inputs, *node.outputs):
        shape = graph.values[name].type.shape
        if shape and is_rows_dim(shape[0]):
            return str(shape[0])
    return None


def matmul_shape(graph: Graph, node: Node) -> tuple[int | None, int | None]:
    """(N, K) of the node's first two-dimensional weight (per rank); for routed experts, of
    one expert's matrix in the stacked gate_up weight [E, N, K]; else (None, None)."""
    dims = 3 if node.op == "routed_experts" else 2
    for name in node.inputs:
        value = graph.values[name]
        if value.storage is Storage.WEIGHT and len(value.type.shape) == dims:
            n, k = value.type.shape[-2:]
            if isinstance(n, int) and isinstance(k, int):
                return n, k
    return None, None


@dataclass(frozen=True)
class Bin:
    """Policy binning: provider + tactic + reason for every node and batch bin."""

    name: ClassVar[str] = "bin"

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Record ``bins``, ``caps``, ``decisions`` and ``tactics`` in a copy's meta."""
        g = graph.copy()
        tables = tables_for(g, ctx)
        q = ctx.deployment.q
        groups = g.meta.get("groups", {})
        tp, dcp = int(groups.get("tp", 1)), int(groups.get("dcp", 1)) > 1
        layers = layer_kinds(g)
        attention = sorted({e["attention"] for e in layers.values()})
        mlp = sorted({e["mlp"] for e in layers.values()})
        caps: dict[str, int | None] = {k: tables.cap(k, dcp) for k in (*attention, *mlp)
                                       if k in tables.data.caps}
        step = tables.step_cap(attention, dcp)
        caps["step"] = step
        over = ", ".join(f"{k} {caps.get(k)}" for k in attention) or "none"

        bins = []
        for rows in ctx.deployment.batches:
            entry: dict[str, Any] = {"rows": rows, "requests": rows // q,
                                     "path": "specialized", "reason": ""}
            if step is not None and rows > step:
                entry["path"] = STOCK
                entry["reason"] = (f"{rows} rows > step cap {step} (smallest cap over the "
                                   f"attention kinds: {over}): the stock, eager path")
            bins.append(entry)

        shared: dict[tuple[Any, ...], dict[str, Any]] = {}

        def decision(key: tuple[Any, ...], make: Any) -> dict[str, Any]:
            found = shared.get(key)
            if found is None:
                provider, tactic, reason = make()
                found = {"provider": provider, "tactic": tactic, "reason": reason}
                shared[key] = found
            return found

        decisions: dict[str, dict[str, dict[str, Any]]] = {}
        templates: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
        for node in g:
            kind = node_kind(node, layers)
            dim = rows_dim(g, node)
            n, k = matmul_shape(g, node)
            top_k = node.attrs.get("top_k")
            signature = (node.op, kind, dim, n, k, top_k)
            per_bin = templates.get(signature)
            if per_bin is None:
                per_bin = self._decide(node.op, kind, dim, n, k, top_k, bins, caps, tables,
                                       tp, q, decision)
                templates[signature] = per_bin
            decisions[node.name] = per_bin  # shared by same-signature nodes: read-only

        g.meta["bins"] = bins
        g.meta["caps"] = caps
        g.meta["decisions"] = decisions
        g.meta["tactics"] = {"target": tables.data.target, "version": tables.version,
                             "digest": tables.digest, "file": Path(tables.path).name}
        if Path(tables.path).resolve() != table_path(tables.data.target).resolve():
            g.meta["tactics"]["path"] = str(Path(tables.path).resolve())
        stock = [e["rows"] for e in bins if e["path"] == STOCK]
        summary = (f"{len(bins)} bins ({', '.join(str(e['rows']) for e in bins)} rows), "
                   f"step cap {step}, {len(decisions)} nodes decided with {tables.label}"
                   + (f"; stock path at {stock}" if stock else ""))
        return PassResult(g, True, summary)

    @staticmethod
    def _decide(op: str, kind: str | None, dim: str | None, n: int | None, k: int | None,
                top_k: int | None, bins: list[dict[str, Any]], caps: dict[str, int | None],
                tables: TacticTables, tp: int, q: int,
                decision: Any) -> dict[str, dict[str, Any]]:
        """The per-bin decisions of a node with this op, kind, rows dim, weight shape and
        experts a row (``top_k``, the MoE's ops)."""
        kind_cap = caps.get(kind) if kind is not None else None
        per_bin: dict[str, dict[str, Any]] = {}
        for entry in bins:
            rows = entry["rows"]
            if entry["path"] == STOCK:
                per_bin[str(rows)] = decision(
                    ("step", rows), lambda e=entry: (STOCK, {}, e["reason"]))
            elif kind is not None and kind_cap is not None and rows > kind_cap:
                per_bin[str(rows)] = decision(
                    ("kind", kind, rows),
                    lambda r=rows, kd=kind, c=kind_cap: (
                        STOCK, {}, f"{r} rows > {kd} cap {c} ({tables.cap_source(kd)}): "
                        f"the {kd} layers take the stock path at this bin"))
            else:
                node_rows = eval_dim(dim, rows) if dim is not None else rows
                choice = tables.choose(op, node_rows, n, k, tp, q, top_k)
                per_bin[str(rows)] = decision(
                    ("table", choice.provider, tuple(choice.tactic.items()), choice.reason),
                    lambda c=choice: (c.provider, dict(c.tactic), c.reason))
        return per_bin


# ----------------------------------------------------------------------------- explain


def _stream_lines(graph: Graph, node: Node) -> list[str]:
    """Where the streams pass put ``node``: on the side stream (forked after the node before
    it, joined before a main-stream node or at the step's end), or carrying branches'
    joins."""
    side = graph.meta.get("streams", {}).get("side", {})
    if node.name in side:
        order = [n.name for n in graph]
        at = order.index(node.name)
        after = next((order[i] for i in range(at - 1, -1, -1) if order[i] not in side), None)
        join = side[node.name]
        return [f"  stream: side (forked after {after or 'the step start'}, joined "
                f"{f'before {join}' if join else 'at the step end'})"]
    joined = sorted(name for name, join in side.items() if join == node.name)
    if joined:
        how = (" (on a flag the branch sets, where this node's launch can wait on one; "
               "else a graph join)" if graph.meta.get("streams", {}).get("signal") else "")
        return [f"  stream: main; waits here for the side branch of {', '.join(joined)}{how}"]
    return []


def choice_text(choice: dict[str, Any] | None) -> str:
    """A node's decision at one bin as text: ``splitk m_tile=64 n_tile=8 split=2 stages=4``
    (``(none)`` where it has none)."""
    if not choice:
        return "(none)"
    tactic = " ".join(f"{k}={v}" for k, v in (choice.get("tactic") or {}).items())
    return f"{choice['provider']}{' ' + tactic if tactic else ''}"


def explain(graph: Graph, node_name: str) -> str:
    """A readable, multi-line explanation of ``node_name``'s decisions per bin (provider,
    tactic, reason with the table row), the caps that apply, and its PDL mark and prefetch
    bytes when the pdl pass ran. An unknown node is a UserError naming close names."""
    if not graph.has_node(node_name):
        names = [n.name for n in graph]
        close = difflib.get_close_matches(node_name, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"no node named {node_name!r} in graph {graph.name}{hint}")
    node = graph.node(node_name)
    meta = graph.meta
    layers = layer_kinds(graph)
    kind = node_kind(node, layers)
    where = f"layer {node.layer}" if node.layer is not None else "step"
    lines = [f"node {node.name}: {node.op} ({where}, unit {node.unit or '-'}"
             + (f", kind {kind}" if kind else "") + f", {node.placement})"]
    for name in node.inputs:
        value = graph.values[name]
        if value.storage is Storage.WEIGHT:
            packed = (" packed[" + " | ".join(f"{s.name} {s.rows}" for s in value.segments)
                      + "]") if len(value.segments) > 1 else ""
            size = human_bytes(value.nbytes_static)
            lines.append(f"  weight {name}: {value.type}{packed} ({size})")
    tactics = meta.get("tactics")
    if tactics:
        lines.append(f"  tables: {tactics['target']} {tactics['version']} "
                     f"(sha256 {tactics['digest'][:12]}, {tactics.get('file', '?')})")
    caps = meta.get("caps")
    if caps:
        shown = ", ".join(f"{k} {v}" for k, v in caps.items() if k != "step")
        applies = f"; this node follows the {kind} cap {caps.get(kind)}" if kind in caps else ""
        lines.append(f"  caps: {shown}; step {caps.get('step')}{applies}")
    decisions = meta.get("decisions", {}).get(node.name)
    if decisions is None:
        lines.append("  decisions: none (the bin pass has not run)")
    else:
        q = meta.get("deployment", {}).get("q", 1)
        groups: list[tuple[list[str], dict[str, Any]]] = []
        for rows, choice in sorted(decisions.items(), key=lambda item: int(item[0])):
            if groups and groups[-1][1] == choice:
                groups[-1][0].append(rows)
            else:
                groups.append(([rows], choice))
        for bins, choice in groups:
            label = "bin " if len(bins) == 1 else "bins "
            head = f"  {label}{', '.join(bins)} rows" + (f" (q={q})" if q > 1 else "")
            lines.append(f"{head}: {choice_text(choice)}")
            lines.append(f"      why: {choice['reason']}")
    pdl = meta.get("pdl", {}).get(node.name)
    if pdl is not None:
        mark = "yes" if pdl["pdl"] else "no"
        lines.append(f"  pdl: {mark} ({pdl['reason']}); weight bytes before the wait: "
                     f"{human_bytes(pdl['prefetch_bytes'])}")
        for rows, why in pdl.get("off_bins", {}).items():
            lines.append(f"      not at bin {rows}: {why}")
        weights = {name for name in node.inputs
                   if graph.values[graph.root(name)].storage is Storage.WEIGHT}
        early = [name for name in pdl.get("pre_wait_inputs", ()) if name not in weights]
        if early:
            lines.append(f"      other inputs readable before the wait: {', '.join(early)}")
    lines.extend(_stream_lines(graph, node))
    if node.op == "prefetch":
        size = human_bytes(node.attrs["bytes"])
        lines.append(f"  prefetch fork {node.attrs.get('fork')}: {size} "
                     f"of the weights {node.attrs.get('target')} reads first")
    for other in graph:
        if other.op == "prefetch" and other.attrs.get("target") == node.name:
            lines.append(f"  warmed by {other.name} (fork {other.attrs.get('fork')}, "
                         f"{human_bytes(other.attrs['bytes'])} into L2)")
    return "\n".join(lines)
