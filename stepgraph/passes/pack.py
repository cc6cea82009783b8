"""The pack pass: projections that read the same normalized input become one projection.

Within one layer unit, every ``projection`` node that reads the same input (the attention's
input norm, the MoE's post-attention norm) joins one group; a group of two or more becomes
ONE projection over ONE packed weight, placed where the group's first member was:

* KDA ``q | k | v | g (or g_a) | f_a | b`` -> ``layers.N.self_attn.in_proj_qkvgfab``
* MLA ``q_a (or q) | kv_a | gate`` -> ``layers.N.self_attn.fused_qkv_a_g_proj``
  (``fused_qkv_a_proj`` without an output gate)
* DSA ``q_a | kv_a | gate | index_k (wk) | index_weights`` ->
  ``layers.N.self_attn.fused_qkv_a_g_index_proj``
* MoE front ``router_logits | latent`` (router rows | latent down) ->
  ``layers.N.mlp.front_proj``. The shared expert's gate|up is already one weight.

Each packed weight lists named segments in program order: a member's rows remember their
checkpoint ``source`` and per-rank ``split`` (set by the shard pass, so at TP n a segment
holds this rank's part), and every member is padded to a multiple of ``align`` (16) rows by
a zero segment (``source`` None, named ``<member>.pad``). The member outputs become column
views of the packed output, so their readers do not change.

Output dtype: the widest of the members' output dtypes. Only the MoE front mixes dtypes
(fp32 router logits, bf16 latent): its packed output is **fp32** (the GEMM accumulates in
fp32 anyway; the router keeps fp32 logits and the expert provider reads the fp32 latent
view, casting on load, as ep_dispatch does when it sends the rows). ``front="off"`` leaves
the front unpacked instead.

At TP the shard pass all-gathers each column-parallel member (router logits, latent). When
every member of a group is read only by an all-gather over the same group, the gathers
merge into one all-gather of the packed output, and each member becomes a strided view of
it: ``View(gathered, start, stop, groups=ways, pitch=packed rows)``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import REPLICATED, Node
from stepgraph.ir.types import DTYPE_BYTES, Storage, TensorType
from stepgraph.ir.values import Segment, Split, Value, View
from stepgraph.passes.manager import CompileContext, PassError, PassResult

FRONT_MODES = ("fp32", "off")

# (layer kind, unit) -> the packed weight's name under ``layers.N``
_WEIGHT = {
    "kda": "self_attn.in_proj_qkvgfab",
    "mla": "self_attn.fused_qkv_a_g_proj",
    "dsa": "self_attn.fused_qkv_a_g_index_proj",
    "moe": "mlp.front_proj",
}
_NODE = {"attention": "in_proj", "mlp": "front"}


@dataclass(frozen=True)
class _Member:
    """One projection of a group: its node, weight, key (segment name) and packed rows."""

    node: Node
    weight: Value
    key: str
    start: int
    rows: int


def _round_up(rows: int, align: int) -> int:
    return -(-rows // align) * align


@dataclass(frozen=True)
class Pack:
    """Merge same-input projections into packed projections (see the module docstring).

    ``enabled``: off leaves the graph as it is; ``align``: each member's rows are padded to
    a multiple of it; ``front``: ``fp32`` packs the MoE front with an fp32 output, ``off``
    leaves it unpacked.
    """

    name: ClassVar[str] = "pack"
    enabled: bool = True
    align: int = 16
    front: str = "fp32"

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Pack every group of two or more same-input projections."""
        if self.align < 1:
            raise PassError(self.name, f"align={self.align}: use a positive row multiple")
        if self.front not in FRONT_MODES:
            raise PassError(self.name, f"front={self.front!r}: use one of "
                            f"{', '.join(FRONT_MODES)}")
        g = graph.copy()
        if not self.enabled:
            return PassResult(g, False, "disabled")
        editor = _Packer(g, self.align, self.front)
        editor.run()
        counts = editor.counts
        if not counts:
            return PassResult(g, False, "no projections share an input")
        parts = [f"{n} {kind}" for kind, n in sorted(counts.items()) if kind != "all_gather"]
        summary = "packed " + ", ".join(parts)
        if counts["all_gather"]:
            summary += f"; merged {counts['all_gather']} all_gathers"
        return PassResult(g, True, summary)


class _Packer:
    """One sweep: find the groups, build packed weights and nodes, rewrite the program."""

    def __init__(self, graph: Graph, align: int, front: str) -> None:
        self.g = graph
        self.align = align
        self.front = front
        self.users = graph.users()
        self.counts: Counter[str] = Counter()
        self.replace: dict[str, list[Node]] = {}
        self.drop: set[str] = set()
        self.taken: set[str] = set()
        layers = graph.meta.get("layers") or []
        self.kinds = {int(e["index"]): e for e in layers if isinstance(e, dict)}

    def run(self) -> None:
        """Pack every group and rewrite the program."""
        for members in self.groups():
            self.pack(members)
        if not self.replace:
            return
        program: list[Node] = []
        for node in self.g.nodes:
            if node.name in self.replace:
                program.extend(self.replace[node.name])
            elif node.name not in self.drop:
                program.append(node)
        self.g.set_nodes(program)

    def groups(self) -> list[list[Node]]:
        """Projection nodes grouped by (input, layer, unit), in program order."""
        found: dict[tuple[str, int, str], list[Node]] = {}
        for node in self.g.nodes:
            if node.op != "projection" or len(node.inputs) != 2 or node.layer is None:
                continue
            if node.unit not in _NODE or (node.unit == "mlp" and self.front == "off"):
                continue
            weight = self.g.values[node.inputs[1]]
            out = self.g.values[node.outputs[0]]
            if (weight.storage is not Storage.WEIGHT or len(weight.type.shape) != 2
                    or out.storage is not Storage.TEMP or out.view is not None):
                continue
            found.setdefault((node.inputs[0], node.layer, node.unit), []).append(node)
        return [members for members in found.values() if len(members) > 1]

    def kind(self, node: Node) -> str:
        """The layer kind naming the group: the attention kind, or ``moe``."""
        if node.unit == "mlp":
            return "moe"
        entry = self.kinds.get(node.layer or 0, {})
        return str(entry.get("attention", node.unit))

    def gather_of(self, out: str) -> Node | None:
        """The all-gather that is the only reader of ``out``, if there is one."""
        readers = self.users.get(out, [])
        if len(readers) != 1:
            return None
        reader = self.g.node(readers[0])
        if reader.op != "all_gather" or reader.inputs != (out,):
            return None
        return reader

    def pack(self, nodes: list[Node]) -> None:
        """Replace ``nodes`` (same input, layer, unit) by one packed projection."""
        g, first = self.g, nodes[0]
        weights = [g.values[n.inputs[1]] for n in nodes]
        if len({w.type.dtype for w in weights}) != 1 or any(
                w.split is not None and w.split.dim != 0 for w in weights):
            return  # mixed weight dtypes or a column split: not one GEMM over stacked rows
        prefix = f"l{first.layer}."
        members: list[_Member] = []
        segments: list[Segment] = []
        cursor = 0
        for node, weight in zip(nodes, weights, strict=True):
            key = node.name[len(prefix):] if node.name.startswith(prefix) else node.name
            start = cursor
            for segment in weight.segments:
                name = key if len(weight.segments) == 1 else f"{key}.{segment.name}"
                segments.append(Segment(name, segment.source, segment.rows, cursor,
                                        segment.split))
                cursor += segment.rows
            rows = cursor - start
            pad = _round_up(rows, self.align) - rows
            if pad:
                segments.append(Segment(f"{key}.pad", None, pad, cursor))
                cursor += pad
            members.append(_Member(node, weight, key, start, rows))
        kind = self.kind(first)
        base = _WEIGHT.get(kind, f"{first.unit}.packed_proj")
        if kind == "mla" and "gate" not in {m.key for m in members}:
            base = "self_attn.fused_qkv_a_proj"
        weight_name = self.fresh(f"layers.{first.layer}.{base}")
        split = next((w.split for w in weights if w.split is not None), None)
        hidden = weights[0].type.shape[1]
        g.add_value(Value(
            weight_name, TensorType((cursor, hidden), weights[0].type.dtype), Storage.WEIGHT,
            segments=tuple(segments), layout="column" if split else "replicated", split=split,
            attrs={"packed": [m.key for m in members], "align": self.align},
        ))
        outs = [g.values[n.outputs[0]] for n in nodes]
        dtype = max((o.type.dtype for o in outs), key=lambda d: DTYPE_BYTES[d])
        rows_dim = outs[0].type.shape[0]
        out = self.fresh(f"{prefix}{_NODE[first.unit]}")
        g.add_value(Value(out, TensorType((rows_dim, cursor), dtype), Storage.TEMP,
                          split=Split(split.group, 1, split.ways) if split else None))
        placement = next((n.placement for n in nodes if n.placement != REPLICATED), REPLICATED)
        packed_node = Node(
            name=self.fresh_node(out), op="projection", inputs=(first.inputs[0], weight_name),
            outputs=(out,), attrs={"packed": [m.key for m in members]},
            placement=placement, layer=first.layer, unit=first.unit,
        )
        emitted = [packed_node]
        gathers = [self.gather_of(n.outputs[0]) for n in nodes]
        merged = all(gathers) and len({(x.attrs.get("group"), x.attrs.get("ways"))
                                       for x in gathers if x is not None}) == 1
        if merged:
            emitted.append(self.merge_gathers(out, cursor, members, gathers))
        else:
            for member in members:
                value = g.values[member.node.outputs[0]]
                g.set_value(value.evolve(
                    type=TensorType((rows_dim, member.rows), dtype),
                    view=View(out, member.start, member.start + member.rows)))
        self.replace[first.name] = emitted
        self.drop.update(n.name for n in nodes[1:])
        for weight in weights:
            if self.users.get(weight.name, []) == [n.name for n in nodes if
                                                   n.inputs[1] == weight.name]:
                g.remove_value(weight.name)
        self.counts[kind if kind != "moe" else "moe_front"] += 1

    def merge_gathers(self, out: str, pitch: int, members: list[_Member],
                      gathers: list[Node | None]) -> Node:
        """One all-gather of the packed output; members become strided views of it."""
        g = self.g
        head = gathers[0]
        assert head is not None
        ways = int(head.attrs["ways"])
        packed = g.values[out]
        gathered = self.fresh(f"{out}.gathered")
        rows_dim = packed.type.shape[0]
        g.add_value(Value(gathered, TensorType((rows_dim, pitch * ways), packed.type.dtype),
                          Storage.TEMP))
        for member, gather in zip(members, gathers, strict=True):
            assert gather is not None
            target = g.values[gather.outputs[0]]
            g.set_value(target.evolve(
                type=TensorType((rows_dim, member.rows * ways), packed.type.dtype),
                view=View(gathered, member.start, member.start + member.rows, ways, pitch)))
            g.remove_value(member.node.outputs[0])
            self.drop.add(gather.name)
        self.counts["all_gather"] += len(gathers) - 1
        return Node(
            name=self.fresh_node(f"{out}.all_gather"), op="all_gather", inputs=(out,),
            outputs=(gathered,), attrs=dict(head.attrs), placement=head.placement,
            layer=head.layer, unit=head.unit,
        )

    def fresh(self, name: str) -> str:
        """``name``, or ``name.packed`` etc. if a value already has it."""
        candidate, n = name, 1
        while candidate in self.g.values:
            candidate, n = f"{name}.packed{n if n > 1 else ''}", n + 1
        return candidate

    def fresh_node(self, name: str) -> str:
        """A node name not yet used."""
        candidate, n = name, 1
        while self.g.has_node(candidate) or candidate in self.taken:
            candidate, n = f"{name}.{n}", n + 1
        self.taken.add(candidate)
        return candidate
