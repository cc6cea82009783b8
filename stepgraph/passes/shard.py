"""The shard pass: per-rank shapes and the collectives a deployment's placement needs.

The frontend builds the step at logical TP1 shapes and marks each weight's intended
``layout``; this pass resolves the layouts against ``ctx.deployment`` (tp, dcp, dep) into
per-rank shapes, :class:`~stepgraph.ir.values.Split` records on weights, states and their
segments, node placements, and collective nodes. Impossible deployments are refused first
(:mod:`stepgraph.passes.shard_check`). The choices, all explicit:

**TP n** (every rank sees all rows of the step):

* ``heads`` weights (q/k/v/g/b, conv, f_b, g_b, dt_bias, A_log, q_b, kv_b, MLA gate) are cut
  on dim 0 into n parts of whole heads; ``heads`` states (KDA recurrent and conv states) on
  dim 1 (dim 0 is the state slot). Nodes reading them run on their local heads (attr
  ``heads`` becomes the local count) with ``Placement("sharded", "tp", n, dim="heads")``.
  KDA's f_a / low-rank g_a, MLA's q_a / kv_a / norms and the DSA indexer stay replicated; the
  MLA latent cache is replicated at TP without DCP (every rank writes the same rows).
* ``column`` weights (router ``gate``, latent ``routed_expert_down_proj``, gate|up of the
  dense MLP and shared expert) are cut on dim 0; a packed weight is cut segment by segment,
  so each rank holds its part of ``gate`` and of ``up``. A column-parallel *projection*'s
  output is all-gathered at once (the router needs every logit, the experts the whole latent);
  the pack pass later merges the MoE front's two gathers into one.
* ``row`` weights (o_proj, down_proj, routed_expert_up_proj) are cut on dim 1; their nodes
  read this rank's columns and write a partial sum.
* ``experts`` weights are cut on dim 0: at TP the experts are expert-parallel over the TP
  group (each rank holds experts/n whole experts, sees all rows and writes a partial latent
  sum). ``local_experts`` becomes experts/n and ``expert_split`` = {group, ways,
  local_experts}; the runtime sets ``expert_offset`` = rank * local_experts.
* ``vocab``: the embedding is vocab-parallel (each rank looks up its vocab rows, zeros
  elsewhere) and all-reduced; lm_head writes this rank's vocab columns, all-gathered into the
  logits output.
* Partial sums are reduced lazily, right before the first node that needs the whole value,
  so that an ``add`` of two partial sums over the same group stays partial: the MoE layer
  sums routed_up and the shared expert first and all-reduces the MoE output **once** (bf16
  partials added before the reduction; the same sum in another order).
* The routed partial latent is **reduce-scattered**, not all-reduced: the row-parallel
  routed_up only needs this rank's latent columns. The latent RMSNorm then runs sharded
  (attrs ``group``/``ways``: each rank normalizes its columns with the row mean square
  all-reduced over the group, B floats) on its slice of ``routed_expert_norm``. This halves
  the latent traffic and needs no rank-dependent slice in the IR.

**DCP n** (dcp == tp): the MLA latent caches (layout ``tokens``) are split over the DCP group
along tokens (shape stays symbolic; the host supplies each rank's own block tables, slot
mapping and local sequence lengths). After ``mla_query`` a ``dcp_gather`` collects the
group's query heads; the core attends all heads over the rank's tokens and writes a partial
``o_latent`` and its LSE (2 outputs); ``lse_merge`` returns the merged rows of the local
heads before ``mla_value``. DSA with DCP is refused (see shard_check).

**DEP n** (tp == 1): every node runs data-parallel on the rank's own rows
(``Placement("data", "ep", n)``, all heads, no attention collective); the ``experts``
weights are split over the EP group; ``ep_dispatch`` sends (latent rows, ids, weights) to the
ranks owning their experts (rows ``B*n``: at most every rank's rows) and ``ep_combine``
(attr ``dispatch``: the routing it reverses) sums them back into ``[B, width]``.

``meta["groups"]`` = {"tp": tp, "dcp": dcp, "ep": dep}, ``meta["world"]`` = max(tp, dep).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node, Placement
from stepgraph.ir.types import Dim, Storage, TensorType, scale_rows
from stepgraph.ir.values import Segment, Split, Value
from stepgraph.passes.manager import CompileContext, PassError, PassResult
from stepgraph.passes.shard_check import check_deployment

PASS = "shard"


@lru_cache(maxsize=4096)
def tensor_type(shape: tuple[Dim, ...], dtype: str) -> TensorType:
    """A (shared, immutable) TensorType: the pass re-types thousands of values."""
    return TensorType(shape, dtype)


def split_value(value: Value, split: Split) -> Value:
    """``value`` with dim ``split.dim`` cut in ``split.ways`` (symbolic dims stay as they are).

    Segments cut on dim 0 keep their order and each take ``rows / ways`` (each rank holds its
    part of every source); segments cut on another dim keep their rows. Every segment records
    the split.
    """
    shape = list(value.type.shape)
    size = shape[split.dim]
    if isinstance(size, int):
        if size % split.ways:
            raise PassError(PASS, f"{value.name} has {size} on dim {split.dim}, which does not "
                            f"split {split.ways} ways")
        shape[split.dim] = size // split.ways
    segments = []
    offset = 0
    for segment in value.segments:
        rows = segment.rows
        if split.dim == 0:
            if rows % split.ways:
                raise PassError(PASS, f"segment {segment.name} of {value.name} has {rows} rows, "
                                f"which do not split {split.ways} ways")
            rows //= split.ways
        segments.append(Segment(name=segment.name, source=segment.source, rows=rows,
                                offset=offset, split=split))
        offset += rows
    return Value(name=value.name, type=tensor_type(tuple(shape), value.type.dtype),
                 storage=value.storage, segments=tuple(segments), layout=value.layout,
                 split=split, owner=value.owner, view=value.view, attrs=value.attrs)


class _Rewriter:
    """Shared editing helpers: new temps, collectives, the rewritten program and counts."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.program: list[Node] = []
        self.counts: Counter[str] = Counter()

    def temp(self, name: str, shape: tuple, dtype: str, split: Split | None = None,
             **attrs: object) -> str:
        """Add a step-local value."""
        self.g.add_value(Value(name, tensor_type(shape, dtype), Storage.TEMP, split=split,
                               attrs=dict(attrs)))
        return name

    def retype(self, name: str, shape: tuple, split: Split | None = None) -> None:
        """Give an existing value its per-rank shape."""
        value = self.g.values[name]
        self.g.set_value(value.evolve(type=tensor_type(shape, value.type.dtype), split=split))

    def collective(self, op: str, name: str, inputs: tuple[str, ...],
                   outputs: tuple[str, ...], group: str, ways: int, dim: str,
                   like: Node, **attrs: object) -> None:
        """Append a collective node over ``group`` in ``like``'s layer and unit."""
        self.program.append(Node(
            name=name, op=op, inputs=inputs, outputs=outputs,
            attrs={"group": group, "ways": ways, **attrs},
            placement=Placement("sharded", group, ways, dim),
            layer=like.layer, unit=like.unit,
        ))
        self.counts[op] += 1

    def shape(self, name: str) -> tuple:
        """The current shape of value ``name``."""
        return self.g.values[name].type.shape

    def dtype(self, name: str) -> str:
        """The dtype of value ``name``."""
        return self.g.values[name].type.dtype


class _TensorParallel(_Rewriter):
    """TP n (and DCP n == tp) over one sweep of the program."""

    def __init__(self, graph: Graph, tp: int, dcp: int) -> None:
        super().__init__(graph)
        self.tp, self.dcp = tp, dcp
        self.users = graph.users()
        # logical value -> (the partial-sum value standing in for it, its producer)
        self.pending: dict[str, tuple[str, Node]] = {}
        # values holding this rank's columns of a logical tensor (row-parallel inputs)
        self.parts: set[str] = set()
        self.scattered: dict[str, str] = {}

    def placement(self, dim: str) -> Placement:
        """Sharded over the TP group along ``dim``."""
        return Placement("sharded", "tp", self.tp, dim)

    # ------------------------------------------------------------------ values

    def split_values(self) -> None:
        """Resolve every weight and state layout to its per-rank split."""
        tp = self.tp
        for value in list(self.g.values.values()):
            split: Split | None = None
            if value.storage is Storage.WEIGHT:
                if value.layout in ("heads", "column", "experts", "vocab"):
                    split = Split("tp", 0, tp)
                elif value.layout == "row":
                    split = Split("tp", 1, tp)
            elif value.storage is Storage.STATE:
                if value.layout == "heads":
                    split = Split("tp", 1, tp)
                elif value.layout == "tokens" and self.dcp > 1:
                    split = Split("dcp", 0, self.dcp)
            if split is not None:
                self.g.set_value(split_value(value, split))
                self.counts["split"] += 1

    # ------------------------------------------------------------------ partial sums

    def reduce(self, name: str) -> None:
        """All-reduce the pending partial sum of ``name`` into ``name``."""
        partial, producer = self.pending.pop(name)
        self.collective("all_reduce", f"{name}.all_reduce", (partial,), (name,), "tp",
                        self.tp, "columns", producer)

    def flush(self, node: Node) -> None:
        """Reduce every pending partial ``node`` reads."""
        for name in node.inputs:
            if name in self.pending:
                self.reduce(name)

    def defer(self, node: Node, out_index: int = 0) -> Node:
        """Make ``node`` write a partial sum of its output; reduced when first needed."""
        out = node.outputs[out_index]
        partial = self.temp(f"{out}.partial", self.shape(out), self.dtype(out), partial="tp")
        outputs = list(node.outputs)
        outputs[out_index] = partial
        node = node.evolve(outputs=tuple(outputs))
        self.pending[out] = (partial, node)
        return node

    def scatter(self, name: str) -> str:
        """Reduce-scatter the pending partial ``name``: this rank's summed columns."""
        if name in self.scattered:
            return self.scattered[name]
        partial, producer = self.pending[name]
        shape = self.shape(name)
        part = self.temp(f"{name}.part", (*shape[:-1], shape[-1] // self.tp), self.dtype(name),
                         Split("tp", len(shape) - 1, self.tp))
        self.collective("reduce_scatter", f"{name}.reduce_scatter", (partial,), (part,), "tp",
                        self.tp, "columns", producer)
        self.parts.add(part)
        self.scattered[name] = part
        return part

    def feeds_row_parallel(self, name: str) -> bool:
        """Whether every reader of ``name`` is a row-parallel projection."""
        readers = self.users.get(name, [])
        if not readers:
            return False
        for reader in readers:
            node = self.g.node(reader)
            if node.op not in ("projection", "o_proj") or node.inputs[0] != name:
                return False
            if self.g.values[node.inputs[1]].layout != "row":
                return False
        return True

    # ------------------------------------------------------------------ nodes

    def run(self) -> None:
        """Rewrite the whole program."""
        self.split_values()
        for node in self.g.nodes:
            handler = getattr(self, f"op_{node.op}", None)
            if handler is None:
                self.flush(node)
                self.program.append(node)
            else:
                handler(node)
        for name in list(self.pending):
            if self.g.values[name].storage is Storage.OUTPUT:
                self.reduce(name)
            else:  # absorbed into a sum or a reduce-scatter; the whole value is never needed
                del self.pending[name]
                self.g.remove_value(name)
        self.g.set_nodes(self.program)

    def op_embed(self, node: Node) -> None:
        """Vocab-parallel lookup (zeros outside the rank's rows), then an all-reduce."""
        rows = self.shape(node.inputs[1])[0]
        node = node.evolve(placement=self.placement("vocab"), attrs={
            **node.attrs, "vocab_split": {"group": "tp", "ways": self.tp, "rows": rows}})
        self.program.append(self.defer(node))

    def op_lm_head(self, node: Node) -> None:
        """This rank's vocab columns of the logits, all-gathered into the output."""
        weight = self.g.values[node.inputs[1]]
        if weight.split is None:
            self.flush(node)
            self.program.append(node)
            return
        self.flush(node)
        out = node.outputs[0]
        shape = self.shape(out)
        local = self.temp(f"{out}.local", (shape[0], weight.type.shape[0]), self.dtype(out),
                          Split("tp", 1, self.tp))
        self.program.append(node.evolve(outputs=(local,), placement=self.placement("vocab")))
        self.collective("all_gather", f"{out}.all_gather", (local,), (out,), "tp", self.tp,
                        "vocab", node)

    def op_projection(self, node: Node) -> None:
        """Heads / column / row parallel by the weight's layout; replicated otherwise."""
        weight_name = node.inputs[1]
        weight = self.g.values[weight_name]
        out = node.outputs[0]
        rows = weight.type.shape[0]
        if weight.layout == "row":
            self.row_parallel(node)
            return
        self.flush(node)
        if weight.split is None:
            self.program.append(node)
        elif weight.layout == "heads":
            self.retype(out, (self.shape(out)[0], rows), Split("tp", 1, self.tp))
            self.parts.add(out)
            self.program.append(node.evolve(placement=self.placement("heads")))
        elif weight.layout == "column":
            local = self.temp(f"{out}.local", (self.shape(out)[0], rows), self.dtype(out),
                              Split("tp", 1, self.tp))
            self.program.append(node.evolve(outputs=(local,), placement=self.placement("rows")))
            self.collective("all_gather", f"{out}.all_gather", (local,), (out,), "tp",
                            self.tp, "rows", node)
        else:
            raise PassError(PASS, f"a projection over a {weight.layout!r} weight "
                            f"({weight_name}) has no TP rule", node.name)

    def row_parallel(self, node: Node) -> None:
        """A row-parallel projection: this rank's columns in, a partial sum out."""
        x = node.inputs[0]
        if x in self.pending:
            x = self.scatter(x)
        elif x not in self.parts:
            raise PassError(PASS, f"the row-parallel projection reads {x}, which is neither "
                            f"this rank's columns nor a partial sum", node.name)
        node = node.evolve(inputs=(x, *node.inputs[1:]), placement=self.placement("columns"))
        self.flush(node)
        self.program.append(self.defer(node))

    op_o_proj = row_parallel

    def op_rmsnorm(self, node: Node) -> None:
        """Sharded RMSNorm of a reduce-scattered partial when only row-parallel
        projections read it; an ordinary (replicated) norm otherwise."""
        x, weight_name = node.inputs
        out = node.outputs[0]
        if x not in self.pending or not self.feeds_row_parallel(out):
            self.flush(node)
            self.program.append(node)
            return
        part = self.scatter(x)
        split = Split("tp", 0, self.tp)
        self.g.set_value(split_value(self.g.values[weight_name], split))
        shape = self.shape(out)
        self.retype(out, (*shape[:-1], shape[-1] // self.tp), Split("tp", 1, self.tp))
        self.parts.add(out)
        self.program.append(node.evolve(
            inputs=(part, weight_name), placement=self.placement("columns"),
            attrs={**node.attrs, "group": "tp", "ways": self.tp}))
        self.counts["sharded_norm"] += 1

    def op_add(self, node: Node) -> None:
        """A sum of partial sums over the same group stays a partial sum."""
        if len(node.inputs) >= 2 and all(name in self.pending for name in node.inputs):
            inputs = tuple(self.pending[name][0] for name in node.inputs)
            self.program.append(self.defer(node.evolve(inputs=inputs)))
            return
        self.flush(node)
        self.program.append(node)

    def op_kda_core(self, node: Node) -> None:
        """KDA on the local heads (split weights and states)."""
        self.flush(node)
        heads = node.attrs["heads"] // self.tp
        out = node.outputs[0]
        self.retype(out, (self.shape(out)[0], heads * node.attrs["head_dim"]),
                    Split("tp", 1, self.tp))
        self.parts.add(out)
        self.program.append(node.evolve(placement=self.placement("heads"),
                                        attrs={**node.attrs, "heads": heads}))

    def op_mla_query(self, node: Node) -> None:
        """The absorbed query of the local heads (the DSA indexer query stays whole)."""
        self.flush(node)
        heads = node.attrs["heads"] // self.tp
        q = node.outputs[0]
        shape = self.shape(q)
        self.retype(q, (shape[0], heads, shape[2]), Split("tp", 1, self.tp))
        self.program.append(node.evolve(placement=self.placement("heads"),
                                        attrs={**node.attrs, "heads": heads}))

    def op_mla_core(self, node: Node) -> None:
        """The attention core: local heads at TP; at DCP all gathered heads over the rank's
        tokens, a partial o_latent + LSE, and an LSE merge back to the local heads."""
        self.flush(node)
        all_heads = node.attrs["heads"]
        heads = all_heads // self.tp
        o = node.outputs[0]
        o_shape = self.shape(o)
        self.retype(o, (o_shape[0], heads, o_shape[2]), Split("tp", 1, self.tp))
        if self.dcp == 1:
            self.program.append(node.evolve(placement=self.placement("heads"),
                                            attrs={**node.attrs, "heads": heads}))
            return
        q = node.inputs[0]
        q_shape = self.shape(q)
        dcp = self.dcp
        gathered = self.temp(f"{q}.dcp", (q_shape[0], all_heads, q_shape[2]), self.dtype(q))
        self.collective("dcp_gather", f"{q}.dcp_gather", (q,), (gathered,), "dcp", dcp,
                        "heads", node)
        partial = self.temp(f"{o}.dcp", (o_shape[0], all_heads, o_shape[2]), self.dtype(o),
                            partial="dcp")
        lse = self.temp(f"{o}.lse", (o_shape[0], all_heads), "float32")
        self.program.append(node.evolve(
            inputs=(gathered, *node.inputs[1:]), outputs=(partial, lse),
            placement=Placement("sharded", "dcp", dcp, "tokens"),
            attrs={**node.attrs, "heads": all_heads, "lse": True}))
        self.collective("lse_merge", f"{o}.lse_merge", (partial, lse), (o,), "dcp", dcp,
                        "heads", node)

    op_dsa_core = op_mla_core

    def op_mla_value(self, node: Node) -> None:
        """W_UV and the output gate of the local heads."""
        self.flush(node)
        heads = node.attrs["heads"] // self.tp
        out = node.outputs[0]
        self.retype(out, (self.shape(out)[0], heads * node.attrs["v_head_dim"]),
                    Split("tp", 1, self.tp))
        self.parts.add(out)
        self.program.append(node.evolve(placement=self.placement("heads"),
                                        attrs={**node.attrs, "heads": heads}))

    def op_routed_experts(self, node: Node) -> None:
        """Expert parallel over the TP group: experts/tp whole experts, all rows, a partial
        sum of the expert outputs."""
        self.flush(node)
        local = node.attrs["experts"] // self.tp
        node = node.evolve(placement=self.placement("experts"), attrs={
            **node.attrs, "local_experts": local,
            "expert_split": {"group": "tp", "ways": self.tp, "local_experts": local}})
        self.program.append(self.defer(node))

    def gated_mlp(self, node: Node) -> None:
        """Column-parallel gate|up, row-parallel down: a partial sum on the local width."""
        self.flush(node)
        width = node.attrs["width"] // self.tp
        node = node.evolve(placement=self.placement("width"),
                           attrs={**node.attrs, "width": width})
        self.program.append(self.defer(node))

    op_shared_expert = gated_mlp
    op_dense_mlp = gated_mlp


class _DataExpertParallel(_Rewriter):
    """DEP n: data-parallel TP1 attention and MLPs, experts over the EP group."""

    def __init__(self, graph: Graph, ep: int) -> None:
        super().__init__(graph)
        self.ep = ep
        self.data = Placement("data", "ep", ep, "rows")

    def run(self) -> None:
        """Split the expert weights and rewrite the program."""
        split = Split("ep", 0, self.ep)
        for value in list(self.g.values.values()):
            if value.storage is Storage.WEIGHT and value.layout == "experts":
                self.g.set_value(split_value(value, split))
                self.counts["split"] += 1
        for node in self.g.nodes:
            if node.op == "routed_experts":
                self.experts(node)
            else:
                self.program.append(node.evolve(placement=self.data))
        self.g.set_nodes(self.program)

    def experts(self, node: Node) -> None:
        """ep_dispatch -> the rank's experts over the rows sent to it -> ep_combine."""
        ep = self.ep
        x, ids, weights = node.inputs[:3]
        sent = []
        for name in (x, ids, weights):
            shape = self.shape(name)
            sent.append(self.temp(f"{name}.ep", (scale_rows(shape[0], ep), *shape[1:]),
                                  self.dtype(name)))
        dispatch = f"{node.name}.ep_dispatch"
        self.collective("ep_dispatch", dispatch, (x, ids, weights), tuple(sent), "ep", ep,
                        "experts", node)
        out = node.outputs[0]
        shape = self.shape(out)
        received = self.temp(f"{out}.ep", (scale_rows(shape[0], ep), *shape[1:]),
                             self.dtype(out), partial="ep")
        local = node.attrs["experts"] // ep
        self.program.append(node.evolve(
            inputs=(*sent, *node.inputs[3:]), outputs=(received,),
            placement=Placement("sharded", "ep", ep, "experts"),
            attrs={**node.attrs, "local_experts": local,
                   "expert_split": {"group": "ep", "ways": ep, "local_experts": local}}))
        self.collective("ep_combine", f"{node.name}.ep_combine", (received,), (out,), "ep", ep,
                        "experts", node, dispatch=dispatch)


@dataclass(frozen=True)
class Shard:
    """Per-rank shapes and collectives for ``ctx.deployment`` (see the module docstring)."""

    name: ClassVar[str] = "shard"

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Refuse impossible deployments, then split values and insert collectives."""
        deployment = ctx.deployment
        check_deployment(ctx.model, deployment)
        tp, dcp, ep = deployment.tp, deployment.dcp, deployment.dep
        g = graph.copy()
        g.meta["groups"] = {"tp": tp, "dcp": dcp, "ep": ep}
        g.meta["world"] = max(tp, ep)
        g.meta["rank_local"] = True
        if tp == 1 and ep == 1:
            return PassResult(g, False, "tp=1 dcp=1 dep=1: nothing to shard")
        rewriter: _TensorParallel | _DataExpertParallel
        if ep > 1:
            rewriter = _DataExpertParallel(g, ep)
            where = f"dep={ep}"
        else:
            rewriter = _TensorParallel(g, tp, dcp)
            where = f"tp={tp}" + (f" dcp={dcp}" if dcp > 1 else "")
        rewriter.run()
        counts = rewriter.counts
        parts = [f"{counts.pop('split', 0)} weights/states split"]
        parts += [f"{n} {op}" for op, n in sorted(counts.items())]
        return PassResult(g, True, f"{where}: " + ", ".join(parts))
