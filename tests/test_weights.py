"""Weights: safetensors checkpoints (single file, sharded with an index, never pickle),
logical-name mapping, packed weights filled from separate tensors, one-line errors naming the
tensor with the expected and the found, and seeded random weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import MODELS  # noqa: E402

from stepgraph.compiler import compile_graph  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.frontend import build_step  # noqa: E402
from stepgraph.ir.types import Storage  # noqa: E402
from stepgraph.lower.weights import load_weights, random_weights  # noqa: E402
from stepgraph.spec_loader import load_spec  # noqa: E402

SPEC = load_spec(MODELS / "tiny_kimi_linear.yaml")
GRAPH = build_step(SPEC.model, SPEC.deployment)
HIDDEN, HEADS, DIM, EXPERTS, WIDTH = 64, 4, 16, 8, 32


def _checkpoint_tensors(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A kimi_linear checkpoint in the original (Moonshot) on-disk layout, by hand."""
    t: dict[str, torch.Tensor] = {}

    def put(name, *shape):
        t[name] = torch.randn(*shape, generator=generator)

    put("model.embed_tokens.weight", 256, HIDDEN)
    put("model.norm.weight", HIDDEN)
    put("lm_head.weight", 256, HIDDEN)
    for layer in range(4):
        p = f"model.layers.{layer}"
        put(f"{p}.input_layernorm.weight", HIDDEN)
        put(f"{p}.post_attention_layernorm.weight", HIDDEN)
        if layer == 3:
            a = f"{p}.self_attn"
            put(f"{a}.q_proj.weight", HEADS * 24, HIDDEN)
            put(f"{a}.kv_a_proj_with_mqa.weight", 40, HIDDEN)
            put(f"{a}.kv_a_layernorm.weight", 32)
            put(f"{a}.kv_b_proj.weight", HEADS * 32, 32)
            put(f"{a}.o_proj.weight", HIDDEN, HEADS * DIM)
        else:
            a = f"{p}.self_attn"
            for n in ("q", "k", "v"):
                put(f"{a}.{n}_proj.weight", HEADS * DIM, HIDDEN)
                put(f"{a}.{n}_conv1d.weight", HEADS * DIM, 1, 4)
            put(f"{a}.f_a_proj.weight", DIM, HIDDEN)
            put(f"{a}.f_b_proj.weight", HEADS * DIM, DIM)
            put(f"{a}.g_a_proj.weight", DIM, HIDDEN)
            put(f"{a}.g_b_proj.weight", HEADS * DIM, DIM)
            put(f"{a}.b_proj.weight", HEADS, HIDDEN)
            put(f"{a}.dt_bias", HEADS * DIM)
            put(f"{a}.A_log", 1, 1, HEADS, 1)
            put(f"{a}.o_norm.weight", DIM)
            put(f"{a}.o_proj.weight", HIDDEN, HEADS * DIM)
        if layer == 0:
            m = f"{p}.mlp"
            put(f"{m}.gate_proj.weight", 128, HIDDEN)
            put(f"{m}.up_proj.weight", 128, HIDDEN)
            put(f"{m}.down_proj.weight", HIDDEN, 128)
        else:
            m = f"{p}.block_sparse_moe"
            put(f"{m}.gate.weight", EXPERTS, HIDDEN)
            put(f"{m}.gate.e_score_correction_bias", EXPERTS)
            for e in range(EXPERTS):
                put(f"{m}.experts.{e}.w1.weight", WIDTH, HIDDEN)
                put(f"{m}.experts.{e}.w3.weight", WIDTH, HIDDEN)
                put(f"{m}.experts.{e}.w2.weight", HIDDEN, WIDTH)
            for n, shape in (("gate_proj", (32, HIDDEN)), ("up_proj", (32, HIDDEN)),
                             ("down_proj", (HIDDEN, 32))):
                put(f"{m}.shared_experts.{n}.weight", *shape)
    return t


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    """The hand-made checkpoint's tensors."""
    return _checkpoint_tensors(torch.Generator().manual_seed(0))


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_logical_names_map_to_checkpoint_tensors(tensors, tmp_path) -> None:
    weights = load_weights(GRAPH, _save(tmp_path, tensors), dtype=torch.float32)
    assert set(weights) == {v.name for v in GRAPH.values.values() if v.is_weight}
    a = "model.layers.1.self_attn"
    conv = tensors[f"{a}.q_conv1d.weight"][:, 0]
    assert torch.equal(weights["layers.1.self_attn.q_conv1d"], conv)
    assert torch.equal(weights["layers.1.self_attn.A_log"], tensors[f"{a}.A_log"].reshape(HEADS))
    gate_up = weights["layers.1.mlp.gate_up_proj"] if "layers.1.mlp.gate_up_proj" in weights \
        else weights["layers.1.mlp.experts.gate_up_proj"]
    m = "model.layers.1.block_sparse_moe.experts"
    assert torch.equal(gate_up[5, :WIDTH], tensors[f"{m}.5.w1.weight"])
    assert torch.equal(gate_up[5, WIDTH:], tensors[f"{m}.5.w3.weight"])
    shared = weights["layers.2.mlp.shared_experts.gate_up_proj"]
    s = "model.layers.2.block_sparse_moe.shared_experts"
    assert torch.equal(shared, torch.cat([tensors[f"{s}.gate_proj.weight"],
                                          tensors[f"{s}.up_proj.weight"]]))


def test_packed_plan_weights_are_cut_from_the_separate_tensors(tensors, tmp_path) -> None:
    compiled, _ = compile_graph(SPEC, SPEC.deployment)
    weights = load_weights(compiled, _save(tmp_path, tensors), dtype=torch.float32)
    packed = compiled.values["layers.1.self_attn.in_proj_qkvgfab"]
    tensor = weights[packed.name]
    a = "model.layers.1.self_attn"
    for segment in packed.segments:
        rows = tensor[segment.offset : segment.offset + segment.rows]
        if segment.source is None:
            assert not rows.any()
            continue
        leaf = segment.source.rsplit(".", 1)[-1]
        assert torch.equal(rows, tensors[f"{a}.{leaf}.weight"]), segment.name


def test_transformers_layout_loads_the_same(tensors, tmp_path) -> None:
    """Fused conv1d over q|k|v, forget_gate.*, fused 3-D experts: same weights."""
    hf = dict(tensors)
    for layer in (0, 1, 2):
        a = f"model.layers.{layer}.self_attn"
        hf[f"{a}.conv1d.weight"] = torch.cat([hf.pop(f"{a}.{n}_conv1d.weight")
                                              for n in ("q", "k", "v")])
        for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            hf[f"{a}.forget_gate.{n}"] = hf.pop(f"{a}.{n}")
    for layer in (1, 2, 3):
        old, new = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        for name in [k for k in hf if k.startswith(old)]:
            hf[name.replace(old, new)] = hf.pop(name)
        hf[f"{new}.experts.gate_up_proj"] = torch.stack([
            torch.cat([hf.pop(f"{new}.experts.{e}.w1.weight"),
                       hf.pop(f"{new}.experts.{e}.w3.weight")]) for e in range(EXPERTS)])
        hf[f"{new}.experts.down_proj"] = torch.stack(
            [hf.pop(f"{new}.experts.{e}.w2.weight") for e in range(EXPERTS)])
    original = load_weights(GRAPH, _save(tmp_path / "a", tensors), dtype=torch.float32)
    converted = load_weights(GRAPH, _save(tmp_path / "b", hf), dtype=torch.float32)
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name


def test_sharded_checkpoint_with_index(tensors, tmp_path) -> None:
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_weights(GRAPH, tmp_path, dtype=torch.float32)
    single = load_weights(GRAPH, _save(tmp_path / "one", tensors), dtype=torch.float32)
    assert all(torch.equal(sharded[n], single[n]) for n in single)


def test_missing_tensor_names_it(tensors, tmp_path) -> None:
    broken = {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.b_proj.weight"}
    with pytest.raises(UserError) as error:
        load_weights(GRAPH, _save(tmp_path, broken))
    message = str(error.value)
    assert "layers.2.self_attn.b_proj" in message and "missing" in message
    assert "\n" not in message


def test_wrong_shape_names_tensor_expected_and_found(tensors, tmp_path) -> None:
    broken = dict(tensors)
    broken["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(HEADS * 32, 31)
    with pytest.raises(UserError) as error:
        load_weights(GRAPH, _save(tmp_path, broken))
    assert str(error.value) == ("tensor model.layers.3.self_attn.kv_b_proj.weight: wrong shape: "
                                "expected [128, 32], found [128, 31]")


def test_wrong_dtype_names_tensor_expected_and_found(tensors, tmp_path) -> None:
    broken = dict(tensors)
    broken["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN,
                                                                  dtype=torch.int8)
    with pytest.raises(UserError) as error:
        load_weights(GRAPH, _save(tmp_path, broken))
    message = str(error.value)
    assert message.startswith("tensor model.layers.1.self_attn.o_proj.weight: wrong dtype")
    assert "expected bfloat16" in message and "found int8" in message


def test_pickle_checkpoints_are_refused(tmp_path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match="never unpickles"):
        load_weights(GRAPH, tmp_path)


def test_a_file_that_is_not_safetensors_is_one_line(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(UserError, match=r"model.safetensors: not a readable safetensors file"):
        load_weights(GRAPH, tmp_path)


def test_random_weights_are_seeded_and_scaled() -> None:
    a = random_weights(GRAPH, seed=1, dtype=torch.float32)
    b = random_weights(GRAPH, seed=1, dtype=torch.float32)
    c = random_weights(GRAPH, seed=2, dtype=torch.float32)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head"], c["lm_head"])
    # projections ~ N(0, 1/fan_in): fan_in 64 -> std 0.125
    assert math.isclose(float(a["layers.1.self_attn.o_proj"].std()), 64**-0.5, rel_tol=0.1)
    norm = a["layers.1.input_layernorm"]
    assert float(norm.min()) > 0.8 and float(norm.max()) < 1.2
    a_log = a["layers.1.self_attn.A_log"]
    assert float(a_log.min()) >= 0.0 and float(a_log.max()) <= math.log(16.0)
    assert a["layers.1.self_attn.dt_bias"].dtype == torch.float32
    assert random_weights(GRAPH, seed=1)["lm_head"].dtype == torch.bfloat16


def test_random_weights_do_not_depend_on_packing() -> None:
    compiled, _ = compile_graph(SPEC, SPEC.deployment)
    plain = random_weights(GRAPH, seed=4, dtype=torch.float32)
    packed = random_weights(compiled, seed=4, dtype=torch.float32)
    value = compiled.values["layers.1.self_attn.in_proj_qkvgfab"]
    for segment in value.segments:
        if segment.source is not None:
            rows = packed[value.name][segment.offset : segment.offset + segment.rows]
            assert torch.equal(rows, plain[segment.source])


def test_tensor_parallel_ranks_take_their_part() -> None:
    """At TP2 each rank's o_proj holds half the columns; together they are the whole."""
    from stepgraph.spec_loader import override_deployment

    tp2, _ = compile_graph(SPEC, override_deployment(SPEC.deployment, tp=2))
    whole = random_weights(GRAPH, seed=5, dtype=torch.float32)["layers.1.self_attn.o_proj"]
    parts = [random_weights(tp2, seed=5, rank=r, dtype=torch.float32)["layers.1.self_attn.o_proj"]
             for r in (0, 1)]
    assert parts[0].shape == (HIDDEN, HEADS * DIM // 2)
    assert torch.equal(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("host_limit", [300, 600, 2000])
@pytest.mark.parametrize("deployment", [{"tp": 2}, {"dep": 2}, {"tp": 2, "dcp": 2}])
def test_device_random_weights_of_a_rank_are_its_part_of_the_unsharded_graphs(
        deployment, host_limit, monkeypatch) -> None:
    """Every segment of every rank's packed weight equals its part of the same logical
    tensor in the unsharded frontend graph, whichever drawing path (host or device) the
    size limit sends each tensor down (a small router gate packed into a large front
    included)."""
    from stepgraph.bench import weights as bench_weights
    from stepgraph.compiler import compile_graph
    from stepgraph.frontend import build_step
    from stepgraph.spec_loader import override_deployment

    monkeypatch.setattr(bench_weights, "HOST_LIMIT", host_limit)
    spec = load_spec(MODELS / "tiny_k3.yaml")
    sharded, _ = compile_graph(spec, override_deployment(spec.deployment, **deployment))
    plain = build_step(spec.model, override_deployment(spec.deployment, tp=1))
    full = bench_weights.device_random_weights(plain, 3, torch.float32, "cpu")
    logical = {}
    for value in plain.values_of(Storage.WEIGHT):
        for segment in value.segments:
            logical[segment.source] = full[value.name][segment.offset:
                                                       segment.offset + segment.rows]
    checked = 0
    for rank in range(2):
        mine = bench_weights.device_random_weights(sharded, 3, torch.float32, "cpu", rank)
        for value in sharded.values_of(Storage.WEIGHT):
            for segment in value.segments:
                if segment.source is None:
                    continue
                want = logical[segment.source]
                split = segment.split or (value.split if len(value.segments) == 1 else None)
                if split is not None and split.ways > 1:
                    want = want.chunk(split.ways, dim=split.dim)[rank % split.ways]
                got = mine[value.name][segment.offset:segment.offset + segment.rows]
                assert torch.equal(got, want.reshape(got.shape)), (value.name, segment.source)
                checked += 1
    assert checked > 50
