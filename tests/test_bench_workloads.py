"""The benchmark workloads' specs: they compile (every pass, verified), and their shapes are
those of the K3 layers they stand for, checked against K3 itself compiled at TP1 (the
slice) and at TP8 (the rank: a TP8 rank's per-rank weights and states)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stepgraph.bench.workloads import WORKLOADS, k3_prefix_spec, title_of, workload_of_model
from stepgraph.compiler import compile_graph
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage
from stepgraph.spec_loader import load_spec
from tests.conftest import MODELS, run_cli

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _compile(path: Path) -> Graph:
    graph, _ = compile_graph(load_spec(path))
    return graph


def per_layer(graph: Graph, storage: Storage, shift: int = 0) -> dict[tuple[int, str], tuple]:
    """(layer + shift, name within the layer) -> per-rank shape, for layer values."""
    found = {}
    for value in graph.values_of(storage):
        match = LAYER.match(value.name)
        if match:
            found[(int(match.group(1)) + shift, match.group(2))] = value.type.shape
    return found


FIRST_MIX = {(1, "attn_res.query"), (1, "attn_res.norm")}  # the slice's layer 0 has no
# attention mix (the frontend treats it as a model's first layer), so no weights for one


def mix_sources(graph: Graph, shift: int = 0) -> dict[tuple[int, str], int]:
    """(layer + shift, mix name) -> the number of AttnRes sources it weighs."""
    return {(node.layer + shift, node.name.split(".", 1)[1]): node.attrs["sources"]
            for node in graph if node.op in ("attn_res_mix", "attn_res_norm")
            and node.layer is not None}


@pytest.fixture(scope="module")
def k3():
    return load_spec(MODELS / "kimi_k3.yaml")


@pytest.fixture(scope="module")
def slice_graph() -> Graph:
    return _compile(MODELS / "k3_slice_tp1.yaml")


@pytest.fixture(scope="module")
def rank_graph() -> Graph:
    return _compile(MODELS / "k3_rank_tp8.yaml")


def test_workloads_compile_with_their_bins(slice_graph: Graph, rank_graph: Graph) -> None:
    for graph, name in ((slice_graph, "k3-slice-tp1"), (rank_graph, "k3-rank-tp8")):
        workload = WORKLOADS[name]
        assert workload.spec_path.is_file()
        assert sorted(int(b["rows"]) for b in graph.meta["bins"]) == list(workload.batches)
        assert graph.meta["world"] == 1
        assert "memory" in graph.meta
        assert workload_of_model(graph.meta["model"]) is workload
    assert [x["attention"] for x in slice_graph.meta["layers"]] == ["kda", "kda", "mla", "kda"]
    kinds = [x["attention"] for x in rank_graph.meta["layers"]]
    assert [i for i, k in enumerate(kinds) if k == "mla"] == [2, 6, 10]
    assert len(kinds) == 12
    assert "ONE RANK'S COMPUTE" in title_of("k3_rank_tp8")


@pytest.mark.parametrize("spec", ["k3_slice_tp1.yaml", "k3_rank_tp8.yaml"])
def test_workload_compiles_from_the_command_line(spec: str, tmp_path: Path) -> None:
    result = run_cli("compile", f"models/{spec}", "-o", str(tmp_path / "w.sgart"))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout


def test_slice_shapes_are_k3_layers_1_to_4(k3, slice_graph: Graph) -> None:
    # K3's first 5 layers at TP1 with 64 experts: its layers 1..4 are the slice's 0..3
    reference, _ = compile_graph(k3_prefix_spec(k3, 5, experts=64))
    theirs = {k: v for k, v in per_layer(reference, Storage.WEIGHT).items()
              if k[0] >= 1 and k not in FIRST_MIX}
    ours = per_layer(slice_graph, Storage.WEIGHT, shift=1)
    assert ours == theirs
    assert per_layer(slice_graph, Storage.STATE, 1) == {
        k: v for k, v in per_layer(reference, Storage.STATE).items() if k[0] >= 1}
    weights = {v.name: v.type.shape for v in slice_graph.values_of(Storage.WEIGHT)}
    assert weights["layers.0.self_attn.in_proj_qkvgfab"] == (4 * 12288 + 128 + 96, 7168)
    assert weights["layers.0.mlp.experts.gate_up_proj"] == (64, 2 * 3072, 3584)
    assert weights["lm_head"] == (163840, 7168)


def test_slice_attn_res_mixes_weigh_what_k3_layers_1_to_4_do(k3, slice_graph: Graph) -> None:
    reference, _ = compile_graph(k3_prefix_spec(k3, 5, experts=64))
    theirs = {k: v for k, v in mix_sources(reference).items() if 1 <= k[0] <= 4}
    ours = mix_sources(slice_graph, shift=1)
    # the documented difference: the slice's first layer has no attention mix
    assert set(theirs) - set(ours) == {(1, "attn_mix")}
    assert {k: theirs[k] for k in ours} == ours
    assert set(ours.values()) == {2}


# A TP8 rank's shapes that a TP1 spec cannot have (see models/k3_rank_tp8.yaml): the latent
# down/up projections and the latent norm are whole here (the experts read the whole latent
# at TP8 too), and the router's correction bias covers the rank's experts, not all 896.
RANK_DEVIATIONS = {
    "mlp.front_proj": ((112 + 3584, 7168), (112 + 448, 7168)),
    "mlp.routed_expert_up_proj": ((7168, 3584), (7168, 448)),
    "mlp.routed_expert_norm": ((3584,), (448,)),
    "mlp.gate.e_score_correction_bias": ((112,), (896,)),
}


def test_rank_shapes_are_a_tp8_ranks(k3, rank_graph: Graph) -> None:
    # K3's first 13 layers compiled at TP8: rank 0's shapes of layers 1..12
    reference, _ = compile_graph(k3_prefix_spec(k3, 13, tp=8))
    assert reference.meta["world"] == 8
    theirs = {k: v for k, v in per_layer(reference, Storage.WEIGHT).items()
              if k[0] >= 1 and k not in FIRST_MIX}
    ours = per_layer(rank_graph, Storage.WEIGHT, shift=1)
    assert set(ours) == set(theirs)
    differ = {name for (layer, name) in ours if ours[(layer, name)] != theirs[(layer, name)]}
    assert differ == set(RANK_DEVIATIONS)
    for (_, name), shape in ours.items():
        if name in RANK_DEVIATIONS:
            assert shape == RANK_DEVIATIONS[name][0]
    for (layer, name), shape in theirs.items():
        if name in RANK_DEVIATIONS:
            assert shape == RANK_DEVIATIONS[name][1], (layer, name)
    assert per_layer(rank_graph, Storage.STATE, 1) == {
        k: v for k, v in per_layer(reference, Storage.STATE).items() if k[0] >= 1}
    head = {v.name: v.type.shape for v in reference.values_of(Storage.WEIGHT)}
    mine = {v.name: v.type.shape for v in rank_graph.values_of(Storage.WEIGHT)}
    assert mine["lm_head"] == head["lm_head"] == (20480, 7168)
    assert mine["embed_tokens"] == head["embed_tokens"]
    assert mine["layers.0.self_attn.in_proj_qkvgfab"] == (6288, 7168)
    assert mine["layers.0.self_attn.o_proj"] == (7168, 1536)
    assert mine["layers.0.mlp.experts.gate_up_proj"] == (112, 6144, 3584)


def test_rank_routes_as_many_experts_a_row_as_a_tp8_rank_expects(k3, rank_graph: Graph) -> None:
    # K3: 16 of 896 experts a row, 112 of them on a rank: each expert's chance per row is
    # the same (16/896 = 2/112), so top-2 of 112 touches as many experts as a rank expects
    moe = k3.model.mlp.moe
    (node, *_) = [n for n in rank_graph if n.op == "routed_experts"]
    assert node.attrs["local_experts"] == moe.experts // 8 == 112
    assert node.attrs["top_k"] / node.attrs["local_experts"] == moe.top_k / moe.experts


def test_rank_attn_res_boundary_falls_where_k3s_does(k3, rank_graph: Graph) -> None:
    reference, _ = compile_graph(k3_prefix_spec(k3, 13, tp=8))
    theirs = {k: v for k, v in mix_sources(reference).items() if 1 <= k[0] <= 12}
    ours = mix_sources(rank_graph, shift=1)
    assert set(theirs) - set(ours) == {(1, "attn_mix")}
    assert {k: theirs[k] for k in ours} == ours
    assert ours[(12, "mlp_mix")] == 3  # K3 opens block 1 at layer 12
