"""Frontend: a model spec -> the IR of one decode step at logical (unsharded) shapes.

Every projection is its own node here; the ``shard`` pass splits weights and inserts
collectives, the ``pack`` pass merges projections that read the same input. Weight names
are logical checkpoint names (``layers.3.self_attn.q_proj``), which the weight loader maps
to a checkpoint's tensors.
"""

from __future__ import annotations

from typing import Any

from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Dim, Storage, TensorType
from stepgraph.ir.values import Segment, Value
from stepgraph.spec import (
    AttnResResidual,
    Deployment,
    DsaAttention,
    KdaAttention,
    MlaAttention,
    Model,
    MoeMlp,
)

ROWS = "B"


class StepBuilder:
    """Appends values and nodes to a graph with the frontend's naming conventions."""

    def __init__(self, model: Model, deployment: Deployment) -> None:
        self.model = model
        self.deployment = deployment
        self.act = model.dtype
        self.graph = Graph(model.name)
        self.layer: int | None = None
        self.unit = ""

    # ------------------------------------------------------------------ values

    def weight(
        self,
        name: str,
        shape: tuple[int, ...],
        layout: str = "replicated",
        dtype: str | None = None,
        segments: tuple[tuple[str, str, int], ...] | None = None,
        **attrs: Any,
    ) -> str:
        """A weight; ``segments``: (segment name, source, rows) of a multi-source weight."""
        if segments is None:
            parts = (Segment(name="w", source=name, rows=shape[0]),)
        else:
            offset, parts_list = 0, []
            for seg_name, source, rows in segments:
                parts_list.append(Segment(seg_name, source, rows, offset))
                offset += rows
            parts = tuple(parts_list)
        value = Value(
            name=name,
            type=TensorType(shape, dtype or self.act),
            storage=Storage.WEIGHT,
            segments=parts,
            layout=layout,
            attrs=attrs,
        )
        self.graph.add_value(value)
        return name

    def state(self, name: str, shape: tuple[Dim, ...], dtype: str, layout: str) -> str:
        """A caller-owned persistent state (its owner is set when a node updates it)."""
        value = Value(name, TensorType(shape, dtype), Storage.STATE, layout=layout)
        self.graph.add_value(value)
        return name

    def input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> str:
        """Step metadata the host writes before a replay."""
        if name not in self.graph.values:
            self.graph.add_value(Value(name, TensorType(shape, dtype), Storage.INPUT))
        return name

    def temp(self, name: str, shape: tuple[Dim, ...], dtype: str | None = None) -> str:
        """A step-local tensor."""
        full = self._scoped(name)
        self.graph.add_value(Value(full, TensorType(shape, dtype or self.act), Storage.TEMP))
        return full

    def output(self, name: str, shape: tuple[Dim, ...], dtype: str) -> str:
        """A tensor the host reads after the step."""
        self.graph.add_value(Value(name, TensorType(shape, dtype), Storage.OUTPUT))
        return name

    # ------------------------------------------------------------------ nodes

    def node(
        self,
        op: str,
        name: str,
        inputs: list[str],
        outputs: list[str],
        updates: list[str] | None = None,
        **attrs: Any,
    ) -> Node:
        """Append a node in the current layer and unit; states in ``updates`` get it as owner."""
        node = Node(
            name=self._scoped(name),
            op=op,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            attrs=attrs,
            layer=self.layer,
            unit=self.unit,
            updates=tuple(updates or ()),
        )
        for state in node.updates:
            value = self.graph.value(state)
            self.graph.set_value(value.evolve(owner=node.name))
        return self.graph.add_node(node)

    def _scoped(self, name: str) -> str:
        return name if self.layer is None else f"l{self.layer}.{name}"

    def prefix(self) -> str:
        """The weight-name prefix of the current layer."""
        return f"layers.{self.layer}"

    # ------------------------------------------------------------------ common units

    def projection(self, name: str, x: str, weight: str, out_dtype: str | None = None) -> str:
        """``x @ weight.T`` into a new temp named ``name``."""
        rows = self.graph.value(weight).type.shape[0]
        out = self.temp(name, (ROWS, rows), out_dtype)
        self.node("projection", name, [x, weight], [out])
        return out

    def rmsnorm(self, name: str, x: str, weight: str, eps: float) -> str:
        """RMSNorm of ``x`` (last dim) into a new temp."""
        width = self.graph.value(weight).type.shape[0]
        out = self.temp(name, (ROWS, width))
        self.node("rmsnorm", name, [x, weight], [out], eps=eps)
        return out

    def add(self, name: str, a: str, b: str) -> str:
        """``a + b`` into a new temp."""
        out = self.temp(name, self.graph.value(a).type.shape)
        self.node("add", name, [a, b], [out])
        return out


def _activation_attrs(model: Model) -> dict[str, Any]:
    act = model.activation
    if act.kind == "situ":
        return {"activation": "situ", "beta": act.beta, "beta_linear": act.beta_linear}
    return {"activation": "silu"}


# ---------------------------------------------------------------------- attention units


def build_kda(b: StepBuilder, spec: KdaAttention, x: str) -> str:
    """KDA attention of the normalized rows ``x``: projections, core, o_proj."""
    hidden = b.model.hidden_size
    heads, dim = spec.heads, spec.head_dim
    width = heads * dim
    p = f"{b.prefix()}.self_attn"
    projections = {}
    for name in ("q", "k", "v"):
        projections[name] = b.projection(
            name, x, b.weight(f"{p}.{name}_proj", (width, hidden), "heads", head_dim=dim)
        )
    if spec.output_gate.kind == "full":
        gate_weight = b.weight(f"{p}.g_proj", (width, hidden), "heads", head_dim=dim)
        projections["g"] = b.projection("g", x, gate_weight)
    else:
        rank = spec.output_gate.rank
        assert rank is not None
        projections["g"] = b.projection("g_a", x, b.weight(f"{p}.g_a_proj", (rank, hidden)))
    rank = spec.gate.rank
    projections["f_a"] = b.projection("f_a", x, b.weight(f"{p}.f_a_proj", (rank, hidden)))
    projections["b"] = b.projection(
        "b", x, b.weight(f"{p}.b_proj", (heads, hidden), "heads", head_dim=1)
    )
    core_weights = [
        b.weight(f"{p}.{n}_conv1d", (width, spec.conv_kernel), "heads", head_dim=dim)
        for n in ("q", "k", "v")
    ]
    core_weights.append(b.weight(f"{p}.f_b_proj", (width, rank), "heads", head_dim=dim))
    core_weights.append(b.weight(f"{p}.dt_bias", (width,), "heads", "float32", head_dim=dim))
    core_weights.append(b.weight(f"{p}.A_log", (heads,), "heads", "float32", head_dim=1))
    core_weights.append(b.weight(f"{p}.o_norm", (dim,)))
    if spec.output_gate.kind == "low_rank":
        core_weights.append(
            b.weight(
                f"{p}.g_b_proj", (width, spec.output_gate.rank or 0), "heads", head_dim=dim
            )
        )
    states = [b.state(f"{p}.recurrent_state", ("S", heads, dim, dim), "float32", "heads")]
    states += [
        b.state(f"{p}.{n}_conv_state", ("S", width, spec.conv_kernel - 1), b.act, "heads")
        for n in ("q", "k", "v")
    ]
    meta = [b.input("kda_state_indices", (ROWS,), "int32")]
    if b.deployment.q > 1:
        meta.append(b.input("num_accepted_tokens", (ROWS,), "int32"))
    out = b.temp("kda_out", (ROWS, width))
    gate = spec.gate
    b.node(
        "kda_core",
        "kda_core",
        [*(projections[n] for n in ("q", "k", "v", "g", "f_a", "b")), *core_weights, *states,
         *meta],
        [out],
        updates=states,
        heads=heads,
        head_dim=dim,
        conv_kernel=spec.conv_kernel,
        gate_form=gate.form,
        gate_lower_bound=gate.lower_bound,
        output_gate=spec.output_gate.kind,
        eps=spec.norm_eps,
        q=b.deployment.q,
    )
    return o_projection(b, out, f"{p}.o_proj", width)


def o_projection(b: StepBuilder, x: str, weight_name: str, width: int) -> str:
    """The o-projection (row-parallel at TP) of the attention core's output."""
    weight = b.weight(weight_name, (b.model.hidden_size, width), "row")
    out = b.temp("attn_out", (ROWS, b.model.hidden_size))
    b.node("o_proj", "o_proj", [x, weight], [out])
    return out


def build_mla(b: StepBuilder, spec: MlaAttention, x: str) -> str:
    """MLA (or DSA when ``spec`` is a :class:`DsaAttention`): projections, query, core, value,
    o_proj, in the absorbed decode form over a paged latent cache."""
    hidden = b.model.hidden_size
    heads = spec.heads
    qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    latent = spec.kv_lora_rank + spec.qk_rope_head_dim
    dsa = isinstance(spec, DsaAttention)
    p = f"{b.prefix()}.self_attn"
    if spec.q_lora_rank is not None:
        q_in = b.projection("q_a", x, b.weight(f"{p}.q_a_proj", (spec.q_lora_rank, hidden)))
    else:
        q_in = b.projection(
            "q", x, b.weight(f"{p}.q_proj", (heads * qk_dim, hidden), "heads", head_dim=qk_dim)
        )
    kv_a = b.projection("kv_a", x, b.weight(f"{p}.kv_a_proj_with_mqa", (latent, hidden)))
    gate = None
    if spec.output_gate is not None:
        if spec.output_gate.kind != "full":
            raise ValueError("MLA supports a full-rank output gate only")
        gate = b.projection(
            "gate",
            x,
            b.weight(f"{p}.g_proj", (heads * spec.v_head_dim, hidden), "heads",
                     head_dim=spec.v_head_dim),
        )
    kv_b = b.weight(
        f"{p}.kv_b_proj",
        (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        "heads",
        head_dim=spec.qk_nope_head_dim + spec.v_head_dim,
    )
    query_inputs = [q_in]
    if spec.q_lora_rank is not None:
        query_inputs += [
            b.weight(f"{p}.q_a_layernorm", (spec.q_lora_rank,)),
            b.weight(f"{p}.q_b_proj", (heads * qk_dim, spec.q_lora_rank), "heads",
                     head_dim=qk_dim),
        ]
    query_inputs.append(kv_b)
    rope = spec.rope is not None
    meta = {
        "block_tables": b.input("block_tables", (ROWS, "T"), "int32"),
        "seq_lens": b.input("seq_lens", (ROWS,), "int32"),
        "slot_mapping": b.input("slot_mapping", (ROWS,), "int64"),
    }
    if rope:
        meta["positions"] = b.input("positions", (ROWS,), "int32")
        query_inputs.append(meta["positions"])
    q_latent = b.temp("q_latent", (ROWS, heads, latent))
    query_outputs = [q_latent]
    common = dict(
        heads=heads,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_theta=spec.rope.theta if spec.rope else None,
        eps=spec.norm_eps,
        q_lora=spec.q_lora_rank is not None,
    )
    core_extra: list[str] = []
    if dsa:
        idx = spec.indexer
        q_lora = spec.q_lora_rank or hidden
        wq_b = b.weight(f"{p}.indexer.wq_b", (idx.heads * idx.head_dim, q_lora))
        query_inputs.insert(len(query_inputs) - (2 if rope else 1), wq_b)
        index_q = b.temp("index_q", (ROWS, idx.heads, idx.head_dim))
        query_outputs.append(index_q)
        index_k = b.projection("index_k", x, b.weight(f"{p}.indexer.wk", (idx.head_dim, hidden)))
        index_w = b.projection(
            "index_weights", x, b.weight(f"{p}.indexer.weights_proj", (idx.heads, hidden))
        )
        core_extra = [
            index_q,
            index_k,
            index_w,
            b.weight(f"{p}.indexer.k_norm", (idx.head_dim,)),
            b.weight(f"{p}.indexer.k_norm_bias", (idx.head_dim,)),
        ]
    b.node("mla_query", "mla_query", query_inputs, query_outputs, **common)
    cache = b.state(f"{p}.latent_cache", ("NB", "BS", latent), b.act, "tokens")
    states = [cache]
    if dsa:
        states.append(
            b.state(f"{p}.indexer.k_cache", ("NB", "BS", spec.indexer.head_dim), b.act, "tokens")
        )
    o_latent = b.temp("o_latent", (ROWS, heads, spec.kv_lora_rank))
    core_inputs = [
        q_latent,
        kv_a,
        b.weight(f"{p}.kv_a_layernorm", (spec.kv_lora_rank,)),
        *core_extra,
        *states,
        meta["block_tables"],
        meta["seq_lens"],
        meta["slot_mapping"],
    ]
    if rope:
        core_inputs.append(meta["positions"])
    scale = spec.softmax_scale or qk_dim**-0.5
    core_attrs = dict(common, softmax_scale=scale, q=b.deployment.q)
    if dsa:
        core_attrs.update(
            index_heads=spec.indexer.heads,
            index_head_dim=spec.indexer.head_dim,
            index_top_k=spec.indexer.top_k,
        )
    b.node("dsa_core" if dsa else "mla_core", "core", core_inputs, [o_latent],
           updates=states, **core_attrs)
    value_out = b.temp("attn_local", (ROWS, heads * spec.v_head_dim))
    value_inputs = [o_latent, kv_b] + ([gate] if gate else [])
    b.node("mla_value", "mla_value", value_inputs, [value_out], **common,
           gated=gate is not None)
    return o_projection(b, value_out, f"{p}.o_proj", heads * spec.v_head_dim)


# ---------------------------------------------------------------------- MLP units


def gated_mlp(b: StepBuilder, op: str, name: str, x: str, prefix: str, width: int) -> str:
    """A gated MLP (dense layer or shared expert): [gate | up] column, down row."""
    hidden = b.model.hidden_size
    gate_up = b.weight(
        f"{prefix}.gate_up_proj",
        (2 * width, hidden),
        "column",
        segments=(("gate", f"{prefix}.gate_proj", width), ("up", f"{prefix}.up_proj", width)),
    )
    down = b.weight(f"{prefix}.down_proj", (hidden, width), "row")
    out = b.temp(name, (ROWS, hidden))
    b.node(op, name, [x, gate_up, down], [out], width=width, **_activation_attrs(b.model))
    return out


def build_moe(b: StepBuilder, spec: MoeMlp, x: str) -> str:
    """Router, routed experts (latent when the spec says so) and shared expert."""
    hidden = b.model.hidden_size
    p = f"{b.prefix()}.mlp"
    experts, top_k = spec.experts, spec.top_k
    logits = b.projection("router_logits", x, b.weight(f"{p}.gate", (experts, hidden),
                                                       "column"), "float32")
    router_inputs = [logits]
    if spec.router.correction_bias:
        router_inputs.append(
            b.weight(f"{p}.gate.e_score_correction_bias", (experts,), dtype="float32")
        )
    ids = b.temp("topk_ids", (ROWS, top_k), "int32")
    weights = b.temp("topk_weights", (ROWS, top_k), "float32")
    b.node(
        "router",
        "router",
        router_inputs,
        [ids, weights],
        experts=experts,
        top_k=top_k,
        score=spec.router.activation,
        correction_bias=spec.router.correction_bias,
        renormalize=spec.router.renormalize,
        scaling_factor=spec.router.scaling_factor,
    )
    width = spec.latent.width if spec.latent else hidden
    expert_in = x
    if spec.latent:
        down = b.weight(f"{p}.routed_expert_down_proj", (width, hidden), "column")
        expert_in = b.projection("latent", x, down)
    gate_up = b.weight(
        f"{p}.experts.gate_up_proj",
        (experts, 2 * spec.expert_width, width),
        "experts",
        segments=(
            ("gate", f"{p}.experts.*.gate_proj", experts),
        ),
        stacked=("gate_proj", "up_proj"),
    )
    down_w = b.weight(
        f"{p}.experts.down_proj",
        (experts, width, spec.expert_width),
        "experts",
        segments=(("down", f"{p}.experts.*.down_proj", experts),),
        stacked=("down_proj",),
    )
    routed = b.temp("routed", (ROWS, width))
    b.node(
        "routed_experts",
        "routed_experts",
        [expert_in, ids, weights, gate_up, down_w],
        [routed],
        experts=experts,
        expert_offset=0,
        local_experts=experts,
        top_k=top_k,
        width=spec.expert_width,
        **_activation_attrs(b.model),
    )
    if spec.latent:
        if spec.latent.norm:
            routed = b.rmsnorm(
                "latent_norm", routed, b.weight(f"{p}.routed_expert_norm", (width,)),
                b.model.norm_eps,
            )
        up = b.weight(f"{p}.routed_expert_up_proj", (hidden, width), "row")
        routed_out = b.temp("routed_up", (ROWS, hidden))
        b.node("projection", "routed_up", [routed, up], [routed_out])
        routed = routed_out
    if spec.shared_width:
        shared = gated_mlp(b, "shared_expert", "shared", x, f"{p}.shared_experts",
                           spec.shared_width)
        return b.add("mlp_out", routed, shared)
    return routed


def build_mlp(b: StepBuilder, kind: str, x: str) -> str:
    """The layer's MLP (dense or MoE) of the normalized rows ``x``."""
    if kind == "dense":
        dense = b.model.mlp.dense
        assert dense is not None
        return gated_mlp(b, "dense_mlp", "mlp_out", x, f"{b.prefix()}.mlp",
                         dense.intermediate_size)
    moe = b.model.mlp.moe
    assert moe is not None
    return build_moe(b, moe, x)


def build_attention(b: StepBuilder, kind: str, x: str) -> str:
    """The layer's attention of the normalized rows ``x``."""
    spec = getattr(b.model.attention, kind)
    if kind == "kda":
        return build_kda(b, spec, x)
    return build_mla(b, spec, x)


# ---------------------------------------------------------------------- residual styles


class AttnResStream:
    """Block attention residuals: a bank of block values and a running prefix sum."""

    def __init__(self, b: StepBuilder, residual: AttnResResidual, embedded: str) -> None:
        self.b = b
        self.block_size = residual.block_size
        self.blocks: list[str] = []
        self.prefix: str | None = embedded
        self.fresh = True  # the prefix is the embedding itself (layer 0 skips its mix)

    def mix(self, name: str, weight_prefix: str) -> str:
        """Mix the completed blocks and the current prefix into a new temp."""
        b = self.b
        hidden = b.model.hidden_size
        sources = [*self.blocks, *( [self.prefix] if self.prefix else [] )]
        query = b.weight(f"{weight_prefix}.query", (hidden,))
        norm = b.weight(f"{weight_prefix}.norm", (hidden,))
        out = b.temp(name, ("B", hidden))
        b.node("attn_res_mix", name, [*sources, query, norm], [out],
               sources=len(sources), eps=b.model.norm_eps)
        return out

    def before_attention(self, layer: int) -> str:
        """The attention input of ``layer`` (before its input norm)."""
        assert self.prefix is not None
        h = self.prefix if layer == 0 else self.mix("attn_mix", f"layers.{layer}.attn_res")
        if layer % self.block_size == 0:
            self.blocks.append(self.prefix)
            self.prefix = None
        return h

    def accumulate(self, name: str, output: str) -> None:
        """prefix_sum += output (or starts as ``output`` after a block push)."""
        self.prefix = output if self.prefix is None else self.b.add(name, self.prefix, output)

    def before_mlp(self, layer: int) -> str:
        """The MLP input of ``layer`` (before its post-attention norm)."""
        return self.mix("mlp_mix", f"layers.{layer}.mlp_res")

    def final(self) -> str:
        """The last mix, before the final norm."""
        return self.mix("final_mix", "final_res")


class PlainStream:
    """The ordinary residual stream: x += sublayer(norm(x))."""

    def __init__(self, b: StepBuilder, embedded: str) -> None:
        self.b = b
        self.x = embedded

    def before_attention(self, layer: int) -> str:
        """The attention input of ``layer``."""
        return self.x

    def accumulate(self, name: str, output: str) -> None:
        """x += output."""
        self.x = self.b.add(name, self.x, output)

    def before_mlp(self, layer: int) -> str:
        """The MLP input of ``layer``."""
        return self.x

    def final(self) -> str:
        """The stream after the last layer."""
        return self.x


# ---------------------------------------------------------------------- the step


def build_step(model: Model, deployment: Deployment) -> Graph:
    """The IR of one decode step of ``model`` at logical (unsharded) shapes."""
    b = StepBuilder(model, deployment)
    hidden = model.hidden_size
    b.unit = "embed"
    tokens = b.input("tokens", (ROWS,), "int32")
    embed = b.weight("embed_tokens", (model.vocab_size, hidden), "vocab")
    embedded = b.temp("embedded", (ROWS, hidden))
    b.node("embed", "embed", [tokens, embed], [embedded])
    residual = model.residual
    stream: AttnResStream | PlainStream
    if isinstance(residual, AttnResResidual):
        stream = AttnResStream(b, residual, embedded)
    else:
        stream = PlainStream(b, embedded)
    for index, kinds in enumerate(model.layer_list()):
        b.layer = index
        b.unit = "attention"
        h = stream.before_attention(index)
        x = b.rmsnorm("input_norm", h, b.weight(f"layers.{index}.input_layernorm", (hidden,)),
                      model.norm_eps)
        attn = build_attention(b, kinds.attention, x)
        b.unit = "residual"
        stream.accumulate("residual_attn", attn)
        b.unit = "mlp"
        h = stream.before_mlp(index)
        x = b.rmsnorm("post_attention_norm", h,
                      b.weight(f"layers.{index}.post_attention_layernorm", (hidden,)),
                      model.norm_eps)
        mlp = build_mlp(b, kinds.mlp, x)
        b.unit = "residual"
        stream.accumulate("residual_mlp", mlp)
    b.layer = None
    b.unit = "head"
    h = stream.final()
    x = b.rmsnorm("final_norm", h, b.weight("norm", (hidden,)), model.norm_eps)
    head_name = "embed_tokens" if model.tie_embeddings else "lm_head"
    head = head_name if model.tie_embeddings else b.weight("lm_head", (model.vocab_size, hidden),
                                                            "vocab")
    logits = b.output("logits", (ROWS, model.vocab_size), "float32")
    b.node("lm_head", "lm_head", [x, head], [logits])
    b.graph.meta.update(
        model=model.name,
        layers=[
            {"index": i, "attention": k.attention, "mlp": k.mlp}
            for i, k in enumerate(model.layer_list())
        ],
        deployment=deployment.model_dump(mode="json"),
        world=1,
        rank_local=False,
    )
    return b.graph
