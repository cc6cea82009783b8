"""``stepgraph import-hf``: specs from Hugging Face configs; refused fields are named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from stepgraph.errors import UserError
from stepgraph.importers.hf import import_hf, spec_from_config
from stepgraph.spec import Spec
from stepgraph.spec_loader import load_spec, parse_spec_text

ROOT = Path(__file__).resolve().parent.parent

# Kimi K3 as its checkpoint's config.json spells it (figures: shared/reference/kimi_k3.md):
# a multimodal wrapper whose text_config is kimi_linear with K3's fields; layer lists 1-based.
MLA_LAYERS = [*range(4, 93, 4), 93]
K3_CONFIG = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "media_placeholder_token_id": 163605,
    "vision_config": {"hidden_size": 1024},
    "text_config": {
        "model_type": "kimi_linear",
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "rms_norm_eps": 1e-5, "dtype": "bfloat16", "tie_word_embeddings": False,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
            "full_attn_layers": MLA_LAYERS,
            "kda_layers": [i for i in range(1, 94) if i not in MLA_LAYERS],
        },
        "intermediate_size": 33792, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 896, "num_experts_per_token": 16, "moe_intermediate_size": 3072,
        "num_shared_experts": 2, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "bos_token_id": 163584, "eos_token_id": 163586,
    },
}


def _import(config: dict, tmp_path: Path) -> Spec:
    (tmp_path / "config.json").write_text(json.dumps(config))
    text, _ = import_hf(tmp_path, name="imported")
    return parse_spec_text(text)


def test_k3_config_imports_to_the_hand_written_k3_spec(tmp_path) -> None:
    imported = _import(K3_CONFIG, tmp_path).model.model_dump()
    expected = load_spec(ROOT / "models" / "kimi_k3.yaml").model.model_dump()
    imported["name"] = expected["name"]
    # the hand-written spec writes the MLA layers as one selector; compare the expansion
    assert parse_layers(imported) == parse_layers(expected)
    imported.pop("layers")
    expected.pop("layers")
    assert imported == expected


def parse_layers(model: dict) -> list[tuple[str, str]]:
    """The per-layer (attention, mlp) kinds of a dumped model."""
    from stepgraph.spec import Layers

    layers = Layers.model_validate(model["layers"]).expand()
    return [(k.attention, k.mlp) for k in layers]


def test_k3_mla_layers_are_the_one_based_lists(tmp_path) -> None:
    spec = _import(K3_CONFIG, tmp_path)
    kinds = [k.attention for k in spec.model.layer_list()]
    assert [i for i, k in enumerate(kinds) if k == "mla"] == [*range(3, 92, 4), 92]
    assert len(kinds) == 93 and kinds.count("kda") == 69


def test_vision_tower_is_named_in_the_notes(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(K3_CONFIG))
    text, notes = import_hf(tmp_path)
    assert any("vision_config" in n for n in notes)
    assert "# note: vision_config" in text


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t.update(num_expert_group=8, topk_group=4), "num_expert_group"),
        (lambda t: t.update(some_new_knob=3), "some_new_knob"),
        (lambda t: t["linear_attn_config"].update(expand_v=2), "linear_attn_config.expand_v"),
        (lambda t: t.update(attention_bias=True), "attention_bias"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t: t.update(num_key_value_heads=1), "num_key_value_heads"),
        (lambda t: t.update(moe_layer_freq=2), "moe_layer_freq"),
        (lambda t: t.update(quantization_config={"quant_method": "mxfp4"}),
         "quantization_config"),
        (lambda t: t["linear_attn_config"].update(kda_layers=[2]), "neither"),
    ],
)
def test_fields_the_spec_cannot_express_are_refused_by_name(change, named, tmp_path) -> None:
    config = copy.deepcopy(K3_CONFIG)
    change(config["text_config"])
    with pytest.raises(UserError, match=named):
        _import(config, tmp_path)


def test_deepseek_yarn_rope_is_refused(tmp_path) -> None:
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64,
              "vocab_size": 256, "num_attention_heads": 4, "q_lora_rank": 24,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
              "v_head_dim": 16, "intermediate_size": 128, "first_k_dense_replace": 2,
              "rope_parameters": {"rope_type": "yarn", "factor": 40, "rope_theta": 10000.0}}
    with pytest.raises(UserError, match="rope_type"):
        _import(config, tmp_path)


def test_kimi_linear_defaults_follow_transformers(tmp_path) -> None:
    """No layer lists: transformers puts MLA at 0-based i % 4 == 0 (i > 0), dense layer 0,
    low-rank output gate, softplus gate, latent norms at eps 1e-6."""
    config = {"model_type": "kimi_linear", "num_hidden_layers": 9, "hidden_size": 64,
              "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
              "v_head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_experts": 8, "num_experts_per_token": 2, "linear_num_heads": 4,
              "linear_head_dim": 16, "dtype": "float32"}
    model = _import(config, tmp_path).model
    kinds = model.layer_list()
    assert [i for i, k in enumerate(kinds) if k.attention == "mla"] == [4, 8]
    assert [i for i, k in enumerate(kinds) if k.mlp == "dense"] == [0]
    assert model.attention.kda.gate.form == "softplus"
    assert model.attention.kda.output_gate.kind == "low_rank"
    assert model.attention.mla.norm_eps == 1e-6 and model.attention.mla.rope is None
    assert model.mlp.moe.shared_width == 0 and model.dtype == "float32"


def test_cli_writes_a_loadable_spec(tmp_path) -> None:
    from stepgraph.cli import main

    (tmp_path / "config.json").write_text(json.dumps(K3_CONFIG))
    out = tmp_path / "k3.yaml"
    assert main(["import-hf", str(tmp_path), "-o", str(out)]) == 0
    assert load_spec(out).model.residual.block_size == 12


def test_missing_config_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(UserError, match=r"no config\.json"):
        import_hf(tmp_path)
    with pytest.raises(UserError, match="model_type"):
        spec_from_config({"model_type": "llama"}, "x")
