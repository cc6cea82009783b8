"""The spec schema: exact layer lists, strictness, and one-line errors with file:line: key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepgraph.errors import SpecError
from stepgraph.spec import Deployment, Spec, expand_selector
from stepgraph.spec_loader import load_spec, override_deployment, parse_spec_text


def test_k3_layer_list_is_exact(models: Path) -> None:
    layers = load_spec(models / "kimi_k3.yaml").model.layer_list()
    assert len(layers) == 93
    mla = [i for i, layer in enumerate(layers) if layer.attention == "mla"]
    assert mla == [*range(3, 92, 4), 92]
    assert len(mla) == 24
    assert [i for i, layer in enumerate(layers) if layer.mlp == "dense"] == [0]
    assert sum(layer.attention == "kda" for layer in layers) == 69


def test_k3_1_swaps_mla_for_dsa(models: Path) -> None:
    k3 = load_spec(models / "kimi_k3.yaml").model
    k31 = load_spec(models / "kimi_k3_1.yaml").model
    kinds = [layer.attention for layer in k31.layer_list()]
    assert "mla" not in kinds
    assert [i for i, k in enumerate(kinds) if k == "dsa"] == [*range(3, 92, 4), 92]
    assert k31.attention.dsa is not None and k31.attention.dsa.indexer.top_k == 2048
    assert k31.mlp == k3.mlp


def test_k3_figures_match_reference(models: Path) -> None:
    model = load_spec(models / "kimi_k3.yaml").model
    assert (model.hidden_size, model.vocab_size, model.norm_eps) == (7168, 163840, 1e-5)
    kda, mla, moe = model.attention.kda, model.attention.mla, model.mlp.moe
    assert kda is not None and mla is not None and moe is not None
    assert (kda.heads, kda.head_dim, kda.conv_kernel, kda.gate.lower_bound) == (96, 128, 4, -5.0)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.rope) == (
        1536, 512, 64, None)
    assert (moe.experts, moe.top_k, moe.shared_width, moe.expert_width) == (896, 16, 6144, 3072)
    assert moe.latent is not None and moe.latent.width == 3584
    assert model.mlp.dense is not None and model.mlp.dense.intermediate_size == 33792
    assert model.residual.kind == "attn_res" and model.residual.block_size == 12


@pytest.mark.parametrize(
    ("selector", "expected"),
    [("3-11/4, 12", (3, 7, 11, 12)), (5, (5,)), ([1, 0], (0, 1)), ("all", tuple(range(13)))],
)
def test_selectors(selector: str | int | list[int], expected: tuple[int, ...]) -> None:
    assert expand_selector(selector, 13) == expected


@pytest.mark.parametrize(
    ("selector", "message"),
    [("3-1", "bad layer range"), ("13", "outside 0..12"), ("1,1", "twice"),
     ("x", "bad layer selector item")],
)
def test_bad_selectors(selector: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_selector(selector, 13)


def _tiny_text(models: Path) -> str:
    return (models / "tiny_k3.yaml").read_text()


def test_unknown_key_names_file_line_and_key(models: Path) -> None:
    text = _tiny_text(models).replace("  hidden_size: 64\n", "  hidden_size: 64\n  hiden: 3\n")
    line = text.splitlines().index("  hiden: 3") + 1
    with pytest.raises(SpecError) as error:
        parse_spec_text(text, "tiny.yaml")
    message = str(error.value)
    assert message.startswith(f"tiny.yaml:{line}: model.hiden: unknown key")
    assert "\n" not in message


def test_wrong_type_is_refused(models: Path) -> None:
    text = _tiny_text(models).replace("      heads: 4\n      head_dim: 16",
                                      "      heads: four\n      head_dim: 16", 1)
    with pytest.raises(SpecError, match=r"model\.attention\.kda\.heads"):
        parse_spec_text(text, "t.yaml")


def test_float_for_int_is_refused(models: Path) -> None:
    text = _tiny_text(models).replace("hidden_size: 64", "hidden_size: 64.5")
    with pytest.raises(SpecError, match="hidden_size"):
        parse_spec_text(text, "t.yaml")


def test_missing_kind_attributes(models: Path) -> None:
    text = _tiny_text(models).replace("{at: \"3, 5\", attention: mla}",
                                      "{at: \"3, 5\", attention: dsa}")
    with pytest.raises(SpecError, match=r"layer 3 uses attention 'dsa' but model.attention.dsa"):
        parse_spec_text(text, "t.yaml")


def test_duplicate_key_is_refused(models: Path) -> None:
    text = _tiny_text(models).replace("  vocab_size: 256\n", "  vocab_size: 256\n  vocab_size: 3\n")
    with pytest.raises(SpecError, match="duplicate key 'vocab_size'"):
        parse_spec_text(text, "t.yaml")


def test_yaml_syntax_error_has_line() -> None:
    with pytest.raises(SpecError, match=r"^t.yaml:3: YAML error: expected"):
        parse_spec_text("model:\n  name: [unclosed\n", "t.yaml")


def test_gate_form_consistency(models: Path) -> None:
    text = _tiny_text(models).replace("{form: lower_bound, lower_bound: -5.0, rank: 16}",
                                      "{form: softplus, lower_bound: -5.0, rank: 16}")
    with pytest.raises(SpecError, match="softplus gate form takes no `lower_bound`"):
        parse_spec_text(text, "t.yaml")


def test_deployment_overrides_validate() -> None:
    base = Deployment()
    assert override_deployment(base, tp=8, batches=(4, 1, 2)).batches == (1, 2, 4)
    with pytest.raises(SpecError, match="not multiples of q=2"):
        override_deployment(base, q=2, batches=(1, 2, 4))
    with pytest.raises(SpecError, match="deployment: tp"):
        override_deployment(base, tp=0)


def test_schema_exports_and_refuses_extras() -> None:
    schema = Spec.model_json_schema()
    text = json.dumps(schema)
    assert "attn_res" in text and "lower_bound" in text
    assert schema["additionalProperties"] is False
