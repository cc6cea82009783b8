"""Printed forms of the IR: readable text (like torch.fx / MLIR), JSON, Graphviz DOT, Mermaid.

Text sigils: ``%`` temps and outputs, ``@`` weights, ``$`` states, ``!`` step inputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage
from stepgraph.ir.values import Value

SIGIL = {
    Storage.TEMP: "%",
    Storage.OUTPUT: "%",
    Storage.WEIGHT: "@",
    Storage.STATE: "$",
    Storage.INPUT: "!",
}

_HIDDEN_ATTRS = {"eps"}


def ref(value: Value) -> str:
    """A value as it appears in an operand list."""
    return f"{SIGIL[value.storage]}{value.name}"


def _attr(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def format_node(graph: Graph, node: Node) -> str:
    """One node as a line of text."""
    outs = ", ".join(f"{ref(graph.values[o])}: {graph.values[o].type}" for o in node.outputs)
    ins = ", ".join(ref(graph.values[i]) for i in node.inputs)
    attrs = ", ".join(f"{k}={_attr(v)}" for k, v in sorted(node.attrs.items())
                      if v is not None and k not in _HIDDEN_ATTRS)
    head = f"{outs} = " if outs else ""
    text = f"{head}{node.op}({ins})"
    if attrs:
        text += f" {{{attrs}}}"
    if node.placement.kind != "replicated":
        text += f" on {node.placement}"
    if node.updates:
        text += "  updates " + ", ".join(ref(graph.values[u]) for u in node.updates)
    return text


def format_value(value: Value) -> str:
    """A value declaration."""
    text = f"{ref(value)}: {value.type}"
    if value.split is not None:
        s = value.split
        text += f" split(dim={s.dim}, {s.group}{s.ways})"
    if value.view is not None:
        v = value.view
        text += f" = view(%{v.base}[{v.start}:{v.stop}]"
        text += f" x{v.groups} pitch {v.pitch})" if v.groups > 1 else ")"
    if len(value.segments) > 1:
        text += " packed[" + " | ".join(f"{s.name} {s.rows}" for s in value.segments) + "]"
    return text


def format_graph(
    graph: Graph,
    layers: set[int] | None = None,
    weights: bool = True,
    annotate: Callable[[Node], str] | None = None,
) -> str:
    """The whole graph as text; ``layers`` restricts the program to those model layers;
    ``annotate(node)`` adds a trailing comment (e.g. the provider chosen for a bin)."""
    lines = [f"graph {graph.name} {{"]
    if weights:
        shown = _referenced(graph, layers)
        for storage in (Storage.INPUT, Storage.STATE, Storage.WEIGHT):
            for value in graph.values_of(storage):
                if value.name in shown:
                    lines.append(f"  {format_value(value)}")
        views = [v for v in graph.values.values() if v.view is not None and v.name in shown]
        for value in views:
            lines.append(f"  {format_value(value)}")
        lines.append("")
    current: tuple[int | None, str] | None = None
    for node in graph:
        if layers is not None and node.layer not in layers:
            continue
        key = (node.layer, node.unit)
        if key != current:
            where = f"layer {node.layer}" if node.layer is not None else "step"
            lines.append(f"  // {where}: {node.unit}")
            current = key
        line = f"  {format_node(graph, node)}"
        note = annotate(node) if annotate is not None else ""
        lines.append(f"{line}  // {note}" if note else line)
    lines.append("}")
    return "\n".join(lines)


def _referenced(graph: Graph, layers: set[int] | None) -> set[str]:
    names: set[str] = set()
    for node in graph:
        if layers is None or node.layer in layers:
            names.update(node.inputs)
            names.update(node.outputs)
    return names


def _dot_id(name: str) -> str:
    return json.dumps(name)


def graph_to_dot(graph: Graph, layers: set[int] | None = None) -> str:
    """Graphviz DOT of the dataflow between nodes (temps as edges, one cluster per layer)."""
    producers = graph.producers()
    lines = ["digraph step {", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    by_layer: dict[int | None, list[Node]] = {}
    for node in graph:
        if layers is None or node.layer in layers:
            by_layer.setdefault(node.layer, []).append(node)
    for layer, nodes in by_layer.items():
        indent = "  "
        if layer is not None:
            lines.append(f"  subgraph cluster_l{layer} {{ label=\"layer {layer}\";")
            indent = "    "
        for node in nodes:
            label = f"{node.op}\\n{node.name}"
            lines.append(f"{indent}{_dot_id(node.name)} [label=\"{label}\"];")
        if layer is not None:
            lines.append("  }")
    shown = {n.name for nodes in by_layer.values() for n in nodes}
    for node in graph:
        if node.name not in shown:
            continue
        for name in node.inputs:
            source = producers.get(graph.root(name))
            if source is not None and source in shown:
                label = str(graph.values[name].type)
                lines.append(f"  {_dot_id(source)} -> {_dot_id(node.name)} [label=\"{label}\","
                             " fontsize=8];")
    lines.append("}")
    return "\n".join(lines)


def graph_to_mermaid(graph: Graph, layers: set[int] | None = None) -> str:
    """A Mermaid flowchart of the dataflow between nodes."""
    producers = graph.producers()
    ids: dict[str, str] = {}
    lines = ["flowchart TD"]
    for node in graph:
        if layers is None or node.layer in layers:
            ids[node.name] = f"n{len(ids)}"
            lines.append(f"  {ids[node.name]}[\"{node.op}<br/>{node.name}\"]")
    for node in graph:
        if node.name not in ids:
            continue
        for name in node.inputs:
            source = producers.get(graph.root(name))
            if source in ids:
                lines.append(f"  {ids[source]} --> {ids[node.name]}")
    return "\n".join(lines)
