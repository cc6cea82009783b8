"""The typed IR: values, types, nodes, the graph, its verifier and printers."""

from stepgraph.ir.graph import Graph, GraphError
from stepgraph.ir.nodes import REPLICATED, Node, Placement
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Segment, Split, Value, View
from stepgraph.ir.verify import VerifyError, verify

__all__ = [
    "REPLICATED",
    "Graph",
    "GraphError",
    "Node",
    "Placement",
    "Segment",
    "Split",
    "Storage",
    "TensorType",
    "Value",
    "VerifyError",
    "View",
    "verify",
]
