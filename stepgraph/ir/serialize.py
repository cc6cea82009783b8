"""The graph as JSON-able data and back (the artifact's ``graph`` section)."""

from __future__ import annotations

import json
from typing import Any

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node, Placement
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Segment, Split, Value, View


def _split_json(split: Split | None) -> dict[str, Any] | None:
    if split is None:
        return None
    return {"group": split.group, "dim": split.dim, "ways": split.ways}


def _split_from(data: dict[str, Any] | None) -> Split | None:
    return None if data is None else Split(data["group"], data["dim"], data["ways"])


def value_to_json(value: Value) -> dict[str, Any]:
    """One value as JSON-able data."""
    item: dict[str, Any] = {
        "name": value.name,
        "storage": str(value.storage),
        "shape": list(value.type.shape),
        "dtype": value.type.dtype,
    }
    if value.storage is Storage.WEIGHT:
        item["layout"] = value.layout
        item["segments"] = [
            {"name": s.name, "source": s.source, "rows": s.rows, "offset": s.offset,
             "split": _split_json(s.split)}
            for s in value.segments
        ]
    elif value.layout != "replicated":
        item["layout"] = value.layout
    if value.split is not None:
        item["split"] = _split_json(value.split)
    if value.view is not None:
        v = value.view
        item["view"] = {"base": v.base, "start": v.start, "stop": v.stop, "groups": v.groups,
                        "pitch": v.pitch}
    if value.owner is not None:
        item["owner"] = value.owner
    if value.attrs:
        item["attrs"] = value.attrs
    return item


def value_from_json(item: dict[str, Any]) -> Value:
    """The inverse of :func:`value_to_json`."""
    view = item.get("view")
    return Value(
        name=item["name"],
        type=TensorType(tuple(item["shape"]), item["dtype"]),
        storage=Storage(item["storage"]),
        segments=tuple(
            Segment(s["name"], s["source"], s["rows"], s["offset"], _split_from(s["split"]))
            for s in item.get("segments", ())
        ),
        layout=item.get("layout", "replicated"),
        split=_split_from(item.get("split")),
        owner=item.get("owner"),
        view=None if view is None else View(**view),
        attrs=_tuples(item.get("attrs", {})),
    )


def _tuples(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}


def node_to_json(node: Node) -> dict[str, Any]:
    """One node as JSON-able data."""
    p = node.placement
    return {
        "name": node.name,
        "op": node.op,
        "inputs": list(node.inputs),
        "outputs": list(node.outputs),
        "updates": list(node.updates),
        "attrs": node.attrs,
        "placement": {"kind": p.kind, "group": p.group, "ways": p.ways, "dim": p.dim},
        "layer": node.layer,
        "unit": node.unit,
    }


def node_from_json(item: dict[str, Any]) -> Node:
    """The inverse of :func:`node_to_json`."""
    return Node(
        name=item["name"],
        op=item["op"],
        inputs=tuple(item["inputs"]),
        outputs=tuple(item["outputs"]),
        attrs=dict(item["attrs"]),
        placement=Placement(**item["placement"]),
        layer=item["layer"],
        unit=item["unit"],
        updates=tuple(item["updates"]),
    )


def _intern_decisions(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``decisions`` ({node: per-bin dict}) stored once per distinct per-bin
    dict: ``decisions`` becomes {node: index} into ``decision_table`` (thousands of nodes
    share a few hundred distinct choices)."""
    decisions = meta.get("decisions")
    if not decisions:
        return meta
    table: list[Any] = []
    index_of: dict[str, int] = {}
    index_of_object: dict[int, int] = {}  # the bin pass shares one dict among like nodes
    compact = {}
    for node, per_bin in decisions.items():
        index = index_of_object.get(id(per_bin))
        if index is None:
            key = json.dumps(per_bin, sort_keys=True)
            index = index_of.setdefault(key, len(table))
            if index == len(table):
                table.append(per_bin)
            index_of_object[id(per_bin)] = index
        compact[node] = index
    return {**meta, "decisions": compact, "decision_table": table}


def _expand_decisions(meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_intern_decisions`."""
    if "decision_table" not in meta:
        return meta
    table = meta["decision_table"]
    expanded = {k: v for k, v in meta.items() if k != "decision_table"}
    expanded["decisions"] = {node: table[i] for node, i in meta["decisions"].items()}
    return expanded


def graph_to_json(graph: Graph) -> dict[str, Any]:
    """The graph (values, nodes, meta) as JSON-able data."""
    return {
        "name": graph.name,
        "values": [value_to_json(v) for v in graph.values.values()],
        "nodes": [node_to_json(n) for n in graph],
        "meta": _intern_decisions(graph.meta),
    }


def graph_from_json(data: dict[str, Any]) -> Graph:
    """Rebuild a graph from :func:`graph_to_json`'s data."""
    graph = Graph(data["name"])
    for item in data["values"]:
        graph.add_value(value_from_json(item))
    graph.set_nodes(node_from_json(item) for item in data["nodes"])
    graph.meta = _expand_decisions(data.get("meta", {}))
    return graph
