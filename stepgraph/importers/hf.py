"""A model spec from a Hugging Face ``config.json``: transformers ``kimi_linear``, Kimi K3
(``text_config`` of model_type ``kimi_linear`` with K3's fields), ``deepseek_v3`` and
``deepseek_v32``.

Every key of the config is accounted for: it is mapped into the spec, checked to hold a value
the spec's semantics match (e.g. ``attention_bias: false``), listed as having no effect on the
decode step's numbers (token ids, init ranges, training-only losses), or refused with a message
naming it. Some parts of a checkpoint are outside the decode backbone (a vision tower, MTP
layers); they are named in the returned notes. Pure Python: no torch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from stepgraph.errors import UserError


class ImportError_(UserError):
    """A config the spec cannot express (the message names the field)."""


# Keys that do not change the decode step's numbers.
NO_EFFECT = {
    "architectures", "auto_map", "model_type", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "output_router_logits",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "max_position_embeddings",
    "model_max_length", "attention_dropout", "pretraining_tp", "return_dict",
    "output_attentions", "output_hidden_states", "torchscript", "tokenizer_class", "id2label",
    "label2id", "problem_type", "_name_or_path", "chunk_size_feed_forward", "is_encoder_decoder",
    "head_dim", "qk_head_dim", "ep_size", "dtype", "torch_dtype", "use_bfloat16",
    "tie_word_embeddings", "generation_config", "erc_loss_coef", "erc_loss_alpha",
    "linear_conv_kernel_dim", "linear_head_dim", "linear_num_heads", "rope_interleave",
    "num_key_value_heads", "use_grouped_topk", "topk_method", "num_nextn_predict_layers",
    "num_mtp_layers", "rope_theta", "first_k_dense_replace", "mla_use_nope",
}
MLA_KEYS = {"num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias",
            "mla_use_output_gate"}
MOE_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_token",
            "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
            "n_shared_experts", "topk_method", "moe_router_activation_func", "scoring_func",
            "n_group", "num_expert_group", "topk_group", "moe_layer_freq", "mlp_bias",
            "moe_renormalize", "norm_topk_prob", "routed_scaling_factor",
            "routed_expert_hidden_size", "latent_moe_use_norm"}
WRAPPER_NO_EFFECT = {"architectures", "auto_map", "model_type", "transformers_version", "dtype",
                     "torch_dtype", "media_placeholder_token_id", "pad_token_id", "bos_token_id",
                     "eos_token_id", "tie_word_embeddings", "use_cache", "ignore_index"}
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
          "torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


class Fields:
    """A config dict that remembers which keys were read."""

    def __init__(self, data: dict[str, Any], where: str = "") -> None:
        self.data = data
        self.where = where
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (``default`` when absent); marks it read."""
        self.read.add(key)
        return self.data.get(key, default)

    def first(self, *keys: str, default: Any = None) -> Any:
        """The value of the first key present among ``keys`` (aliases); marks all read."""
        self.read.update(keys)
        for key in keys:
            if key in self.data and self.data[key] is not None:
                return self.data[key]
        return default

    def need(self, *keys: str) -> Any:
        """Like :meth:`first`, but the field is required."""
        value = self.first(*keys)
        if value is None:
            raise ImportError_(f"config field {self.where}{keys[0]} is missing")
        return value

    def expect(self, key: str, allowed: tuple, why: str) -> None:
        """Refuse ``key`` unless absent or one of ``allowed``."""
        self.read.add(key)
        if key in self.data and self.data[key] not in allowed:
            raise ImportError_(f"config field {self.where}{key} = {self.data[key]!r} is not "
                               f"supported: {why}")

    def leftovers(self, ignore: set[str]) -> list[str]:
        """Keys nobody read and that are not known to have no effect."""
        return sorted(k for k in self.data if k not in self.read and k not in ignore)


def _refuse_unknown(fields: Fields, ignore: set[str] = NO_EFFECT) -> None:
    left = fields.leftovers(ignore)
    if left:
        raise ImportError_(f"config field {fields.where}{left[0]} is not understood by "
                           f"stepgraph import-hf (the spec cannot express it)")


# ---------------------------------------------------------------------- shared pieces


def _dtype(config: Fields, wrapper: Fields | None) -> str:
    raw = config.first("dtype", "torch_dtype")
    if raw is None and wrapper is not None:
        raw = wrapper.first("dtype", "torch_dtype")
    if raw is None:
        return "bfloat16"
    if str(raw) not in DTYPES:
        raise ImportError_(f"config field dtype = {raw!r}: stepgraph specs hold bfloat16, "
                           "float16 or float32")
    return DTYPES[str(raw)]


def _activation(config: Fields) -> dict[str, Any]:
    act = config.get("hidden_act", "silu")
    if act == "silu":
        return {"kind": "silu"}
    if act == "situ":
        beta = config.first("activation_situ_beta", default=1.0)
        beta_linear = config.first("activation_situ_linear_beta")
        if beta_linear is None:
            raise ImportError_("config field activation_situ_linear_beta is missing: the spec's "
                               "SiTU always bounds `up` with bl * tanh(up / bl)")
        return {"kind": "situ", "beta": float(beta), "beta_linear": float(beta_linear)}
    raise ImportError_(f"config field hidden_act = {act!r} is not supported (silu or situ)")


def _router_groups(config: Fields) -> None:
    groups = config.first("n_group", "num_expert_group", default=1)
    top_groups = config.first("topk_group", default=groups)
    if groups not in (None, 1) and top_groups != groups:
        name = "num_expert_group" if "num_expert_group" in config.data else "n_group"
        raise ImportError_(f"config field {name} = {groups} with topk_group = {top_groups}: "
                           "group-limited routing is not expressible in the spec's router")


def _moe(config: Fields, kimi: bool) -> dict[str, Any]:
    experts = config.need("num_experts", "n_routed_experts", "num_local_experts")
    top_k = config.need("num_experts_per_token", "num_experts_per_tok")
    width = config.need("moe_intermediate_size")
    shared = config.first("num_shared_experts", "n_shared_experts", default=0) or 0
    method = config.get("topk_method", "noaux_tc")
    if method not in ("noaux_tc", "greedy"):
        raise ImportError_(f"config field topk_method = {method!r} is not supported")
    score = config.first("moe_router_activation_func", "scoring_func", default="sigmoid")
    if score not in ("sigmoid", "softmax"):
        raise ImportError_(f"config field moe_router_activation_func = {score!r} is not "
                           "supported (sigmoid or softmax)")
    _router_groups(config)
    config.expect("moe_layer_freq", (1, None), "MoE on every layer after the dense ones only")
    config.expect("mlp_bias", (False, None), "the spec's MLPs have no bias")
    moe: dict[str, Any] = {
        "experts": int(experts),
        "top_k": int(top_k),
        "expert_width": int(width),
        "shared_width": int(width) * int(shared),
        "router": {
            "activation": score,
            "correction_bias": method == "noaux_tc",
            "renormalize": bool(config.first("moe_renormalize", "norm_topk_prob",
                                             default=True)),
            "scaling_factor": float(config.first("routed_scaling_factor", default=1.0)),
        },
    }
    latent = config.get("routed_expert_hidden_size")
    if latent is not None:
        moe["latent"] = {"width": int(latent),
                         "norm": bool(config.get("latent_moe_use_norm", False))}
    elif kimi:
        config.get("latent_moe_use_norm")
    return moe


def _mla(config: Fields, rope: dict | None, eps: float, gated: bool) -> dict[str, Any]:
    heads = int(config.need("num_attention_heads"))
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads not in (None, heads):
        raise ImportError_(f"config field num_key_value_heads = {kv_heads} differs from "
                           f"num_attention_heads = {heads}: MLA expands the latent to every head")
    config.expect("attention_bias", (False, None), "the spec's attention projections have no "
                  "bias")
    mla: dict[str, Any] = {
        "heads": heads,
        "q_lora_rank": config.get("q_lora_rank"),
        "kv_lora_rank": int(config.need("kv_lora_rank")),
        "qk_nope_head_dim": int(config.need("qk_nope_head_dim")),
        "qk_rope_head_dim": int(config.need("qk_rope_head_dim")),
        "v_head_dim": int(config.need("v_head_dim")),
        "rope": rope,
        "norm_eps": eps,
    }
    if gated:
        mla["output_gate"] = {"kind": "full"}
    return mla


def _layer_overrides(kinds: list[tuple[str, str]]) -> dict[str, Any]:
    """``layers:`` (count, default, overrides) for per-layer (attention, mlp) kinds."""
    common = Counter(kinds).most_common(1)[0][0]
    overrides = []
    for field, index in (("attention", 0), ("mlp", 1)):
        by_kind: dict[str, list[int]] = {}
        for layer, pair in enumerate(kinds):
            if pair[index] != common[index]:
                by_kind.setdefault(pair[index], []).append(layer)
        for kind, layers in sorted(by_kind.items()):
            overrides.append({"at": ", ".join(map(str, layers)), field: kind})
    layers: dict[str, Any] = {
        "count": len(kinds), "default": {"attention": common[0], "mlp": common[1]}}
    if overrides:
        layers["overrides"] = overrides
    return layers


def _mlp_kinds(config: Fields, count: int, default_dense: int) -> list[str]:
    explicit = config.get("mlp_layer_types")
    if explicit is not None:
        mapping = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        bad = [k for k in explicit if k not in mapping]
        if bad or len(explicit) != count:
            raise ImportError_(f"config field mlp_layer_types = {explicit!r} is not a list of "
                               f"{count} 'dense'/'sparse'")
        return [mapping[k] for k in explicit]
    dense = config.get("first_k_dense_replace", default_dense)
    return ["dense" if i < dense else "moe" for i in range(count)]


def _mlps(config: Fields, kinds: list[str], kimi: bool) -> dict[str, Any]:
    """``mlp:`` with the dense and MoE attributes the layer list uses (the fields of an
    unused kind have no effect)."""
    mlp: dict[str, Any] = {}
    if "dense" in kinds:
        mlp["dense"] = {"intermediate_size": int(config.need("intermediate_size"))}
    else:
        config.read.add("intermediate_size")
    if "moe" in kinds:
        mlp["moe"] = _moe(config, kimi=kimi)
    else:
        config.read.update(MOE_KEYS)
    return mlp


# ---------------------------------------------------------------------- kimi_linear / K3


def _kimi_attention_kinds(config: Fields, linear: Fields, count: int) -> list[str]:
    full, kda = linear.get("full_attn_layers"), linear.get("kda_layers")
    explicit = config.get("layer_types")
    if explicit is not None:
        mapping = {"linear_attention": "kda", "full_attention": "mla"}
        if len(explicit) != count or any(k not in mapping for k in explicit):
            raise ImportError_(f"config field layer_types = {explicit!r} is not a list of "
                               f"{count} 'linear_attention'/'full_attention'")
        return [mapping[k] for k in explicit]
    if full is not None and kda is not None:
        kinds: list[str | None] = [None] * count
        for kind, layers in (("mla", full), ("kda", kda)):
            for one_based in layers:
                if not 1 <= one_based <= count:
                    raise ImportError_(f"config field linear_attn_config layer {one_based} is "
                                       f"outside 1..{count}")
                if kinds[one_based - 1] is not None:
                    raise ImportError_(f"config field linear_attn_config lists layer "
                                       f"{one_based} twice")
                kinds[one_based - 1] = kind
        if None in kinds:
            missing = kinds.index(None) + 1
            raise ImportError_(f"config field linear_attn_config lists layer {missing} in "
                               "neither kda_layers nor full_attn_layers")
        return [str(k) for k in kinds]
    return ["mla" if i and i % 4 == 0 else "kda" for i in range(count)]


def _kimi(config: Fields, name: str, wrapper: Fields | None) -> dict[str, Any]:
    count = int(config.need("num_hidden_layers"))
    eps = float(config.get("rms_norm_eps", 1e-5))
    linear = Fields(dict(config.get("linear_attn_config") or {}), "linear_attn_config.")
    heads = int(linear.first("num_heads", default=config.get("linear_num_heads", 32)))
    head_dim = int(linear.first("head_dim", default=config.get("linear_head_dim", 128)))
    kernel = int(linear.first("short_conv_kernel_size",
                              default=config.get("linear_conv_kernel_dim", 4)))
    bound = linear.get("gate_lower_bound")
    if bound is None and linear.get("safe_gate", False):
        bound = -5.0
    gate = ({"form": "lower_bound", "lower_bound": float(bound), "rank": head_dim}
            if bound is not None else {"form": "softplus", "rank": head_dim})
    full_gate = bool(linear.get("use_full_rank_gate", False))
    kinds = _kimi_attention_kinds(config, linear, count)
    _refuse_unknown(linear, set())
    use_nope = config.get("mla_use_nope", True)
    if use_nope is False:
        raise ImportError_("config field mla_use_nope = false: kimi_linear's MLA is NoPE only")
    attention: dict[str, Any] = {}
    if "kda" in kinds:
        attention["kda"] = {
            "heads": heads, "head_dim": head_dim, "conv_kernel": kernel, "gate": gate,
            "output_gate": {"kind": "full"} if full_gate
            else {"kind": "low_rank", "rank": head_dim},
            "norm_eps": eps,
        }
    if "mla" in kinds:
        # transformers' kimi_linear builds the q_a/kv_a latent norms with eps 1e-6 (its class
        # default); K3 (AttnRes / a multimodal wrapper) uses rms_norm_eps, as vLLM does.
        k3 = wrapper is not None or config.data.get("attn_res_block_size") is not None
        attention["mla"] = _mla(config, None, eps if k3 else 1e-6,
                                bool(config.get("mla_use_output_gate")))
    else:
        config.read.update(MLA_KEYS)  # no MLA layer: these fields have no effect
    mlp = _mlps(config, _mlp_kinds(config, count, 1), kimi=True)
    mlp_kinds = _mlp_kinds(config, count, 1)
    block = config.get("attn_res_block_size")
    residual = {"kind": "attn_res", "block_size": int(block)} if block else {"kind": "plain"}
    return _model(config, wrapper, name, eps, residual, attention, mlp,
                  list(zip(kinds, mlp_kinds, strict=True)))


# ---------------------------------------------------------------------- deepseek


def _deepseek_rope(config: Fields) -> dict[str, Any]:
    params = config.first("rope_parameters", "rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ImportError_(f"config field rope_parameters.rope_type = {kind!r} is not "
                           "supported: the spec's rope is the default (unscaled) rotary")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return {"theta": float(theta)}


def _deepseek(config: Fields, name: str, kind: str) -> dict[str, Any]:
    count = int(config.need("num_hidden_layers"))
    eps = float(config.get("rms_norm_eps", 1e-6))
    rope = _deepseek_rope(config)
    attention_kind = "dsa" if kind == "deepseek_v32" else "mla"
    mla = _mla(config, rope, 1e-6, False)
    if attention_kind == "dsa":
        if mla["q_lora_rank"] is None:
            raise ImportError_("config field q_lora_rank is null: DSA's indexer reads the q latent")
        mla["indexer"] = {"heads": int(config.need("index_n_heads")),
                          "head_dim": int(config.need("index_head_dim")),
                          "top_k": int(config.need("index_topk"))}
        types = config.get("layer_types")
        if types is not None and any(t not in ("indexed_attention", "full_attention")
                                     for t in types):
            raise ImportError_(f"config field layer_types = {types!r} is not supported")
    mlp_kinds = _mlp_kinds(config, count, 3)
    mlp = _mlps(config, mlp_kinds, kimi=False)
    return _model(config, None, name, eps, {"kind": "plain"}, {attention_kind: mla}, mlp,
                  [(attention_kind, m) for m in mlp_kinds])


def _model(config: Fields, wrapper: Fields | None, name: str, eps: float,
           residual: dict, attention: dict, mlp: dict, kinds: list[tuple[str, str]]
           ) -> dict[str, Any]:
    model = {
        "name": name,
        "hidden_size": int(config.need("hidden_size")),
        "vocab_size": int(config.need("vocab_size")),
        "norm_eps": eps,
        "dtype": _dtype(config, wrapper),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False) or (
            wrapper.get("tie_word_embeddings", False) if wrapper else False)),
        "activation": _activation(config),
        "residual": residual,
        "attention": attention,
        "mlp": mlp,
        "layers": _layer_overrides(kinds),
    }
    return model


# ---------------------------------------------------------------------- entry points


def spec_from_config(config: dict[str, Any], name: str) -> tuple[dict[str, Any], list[str]]:
    """The spec data (``{"model": ...}``) of a Hugging Face config and notes on the parts of
    the checkpoint outside the decode backbone."""
    notes: list[str] = []
    wrapper = None
    text = config
    if "text_config" in config:
        wrapper = Fields(config)
        text = wrapper.get("text_config")
        for key in ("vision_config", "mm_projector", "mm_hidden_size"):
            if key in config:
                wrapper.read.add(key)
                notes.append(f"{key}: the vision tower is not part of the text decode step; "
                             "only the text backbone is imported")
        leftovers = [k for k in wrapper.leftovers(WRAPPER_NO_EFFECT)
                     if not k.startswith(("vision", "vt_", "mm_", "projector", "merge_",
                                          "patch_", "init_pos_emb", "pos_emb"))]
        if leftovers:
            raise ImportError_(f"config field {leftovers[0]} is not understood by stepgraph "
                               "import-hf")
    fields = Fields(dict(text))
    if "quantization_config" in text or (wrapper and "quantization_config" in config):
        raise ImportError_("config field quantization_config: quantized checkpoints are not "
                           "supported (the spec holds bf16/fp16/fp32 weights)")
    kind = fields.get("model_type")
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if fields.data.get(key):
            notes.append(f"{key} = {fields.data[key]}: multi-token-prediction layers are not "
                         "part of the decode step; not imported")
    if kind == "kimi_linear":
        model = _kimi(fields, name, wrapper)
    elif kind in ("deepseek_v3", "deepseek_v32"):
        model = _deepseek(fields, name, kind)
    else:
        raise ImportError_(f"config field model_type = {kind!r} is not supported (kimi_linear, "
                           "deepseek_v3, deepseek_v32, or a wrapper with such a text_config)")
    _refuse_unknown(fields)
    return {"model": model}, notes


def spec_name(directory: Path) -> str:
    """A spec name from a checkpoint directory name."""
    cleaned = re.sub(r"[^A-Za-z0-9_]+", "_", directory.resolve().name).strip("_").lower()
    return cleaned or "imported"


def import_hf(directory: str | Path, name: str | None = None) -> tuple[str, list[str]]:
    """The spec YAML text for the Hugging Face checkpoint directory (its ``config.json``)
    and the notes to show the user."""
    folder = Path(directory)
    config_path = folder / "config.json" if folder.is_dir() else folder
    if not config_path.is_file():
        raise UserError(f"{directory}: no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise UserError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: a config is a JSON object")
    data, notes = spec_from_config(config, name or spec_name(config_path.parent))
    header = (f"# Imported by `stepgraph import-hf` from {config_path}.\n"
              + "".join(f"# note: {note}\n" for note in notes))
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None), notes
