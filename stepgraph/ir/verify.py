"""The IR verifier: every edge typed consistently, temps written before read, states
written only by their owner, placements consistent."""

from __future__ import annotations

from stepgraph.ir.graph import Graph
from stepgraph.ir.ops import OPS, TypeRuleError
from stepgraph.ir.types import Storage


class VerifyError(Exception):
    """A graph that breaks an IR invariant; the message names the node or value."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


def _fail(message: str, node: str | None = None) -> None:
    raise VerifyError(message if node is None else f"node {node}: {message}", node)


def _check_values(graph: Graph) -> None:
    for value in graph.values.values():
        if value.view is not None:
            base = graph.values.get(value.view.base)
            if base is None:
                _fail(f"view {value.name} of missing value {value.view.base}")
                continue
            view = value.view
            pitch = view.pitch if view.groups > 1 else base.type.shape[-1]
            if isinstance(pitch, int) and (
                view.stop > pitch or view.start < 0 or view.start >= view.stop
                or view.groups * pitch != base.type.shape[-1]
            ):
                _fail(f"view {value.name} [{view.start}:{view.stop}] x{view.groups} does not fit "
                      f"its base {base.name} {base.type}")
            if value.type.shape[-1] != view.width or value.type.dtype != base.type.dtype:
                _fail(f"view {value.name} is {value.type} but selects {view.width} columns of "
                      f"{base.type}")
        if value.storage is Storage.WEIGHT and value.segments:
            end = 0
            for segment in value.segments:
                if segment.offset != end:
                    _fail(f"weight {value.name}: segment {segment.name} starts at "
                          f"{segment.offset}, expected {end}")
                end = segment.offset + segment.rows
            if end != value.type.shape[0] and not value.attrs.get("stacked"):
                _fail(f"weight {value.name}: segments cover {end} rows of {value.type.shape[0]}")


def _check_program(graph: Graph) -> None:
    written: set[str] = set()
    producers: dict[str, str] = {}
    values = graph.values
    writable = (Storage.TEMP, Storage.OUTPUT)
    for node in graph:
        opdef = OPS.get(node.op)
        if opdef is None:
            _fail(f"unknown op {node.op!r}", node.name)
            continue
        if len(node.inputs) < opdef.min_inputs:
            _fail(f"{node.op} takes at least {opdef.min_inputs} inputs", node.name)
        if opdef.num_outputs is not None and len(node.outputs) != opdef.num_outputs:
            _fail(f"{node.op} writes {opdef.num_outputs} outputs, not {len(node.outputs)}",
                  node.name)
        ins = []
        for name in node.inputs:
            value = values.get(name)
            if value is None:
                _fail(f"reads unknown value {name}", node.name)
                continue
            ins.append(value.type)
            # Temps and outputs (through views) must be written before they are read.
            if value.storage in writable:
                root = name if value.view is None else graph.root(name)
                if root not in written:
                    _fail(f"reads {name} before anything writes it", node.name)
        for name in node.updates:
            value = values.get(name)
            if value is None or value.storage is not Storage.STATE:
                _fail(f"updates {name}, which is not a state", node.name)
            elif value.owner != node.name:
                _fail(f"updates state {name} owned by {value.owner}", node.name)
            if name not in node.inputs:
                _fail(f"updates state {name} without reading it", node.name)
        outs = []
        for name in node.outputs:
            value = values.get(name)
            if value is None:
                _fail(f"writes unknown value {name}", node.name)
                continue
            outs.append(value.type)
            if value.storage not in writable:
                _fail(f"writes {name}, a {value.storage} (only temps and outputs are written)",
                      node.name)
            if value.view is not None:
                _fail(f"writes {name}, which is a view", node.name)
            if name in producers:
                _fail(f"writes {name}, already written by {producers[name]}", node.name)
            producers[name] = node.name
            written.add(name)
        try:
            opdef.rule(node, ins, outs)
        except TypeRuleError as error:
            _fail(f"{node.op}: {error}", node.name)
        except (IndexError, KeyError) as error:
            _fail(f"{node.op}: malformed operands ({type(error).__name__}: {error})", node.name)
    for value in values.values():
        if value.storage is Storage.STATE and value.owner is None:
            _fail(f"state {value.name} has no owner")
        if value.storage is Storage.OUTPUT and value.name not in written:
            _fail(f"output {value.name} is never written")


def _check_placements(graph: Graph) -> None:
    groups = graph.meta.get("groups", {})
    for node in graph:
        placement = node.placement
        if placement.kind == "replicated":
            continue
        size = groups.get(placement.group)
        if size is None:
            _fail(f"placed on group {placement.group}, which this deployment lacks", node.name)
        elif placement.ways != size:
            _fail(f"placed on {placement.ways} ranks of {placement.group}, which has {size}",
                  node.name)
        if "ways" in node.attrs and node.attrs["ways"] != placement.ways:
            _fail(f"collective over {node.attrs['ways']} ranks placed on {placement.ways}",
                  node.name)
        for name in node.inputs:
            value = graph.values[name]
            split = value.split
            mismatched = split is not None and (split.group, split.ways) != (
                placement.group, placement.ways)
            if mismatched and value.storage is Storage.WEIGHT:
                assert split is not None
                _fail(f"weight {name} is split over {split.group}{split.ways} but the node "
                          f"runs {placement}", node.name)


def verify(graph: Graph) -> None:
    """Raise :class:`VerifyError` on the first broken invariant."""
    _check_values(graph)
    _check_program(graph)
    _check_placements(graph)
