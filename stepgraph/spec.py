"""The model spec and deployment schema: what a user writes in ``models/*.yaml``.

A spec file has two top-level sections:

* ``model``: the architecture (sizes, per-kind attention and MLP attributes, the layer
  list written compactly with ``at`` selectors that expand to an exact per-layer list);
* ``deployment`` (optional): TP / DCP / DEP, batch bins, tokens per request in a verify
  step and the target GPU. Command-line flags override it.

Every model is strict: unknown keys and wrong types are refused. ``Spec.model_json_schema()``
is what ``stepgraph schema`` prints.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTypeName = Literal["bfloat16", "float16", "float32"]
AttentionKind = Literal["kda", "mla", "dsa"]
MlpKind = Literal["dense", "moe"]

PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0)]

DEFAULT_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class Strict(BaseModel):
    """Base of every spec model: unknown keys refused, values immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------- activation


class SituActivation(Strict):
    """SiTU: b * tanh(gate / b) * sigmoid(gate) * bl * tanh(up / bl), computed in fp32."""

    kind: Literal["situ"]
    beta: PositiveFloat = 4.0
    beta_linear: PositiveFloat = 25.0


class SiluActivation(Strict):
    """SwiGLU: silu(gate) * up."""

    kind: Literal["silu"]


Activation = Annotated[SituActivation | SiluActivation, Field(discriminator="kind")]


# ----------------------------------------------------------------------------- residual


class AttnResResidual(Strict):
    """Block attention residuals: a bank of block values mixed by a learned pseudo-query."""

    kind: Literal["attn_res"]
    block_size: PositiveInt


class PlainResidual(Strict):
    """The ordinary pre-norm residual stream: x += sublayer(norm(x))."""

    kind: Literal["plain"]


Residual = Annotated[AttnResResidual | PlainResidual, Field(discriminator="kind")]


# ----------------------------------------------------------------------------- attention


class OutputGate(Strict):
    """The sigmoid output gate before o_proj: full rank (hidden -> heads*dim) or low rank."""

    kind: Literal["full", "low_rank"]
    rank: PositiveInt | None = None

    @model_validator(mode="after")
    def _rank_matches_kind(self) -> OutputGate:
        if self.kind == "low_rank" and self.rank is None:
            raise ValueError("a low_rank output gate needs `rank`")
        if self.kind == "full" and self.rank is not None:
            raise ValueError("a full output gate takes no `rank`")
        return self


class KdaGate(Strict):
    """The KDA decay gate: ``lower_bound``: g = lb * sigmoid(exp(A_log) * (f + dt_bias));
    ``softplus``: g = -exp(A_log) * softplus(f + dt_bias)."""

    form: Literal["lower_bound", "softplus"]
    lower_bound: float | None = None
    rank: PositiveInt = Field(description="width of the low-rank f_a -> f_b gate projection")

    @model_validator(mode="after")
    def _bound_matches_form(self) -> KdaGate:
        if self.form == "lower_bound" and (self.lower_bound is None or self.lower_bound >= 0):
            raise ValueError("the lower_bound gate form needs a negative `lower_bound`")
        if self.form == "softplus" and self.lower_bound is not None:
            raise ValueError("the softplus gate form takes no `lower_bound`")
        return self


class KdaAttention(Strict):
    """Kimi Delta Attention: gated delta-rule linear attention with a short conv."""

    heads: PositiveInt
    head_dim: PositiveInt
    conv_kernel: PositiveInt = 4
    gate: KdaGate
    output_gate: OutputGate
    norm_eps: PositiveFloat = 1e-5


class Rope(Strict):
    """Rotary embedding of the rope dims (DeepSeek style, non-interleaved)."""

    theta: PositiveFloat = 10000.0


class MlaAttention(Strict):
    """Multi-head latent attention (absorbed decode over a latent cache)."""

    heads: PositiveInt
    q_lora_rank: PositiveInt | None
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: NonNegativeInt
    v_head_dim: PositiveInt
    rope: Rope | None = Field(None, description="null: NoPE (rope dims enter q.k unrotated)")
    output_gate: OutputGate | None = None
    softmax_scale: PositiveFloat | None = Field(
        None, description="default: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5"
    )
    norm_eps: PositiveFloat = 1e-5


class DsaIndexer(Strict):
    """The lightning indexer of DeepSeek sparse attention."""

    heads: PositiveInt
    head_dim: PositiveInt
    top_k: PositiveInt


class DsaAttention(MlaAttention):
    """MLA whose core attends only over the indexer's top-k cached tokens."""

    indexer: DsaIndexer


class AttentionKinds(Strict):
    """Per-kind attention attributes; each kind a layer uses must be given."""

    kda: KdaAttention | None = None
    mla: MlaAttention | None = None
    dsa: DsaAttention | None = None


# ----------------------------------------------------------------------------- MLP


class DenseMlp(Strict):
    """A gated MLP: down(act(gate(x), up(x)))."""

    intermediate_size: PositiveInt


class Router(Strict):
    """Top-k routing: scores, optional correction bias (selection only), renormalize."""

    activation: Literal["sigmoid", "softmax"]
    correction_bias: bool
    renormalize: bool
    scaling_factor: PositiveFloat = 1.0


class Latent(Strict):
    """Latent MoE: routed experts run at a narrower width between down and up projections."""

    width: PositiveInt
    norm: bool = True


class MoeMlp(Strict):
    """Routed experts (optionally latent) plus a shared expert."""

    experts: PositiveInt
    top_k: PositiveInt
    expert_width: PositiveInt
    shared_width: NonNegativeInt = Field(description="0: no shared expert")
    latent: Latent | None = None
    router: Router

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoeMlp:
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")
        return self


class MlpKinds(Strict):
    """Per-kind MLP attributes; each kind a layer uses must be given."""

    dense: DenseMlp | None = None
    moe: MoeMlp | None = None


# ----------------------------------------------------------------------------- layers

_SELECTOR_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*(?:/\s*(\d+))?)?\s*$")


def expand_selector(selector: str | int | list[int], count: int) -> tuple[int, ...]:
    """The 0-based layer indices of an ``at`` selector.

    Accepted forms: an int; a list of ints; a string of comma-separated items, each ``N``,
    ``A-B`` (inclusive) or ``A-B/S`` (every S-th from A up to B), or ``all``.
    """
    if isinstance(selector, bool):
        raise ValueError("a layer selector is an int, a list of ints or a string")
    if isinstance(selector, int):
        indices = [selector]
    elif isinstance(selector, list):
        indices = list(selector)
    elif selector.strip() == "all":
        indices = list(range(count))
    else:
        indices = []
        for item in selector.split(","):
            match = _SELECTOR_ITEM.match(item)
            if match is None:
                raise ValueError(f"bad layer selector item {item.strip()!r} (use N, A-B or A-B/S)")
            start, end, step = match.groups()
            first = int(start)
            last = int(end) if end is not None else first
            stride = int(step) if step is not None else 1
            if last < first or stride < 1:
                raise ValueError(f"bad layer range {item.strip()!r}")
            indices.extend(range(first, last + 1, stride))
    for index in indices:
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"layer index {index!r} is not an int")
        if not 0 <= index < count:
            raise ValueError(f"layer {index} is outside 0..{count - 1}")
    if len(set(indices)) != len(indices):
        raise ValueError("a layer selector names a layer twice")
    return tuple(sorted(indices))


class LayerOverride(Strict):
    """Layers (``at``, 0-based) whose attention and/or MLP kind differs from the default."""

    at: str | int | list[int]
    attention: AttentionKind | None = None
    mlp: MlpKind | None = None


class LayerKinds(Strict):
    """The attention and MLP kind of one layer."""

    attention: AttentionKind
    mlp: MlpKind


class Layers(Strict):
    """The layer list, written compactly: a count, a default and overrides."""

    count: PositiveInt
    default: LayerKinds
    overrides: tuple[LayerOverride, ...] = ()

    @field_validator("overrides")
    @classmethod
    def _overrides_change_something(
        cls, overrides: tuple[LayerOverride, ...]
    ) -> tuple[LayerOverride, ...]:
        for override in overrides:
            if override.attention is None and override.mlp is None:
                raise ValueError(f"override at {override.at!r} sets neither attention nor mlp")
        return overrides

    def expand(self) -> tuple[LayerKinds, ...]:
        """The exact per-layer list (later overrides win)."""
        attention = [self.default.attention] * self.count
        mlp = [self.default.mlp] * self.count
        for override in self.overrides:
            for index in expand_selector(override.at, self.count):
                if override.attention is not None:
                    attention[index] = override.attention
                if override.mlp is not None:
                    mlp[index] = override.mlp
        return tuple(LayerKinds(attention=a, mlp=m) for a, m in zip(attention, mlp, strict=True))


# ----------------------------------------------------------------------------- model


class Model(Strict):
    """A decoder-only hybrid model."""

    name: str
    hidden_size: PositiveInt
    vocab_size: PositiveInt
    norm_eps: PositiveFloat = 1e-5
    dtype: DTypeName = "bfloat16"
    tie_embeddings: bool = False
    activation: Activation
    residual: Residual
    attention: AttentionKinds
    mlp: MlpKinds
    layers: Layers

    @model_validator(mode="after")
    def _kinds_are_defined(self) -> Model:
        expanded = self.layers.expand()
        for index, layer in enumerate(expanded):
            if getattr(self.attention, layer.attention) is None:
                raise ValueError(
                    f"layer {index} uses attention {layer.attention!r} but "
                    f"model.attention.{layer.attention} is not given"
                )
            if getattr(self.mlp, layer.mlp) is None:
                raise ValueError(
                    f"layer {index} uses mlp {layer.mlp!r} but model.mlp.{layer.mlp} is not given"
                )
        return self

    def layer_list(self) -> tuple[LayerKinds, ...]:
        """The exact per-layer kinds."""
        return self.layers.expand()


# ----------------------------------------------------------------------------- deployment


class Deployment(Strict):
    """How the step is served: parallelism, batch bins, verify width, target GPU.

    ``tp``: tensor parallel ranks; ``dcp``: decode context parallel ranks (the MLA/DSA
    latent cache sharded along tokens; must equal tp); ``dep``: data-parallel attention at
    TP1 with the experts split over ``dep`` expert-parallel ranks (excludes tp > 1).
    ``batches``: the row bins (rows = requests x q); ``q``: tokens per request.
    """

    tp: PositiveInt = 1
    dcp: PositiveInt = 1
    dep: PositiveInt = 1
    batches: tuple[PositiveInt, ...] = DEFAULT_BATCHES
    q: PositiveInt = 1
    target: Literal["h200", "h100", "b200", "cpu"] = "h200"

    @field_validator("batches")
    @classmethod
    def _batches_sorted_unique(cls, batches: tuple[int, ...]) -> tuple[int, ...]:
        if not batches:
            raise ValueError("batches must name at least one bin")
        if len(set(batches)) != len(batches):
            raise ValueError("batches repeat a bin")
        return tuple(sorted(batches))

    @model_validator(mode="after")
    def _bins_hold_whole_requests(self) -> Deployment:
        bad = [b for b in self.batches if b % self.q]
        if bad:
            raise ValueError(
                f"batch bins {bad} are not multiples of q={self.q} (rows = requests x q)"
            )
        return self

    @property
    def world(self) -> int:
        """Ranks one step runs on."""
        return max(self.tp, self.dep)


class Spec(Strict):
    """A spec file: the model and an optional default deployment."""

    model: Model
    deployment: Deployment = Deployment()
