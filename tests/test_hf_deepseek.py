"""The MLA core (with rope, interleaved as DeepSeek stores it) and the DSA core (lightning
indexer + top-k sparse MLA) against transformers' DeepSeek-V3 / V3.2: tiny random models saved
with ``save_pretrained``, imported with ``stepgraph import-hf``, run with ``stepgraph run``;
logits equal HF's full-sequence forward at every position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a 2-core box
transformers = pytest.importorskip("transformers")

from stepgraph.cli import main  # noqa: E402

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 250, 11, 13], [9, 64, 128, 1, 33]]
COMMON = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=3,
    first_k_dense_replace=1, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
    moe_intermediate_size=32, intermediate_size=128, vocab_size=256, initializer_range=0.15,
)


def _save(folder: Path, config, model_class):
    torch.manual_seed(0)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(folder)
    return model_class.from_pretrained(folder, dtype=torch.float32,
                                       attn_implementation="eager").eval()


def _run(folder: Path, spec: Path, out: Path) -> np.ndarray:
    args = ["run", str(spec), "--weights", str(folder), "--logits-out", str(out)]
    for prompt in PROMPTS:
        args += ["--tokens", ",".join(map(str, prompt))]
    assert main(args) == 0
    return np.load(out)


def _worst_error(model, logits: np.ndarray) -> float:
    worst = 0.0
    for index, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].numpy()
        got = logits[index, : len(prompt)]
        worst = max(worst, float(np.abs(got - expected).max() / np.abs(expected).max()))
    return worst


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_mla_with_rope_matches_hf(tmp_path, interleave) -> None:
    config = transformers.DeepseekV3Config(**COMMON, rope_interleave=interleave)
    model = _save(tmp_path, config, transformers.DeepseekV3ForCausalLM)
    spec = tmp_path / "spec.yaml"
    assert main(["import-hf", str(tmp_path), "-o", str(spec)]) == 0
    assert "rope: {theta: 10000.0}" in spec.read_text()
    worst = _worst_error(model, _run(tmp_path, spec, tmp_path / "l.npy"))
    print(f"deepseek_v3 (rope_interleave={interleave}) max relative error: {worst:.2e}")
    assert worst < 1e-5


def test_deepseek_v32_dsa_matches_hf_and_the_top_k_matters(tmp_path) -> None:
    config = transformers.DeepseekV32Config(**COMMON, index_topk=4, index_head_dim=16,
                                            index_n_heads=4)
    model = _save(tmp_path, config, transformers.DeepseekV32ForCausalLM)
    spec = tmp_path / "spec.yaml"
    assert main(["import-hf", str(tmp_path), "-o", str(spec)]) == 0
    text = spec.read_text()
    assert "indexer: {heads: 4, head_dim: 16, top_k: 4}" in text
    worst = _worst_error(model, _run(tmp_path, spec, tmp_path / "l.npy"))
    print(f"deepseek_v32 (index_topk 4 of up to 10 tokens) max relative error: {worst:.2e}")
    assert worst < 1e-5
    # attending densely (top-k 16 >= every length) is a different model: the test can fail
    dense = tmp_path / "dense.yaml"
    dense.write_text(text.replace("top_k: 4}", "top_k: 16}"))
    assert _worst_error(model, _run(tmp_path, dense, tmp_path / "d.npy")) > 1e-4
