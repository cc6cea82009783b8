"""What differs between two compiled artifacts: their inputs (spec, deployment, options,
tactic tables), their graphs (nodes and weights), and per row bin the provider and tactic of
each node, the launches in the PDL chain and the arena size.

The question it answers is the one before an A/B on a GPU: did the other table, flag or spec
change exactly what it was meant to change? Torch-free, like the rest of the compile path.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from stepgraph.artifact import Artifact
from stepgraph.commands.views import bin_rows as bin_summaries
from stepgraph.commands.views import pdl_chain
from stepgraph.ir.graph import Graph
from stepgraph.ir.serialize import node_to_json, value_to_json
from stepgraph.ir.types import Storage
from stepgraph.memory.arena import bin_rows
from stepgraph.passes.bin import choice_text
from stepgraph.units import human_bytes

SHOWN_NAMES = 4  # node names listed in a group of equal changes before "and N more"
SHOWN_PATHS = 12  # differing spec paths listed


@dataclass
class DecisionChange:
    """Nodes of one op whose choice at one bin changed the same way (``a`` -> ``b``)."""

    op: str
    a: str
    b: str
    nodes: list[str]

    def to_json(self) -> dict[str, Any]:
        """As JSON-able data."""
        return {"op": self.op, "a": self.a, "b": self.b, "nodes": self.nodes}


@dataclass
class BinDiff:
    """One row bin both artifacts have: changed decisions, PDL chain, arena."""

    rows: int
    decisions: list[DecisionChange]
    in_chain: tuple[int | None, int | None]
    arena_bytes: tuple[int | None, int | None]

    @property
    def differs(self) -> bool:
        """Whether anything of this bin differs."""
        return bool(self.decisions) or self.in_chain[0] != self.in_chain[1] or (
            self.arena_bytes[0] != self.arena_bytes[1])

    def to_json(self) -> dict[str, Any]:
        """As JSON-able data."""
        return {"rows": self.rows, "decisions": [d.to_json() for d in self.decisions],
                "in_chain": list(self.in_chain), "arena_bytes": list(self.arena_bytes)}


@dataclass
class ArtifactDiff:
    """Everything that differs between artifact ``a`` and artifact ``b``."""

    hashes: tuple[str, str]
    inputs: dict[str, list[str]]  # section -> "path: a -> b" lines
    tables: tuple[str, str]
    nodes_only: tuple[list[str], list[str]]
    nodes_changed: list[str]
    weights_changed: list[str]
    bins_only: tuple[list[int], list[int]]
    bins: list[BinDiff]

    @property
    def same(self) -> bool:
        """Whether the two artifacts compile to the same step (hash equality aside)."""
        return not (any(self.inputs.values()) or self.tables[0] != self.tables[1]
                    or any(self.nodes_only) or self.nodes_changed or self.weights_changed
                    or any(self.bins_only) or any(b.differs for b in self.bins))

    def to_json(self) -> dict[str, Any]:
        """As JSON-able data (``stepgraph diff --format json``)."""
        return {
            "same": self.same,
            "hash": list(self.hashes),
            "inputs": self.inputs,
            "tables": list(self.tables),
            "nodes_only": {"a": self.nodes_only[0], "b": self.nodes_only[1]},
            "nodes_changed": self.nodes_changed,
            "weights_changed": self.weights_changed,
            "bins_only": {"a": self.bins_only[0], "b": self.bins_only[1]},
            "bins": [b.to_json() for b in self.bins],
        }


def value_paths(a: Any, b: Any, path: str = "") -> list[str]:
    """``"path: a -> b"`` for every leaf where two JSON-like values differ (a key missing on
    one side reads ``(none)``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            lines += value_paths(a.get(key, _MISSING), b.get(key, _MISSING), sub)
        return lines
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        lines = []
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            lines += value_paths(x, y, f"{path}[{index}]")
        return lines
    if a == b:
        return []
    return [f"{path}: {a!r} -> {b!r}"]


class _Missing:
    """A key one side lacks; it reads ``(none)`` in a difference line."""

    def __repr__(self) -> str:
        return "(none)"


_MISSING = _Missing()


def _decision_changes(a: Graph, b: Graph, rows: int) -> list[DecisionChange]:
    decisions_a = a.meta.get("decisions", {})
    decisions_b = b.meta.get("decisions", {})
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for node in a:
        if not b.has_node(node.name):
            continue
        choice_a = choice_text(decisions_a.get(node.name, {}).get(str(rows)))
        choice_b = choice_text(decisions_b.get(node.name, {}).get(str(rows)))
        if choice_a != choice_b:
            groups[(node.op, choice_a, choice_b)].append(node.name)
    return [DecisionChange(op, ca, cb, names) for (op, ca, cb), names in groups.items()]


def _arenas(graph: Graph) -> dict[int, int]:
    return {entry["rows"]: entry["memory"]["arena_bytes"] for entry in bin_summaries(graph)
            if "memory" in entry}


def _in_chain(chain: dict[str, Any], rows: int) -> int | None:
    entry = chain.get("bins", {}).get(str(rows))
    return entry["in_chain"] if entry else None


def _tables(document: dict[str, Any]) -> str:
    tables = document.get("tables") or {}
    if not tables:
        return "(none)"
    digest = str(tables.get("digest"))[:12]
    return f"{tables.get('target')} {tables.get('version')} (sha256 {digest})"


def _weights(graph: Graph) -> dict[str, dict[str, Any]]:
    return {v.name: value_to_json(v) for v in graph.values_of(Storage.WEIGHT)}


def diff_artifacts(a: Artifact, b: Artifact, only_bins: list[int] | None = None) -> ArtifactDiff:
    """What differs between ``a`` and ``b`` (both loaded and hash-checked); ``only_bins``
    limits the per-bin comparison to those row counts."""
    inputs = {section: value_paths(a.document.get(section), b.document.get(section))
              for section in ("spec", "deployment", "options")}
    names_a = [n.name for n in a.graph]
    names_b = [n.name for n in b.graph]
    set_a, set_b = set(names_a), set(names_b)
    changed = [name for name in names_a if name in set_b
               and node_to_json(a.graph.node(name)) != node_to_json(b.graph.node(name))]
    weights_a, weights_b = _weights(a.graph), _weights(b.graph)
    weights_changed = sorted(name for name in set(weights_a) | set(weights_b)
                             if weights_a.get(name) != weights_b.get(name))
    bins_a, bins_b = bin_rows(a.graph), bin_rows(b.graph)
    common = [rows for rows in bins_a if rows in bins_b]
    if only_bins:
        common = [rows for rows in common if rows in only_bins]
    chain_a, chain_b = pdl_chain(a.graph), pdl_chain(b.graph)
    arena_a, arena_b = _arenas(a.graph), _arenas(b.graph)
    bins = [BinDiff(rows, _decision_changes(a.graph, b.graph, rows),
                    (_in_chain(chain_a, rows), _in_chain(chain_b, rows)),
                    (arena_a.get(rows), arena_b.get(rows))) for rows in common]
    return ArtifactDiff(
        hashes=(a.hash, b.hash),
        inputs=inputs,
        tables=(_tables(a.document), _tables(b.document)),
        nodes_only=([n for n in names_a if n not in set_b], [n for n in names_b if n not in set_a]),
        nodes_changed=changed,
        weights_changed=weights_changed,
        bins_only=([r for r in bins_a if r not in bins_b], [r for r in bins_b if r not in bins_a]),
        bins=bins,
    )


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _pair(values: tuple[Any, Any], show: Any = str) -> str:
    a, b = values
    return show(a) if a == b else f"{show(a)} -> {show(b)}"


def _chain(counts: tuple[int | None, int | None]) -> str:
    a, b = counts
    if a is not None and b is not None:
        return f"{a} launches" if a == b else f"{a} -> {b} launches"
    a_text, b_text = ("off" if n is None else f"{n} launches" for n in counts)
    return a_text if a == b else f"{a_text} -> {b_text}"


def diff_text(diff: ArtifactDiff, path_a: str, path_b: str) -> str:
    """The diff as lines a person reads: ``a`` and ``b`` named, then each kind of difference,
    then the bins (one line each; the changed decisions grouped by op and change)."""
    lines = [f"a: {path_a} (hash {diff.hashes[0][:12]}, tables {diff.tables[0]})",
             f"b: {path_b} (hash {diff.hashes[1][:12]}, tables {diff.tables[1]})"]
    if diff.same:
        lines.append("same step: no difference in inputs, graph, decisions, PDL chain or arena")
        return "\n".join(lines)
    for section, paths in diff.inputs.items():
        if paths:
            lines.append(f"{section}: {len(paths)} differ")
            lines += [f"  {p}" for p in paths[:SHOWN_PATHS]]
            if len(paths) > SHOWN_PATHS:
                lines.append(f"  and {len(paths) - SHOWN_PATHS} more")
    if diff.tables[0] != diff.tables[1]:
        lines.append(f"tables: {diff.tables[0]} -> {diff.tables[1]}")
    for side, names in zip("ab", diff.nodes_only, strict=True):
        if names:
            lines.append(f"nodes only in {side}: {len(names)} ({_names(names)})")
    if diff.nodes_changed:
        lines.append(f"nodes changed (op, operands, attributes or placement): "
                     f"{len(diff.nodes_changed)} ({_names(diff.nodes_changed)})")
    if diff.weights_changed:
        lines.append(f"weights changed (shape, layout, split or packing): "
                     f"{len(diff.weights_changed)} ({_names(diff.weights_changed)})")
    for side, rows in zip("ab", diff.bins_only, strict=True):
        if rows:
            lines.append(f"bins only in {side}: {', '.join(map(str, rows))} rows")
    for entry in diff.bins:
        changed = sum(len(d.nodes) for d in entry.decisions)
        head = (f"rows {entry.rows}: {changed} decision{'s' if changed != 1 else ''} differ; "
                f"PDL chain {_chain(entry.in_chain)}; arena "
                f"{_pair(entry.arena_bytes, lambda n: '?' if n is None else human_bytes(n))}")
        lines.append(head if entry.differs else f"rows {entry.rows}: same")
        for change in entry.decisions:
            lines.append(f"  {change.op} x{len(change.nodes)} ({_names(change.nodes)}): "
                         f"{change.a} -> {change.b}")
    return "\n".join(lines)
