"""Parity with an implementation nobody here wrote: a tiny random Hugging Face
``KimiLinearForCausalLM`` (transformers' pure-torch fallbacks), saved with ``save_pretrained``,
imported with ``stepgraph import-hf`` and run with ``stepgraph run``: every position's logits
equal HF's forward over the whole sequence, for requests of different lengths in one batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a 2-core box
transformers = pytest.importorskip("transformers")

from stepgraph.cli import main  # noqa: E402

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 250, 11], [9, 64, 128, 1, 33], [77, 2]]


def _tiny_config(**extra):
    return transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, num_hidden_layers=4, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15, **extra,
    )


def _randomize(model) -> None:
    """Make every norm weight and correction bias matter (HF initialises them to 1 / 0)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))


@pytest.fixture(scope="module", autouse=True)
def torch_paths_only():
    """Run HF's pure-torch KDA and conv paths even where fla-core and triton import (they
    bind fla's GPU kernels at import time, which fail without a GPU)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as modeling

    names = ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention",
             "causal_conv1d_fn", "causal_conv1d_update")
    with pytest.MonkeyPatch.context() as patch:
        for name in names:
            function = getattr(modeling, name)
            patch.setattr(modeling, name, getattr(function, "__wrapped__", function))
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, torch_paths_only) -> tuple[Path, object]:
    """A saved tiny random HF model and the model reloaded from it (fp32, eager attention)."""
    folder = tmp_path_factory.mktemp("kimi_linear")
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(_tiny_config()).eval()
    _randomize(model)
    model.save_pretrained(folder)
    reloaded = transformers.KimiLinearForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, reloaded


def _hf_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def test_import_and_run_match_hf_full_forward(checkpoint, tmp_path, capsys) -> None:
    folder, model = checkpoint
    spec = tmp_path / "spec.yaml"
    assert main(["import-hf", str(folder), "-o", str(spec)]) == 0
    out = tmp_path / "logits.npy"
    args = ["run", str(spec), "--weights", str(folder), "--logits-out", str(out)]
    for prompt in PROMPTS:
        args += ["--tokens", ",".join(map(str, prompt))]
    assert main(args) == 0
    logits = np.load(out)
    longest = max(map(len, PROMPTS))
    assert logits.shape == (len(PROMPTS), longest, 256)
    worst = 0.0
    for index, prompt in enumerate(PROMPTS):
        expected = _hf_logits(model, prompt)
        got = logits[index, : len(prompt)]
        scale = np.abs(expected).max()
        worst = max(worst, float(np.abs(got - expected).max() / scale))
        assert np.isnan(logits[index, len(prompt):]).all()
    print(f"max relative error vs HF kimi_linear: {worst:.2e}")
    assert worst < 1e-5


def test_parity_is_sensitive_to_the_attention(checkpoint, tmp_path) -> None:
    """The comparison above can fail: a run with one KDA weight perturbed disagrees."""
    folder, model = checkpoint
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.A_log"] = tensors["model.layers.1.self_attn.A_log"] + 1.0
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text((folder / "config.json").read_text())
    spec = tmp_path / "spec.yaml"
    assert main(["import-hf", str(folder), "-o", str(spec)]) == 0
    out = tmp_path / "logits.npy"
    prompt = PROMPTS[0]
    assert main(["run", str(spec), "--weights", str(broken), "--logits-out", str(out),
                 "--tokens", ",".join(map(str, prompt))]) == 0
    got = np.load(out)[0]
    expected = _hf_logits(model, prompt)
    assert np.abs(got - expected).max() / np.abs(expected).max() > 1e-3
