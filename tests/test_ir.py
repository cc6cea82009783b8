"""The IR: frontend shapes at TP1, the verifier's invariants (each broken on purpose), and the
printed forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepgraph.frontend import build_step
from stepgraph.ir import Graph, Node, Placement, Storage, TensorType, Value, VerifyError, verify
from stepgraph.ir.printer import format_graph, graph_to_dot, graph_to_mermaid
from stepgraph.ir.serialize import graph_from_json, graph_to_json
from stepgraph.ir.values import View
from stepgraph.spec_loader import load_spec


def _graph(models: Path, name: str) -> Graph:
    spec = load_spec(models / f"{name}.yaml")
    return build_step(spec.model, spec.deployment)


def test_k3_frontend_weight_shapes(models: Path) -> None:
    graph = _graph(models, "kimi_k3")
    shape = lambda name: graph.value(name).type.shape  # noqa: E731
    assert shape("layers.1.self_attn.q_proj") == (12288, 7168)
    assert shape("layers.1.self_attn.f_a_proj") == (128, 7168)
    assert shape("layers.1.self_attn.b_proj") == (96, 7168)
    assert shape("layers.1.self_attn.o_proj") == (7168, 12288)
    assert shape("layers.3.self_attn.q_a_proj") == (1536, 7168)
    assert shape("layers.3.self_attn.kv_a_proj_with_mqa") == (576, 7168)
    assert shape("layers.3.self_attn.g_proj") == (12288, 7168)
    assert shape("layers.5.mlp.gate") == (896, 7168)
    assert shape("layers.5.mlp.routed_expert_down_proj") == (3584, 7168)
    assert shape("layers.5.mlp.experts.gate_up_proj") == (896, 6144, 3584)
    assert shape("layers.5.mlp.shared_experts.gate_up_proj") == (12288, 7168)
    assert shape("layers.0.mlp.down_proj") == (7168, 33792)
    assert shape("lm_head") == (163840, 7168)
    assert graph.value("layers.1.self_attn.recurrent_state").type == TensorType(
        ("S", 96, 128, 128), "float32")
    verify(graph)


def test_k3_attn_res_sources(models: Path) -> None:
    graph = _graph(models, "kimi_k3")
    mixes = {n.name: n for n in graph if n.op == "attn_res_mix"}
    assert "l0.attn_mix" not in mixes  # layer 0 attends on the embedding directly
    # Pushes at layers 0, 12, ..., 84: 8 blocks, + the running prefix = 9 sources at the end.
    assert mixes["final_mix"].attrs["sources"] == 9
    assert mixes["l1.attn_mix"].attrs["sources"] == 2  # embedding + prefix
    assert mixes["l12.attn_mix"].attrs["sources"] == 2
    assert mixes["l12.mlp_mix"].attrs["sources"] == 3


def test_every_spec_verifies(models: Path) -> None:
    for path in sorted(models.glob("*.yaml")):
        spec = load_spec(path)
        verify(build_step(spec.model, spec.deployment))


def _small() -> Graph:
    graph = Graph("small")
    graph.add_value(Value("x", TensorType(("B", 8), "bfloat16"), Storage.INPUT))
    graph.add_value(Value("w", TensorType((4, 8), "bfloat16"), Storage.WEIGHT))
    graph.add_value(Value("y", TensorType(("B", 4), "bfloat16"), Storage.TEMP))
    graph.add_value(Value("z", TensorType(("B", 4), "bfloat16"), Storage.OUTPUT))
    graph.add_node(Node("p", "projection", ("x", "w"), ("y",)))
    graph.add_node(Node("a", "add", ("y", "y"), ("z",)))
    return graph


def test_small_graph_verifies() -> None:
    verify(_small())


def test_shape_mismatch_names_node() -> None:
    graph = _small()
    graph.set_value(graph.value("w").evolve(type=TensorType((4, 9), "bfloat16")))
    with pytest.raises(VerifyError, match=r"node p: projection: .*K differs"):
        verify(graph)


def test_dtype_mismatch() -> None:
    graph = _small()
    graph.set_value(graph.value("z").evolve(type=TensorType(("B", 4), "float32")))
    with pytest.raises(VerifyError, match="node a: add: operand dtype bfloat16"):
        verify(graph)


def test_read_before_write() -> None:
    graph = _small()
    graph.set_nodes(reversed(graph.nodes))
    with pytest.raises(VerifyError, match="node a: reads y before anything writes it"):
        verify(graph)


def test_state_written_by_non_owner() -> None:
    graph = _small()
    graph.add_value(Value("s", TensorType(("S", 4), "float32"), Storage.STATE, owner="p"))
    node = graph.node("a")
    graph.set_nodes([graph.node("p"), node.evolve(inputs=(*node.inputs, "s"), updates=("s",))])
    with pytest.raises(VerifyError, match="node a: updates state s owned by p"):
        verify(graph)


def test_double_write_and_weight_write() -> None:
    graph = _small()
    graph.add_node(Node("again", "add", ("y", "y"), ("y",)))
    with pytest.raises(VerifyError, match="writes y, already written by p"):
        verify(graph)
    graph = _small()
    graph.add_node(Node("bad", "add", ("y", "y"), ("w",)))
    with pytest.raises(VerifyError, match="writes w, a weight"):
        verify(graph)


def test_placement_must_match_groups() -> None:
    graph = _small()
    graph.meta["groups"] = {"tp": 2}
    node = graph.node("a")
    graph.set_nodes([graph.node("p"), node.evolve(placement=Placement("sharded", "tp", 4, "rows"))])
    with pytest.raises(VerifyError, match="placed on 4 ranks of tp, which has 2"):
        verify(graph)


def test_view_must_fit_base() -> None:
    graph = _small()
    graph.add_value(Value("v", TensorType(("B", 3), "bfloat16"), Storage.TEMP,
                          view=View("y", 2, 5)))
    with pytest.raises(VerifyError, match="view v"):
        verify(graph)


def test_printed_forms(models: Path) -> None:
    graph = _graph(models, "tiny_k3")
    text = format_graph(graph, layers={1})
    assert "%l1.kda_out: bf16[Bx64] = kda_core(%l1.q, %l1.k, %l1.v" in text
    assert "updates $layers.1.self_attn.recurrent_state" in text
    assert "l3." not in text
    dot = graph_to_dot(graph, {3})
    assert dot.startswith("digraph") and '"l3.core"' in dot and "cluster_l3" in dot
    assert graph_to_mermaid(graph, {3}).startswith("flowchart TD")


def test_json_round_trip(models: Path) -> None:
    graph = _graph(models, "tiny_kimi_linear")
    again = graph_from_json(graph_to_json(graph))
    assert format_graph(again) == format_graph(graph)
    assert graph_to_json(again) == graph_to_json(graph)
