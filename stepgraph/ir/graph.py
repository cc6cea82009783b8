"""The step graph: values and nodes in program order, with a small editing API."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage
from stepgraph.ir.values import Value


class GraphError(Exception):
    """A malformed graph edit (unknown value, duplicate name, ...)."""


class Graph:
    """Values by name and nodes in program order.

    ``meta`` holds graph-wide facts (model name, deployment, the results of analysis passes:
    bins, memory plans, PDL marks) as JSON-able data.
    """

    def __init__(self, name: str = "step") -> None:
        self.name = name
        self.values: dict[str, Value] = {}
        self._nodes: list[Node] = []
        self._index: dict[str, int] = {}
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ building

    def add_value(self, value: Value) -> Value:
        """Add ``value``; its name must be new."""
        if value.name in self.values:
            raise GraphError(f"value {value.name!r} already exists")
        self.values[value.name] = value
        return value

    def set_value(self, value: Value) -> Value:
        """Replace the value of the same name."""
        if value.name not in self.values:
            raise GraphError(f"no value {value.name!r}")
        self.values[value.name] = value
        return value

    def remove_value(self, name: str) -> None:
        """Drop a value no node refers to any more."""
        del self.values[name]

    def add_node(self, node: Node) -> Node:
        """Append ``node`` at the end of the program."""
        if node.name in self._index:
            raise GraphError(f"node {node.name!r} already exists")
        self._index[node.name] = len(self._nodes)
        self._nodes.append(node)
        return node

    def set_nodes(self, nodes: Iterable[Node]) -> None:
        """Replace the whole program (used by passes that rewrite it in one sweep)."""
        nodes = list(nodes)
        index: dict[str, int] = {}
        for position, node in enumerate(nodes):
            if node.name in index:
                raise GraphError(f"node {node.name!r} appears twice")
            index[node.name] = position
        self._nodes, self._index = nodes, index

    # ------------------------------------------------------------------ reading

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes in program order."""
        return tuple(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        try:
            return self._nodes[self._index[name]]
        except KeyError:
            raise GraphError(f"no node {name!r}") from None

    def has_node(self, name: str) -> bool:
        """Whether a node called ``name`` exists."""
        return name in self._index

    def position(self, name: str) -> int:
        """The program position of node ``name``."""
        return self._index[name]

    def value(self, name: str) -> Value:
        """The value called ``name``."""
        try:
            return self.values[name]
        except KeyError:
            raise GraphError(f"no value {name!r}") from None

    def producers(self) -> dict[str, str]:
        """Value name -> the node that writes it (SSA outputs)."""
        return {out: node.name for node in self._nodes for out in node.outputs}

    def users(self) -> dict[str, list[str]]:
        """Value name -> the nodes that read it, in program order (views count as reads of
        their base)."""
        result: dict[str, list[str]] = {}
        for node in self._nodes:
            for name in node.inputs:
                result.setdefault(name, []).append(node.name)
        return result

    def values_of(self, storage: Storage) -> list[Value]:
        """Every value of one storage class, in insertion order."""
        return [v for v in self.values.values() if v.storage is storage]

    def root(self, name: str) -> str:
        """The value that owns ``name``'s memory (follows views to their base)."""
        value = self.values[name]
        while value.view is not None:
            value = self.values[value.view.base]
        return value.name

    def layers(self) -> list[int]:
        """The model layers present, ascending."""
        return sorted({n.layer for n in self._nodes if n.layer is not None})

    def copy(self) -> Graph:
        """A copy a pass may edit (passes are pure). Values and nodes are immutable; ``meta``
        is copied one level deep, so its values are shared with the original: a pass
        replaces a key's value and never edits the old value in place."""
        other = Graph(self.name)
        other.values = dict(self.values)
        other._nodes = list(self._nodes)
        other._index = dict(self._index)
        other.meta = dict(self.meta)
        return other

    def __str__(self) -> str:
        from stepgraph.ir.printer import format_graph

        return format_graph(self)


def vocab_size(graph: Graph) -> int:
    """The model's vocabulary: the embedding's rows (the whole table where the shard pass
    split it over ranks); a large bound when the graph has no embedding."""
    for node in graph:
        split = node.attrs.get("vocab_split")
        if node.op == "embed" and isinstance(split, dict):
            return int(split["rows"]) * int(split["ways"])
    for name in ("embed_tokens", "lm_head"):
        if name in graph.values:
            return int(graph.values[name].type.shape[0])
    return 2**31 - 1
