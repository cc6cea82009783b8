"""The shard pass: per-rank shapes (numbers from issue 3 and reference/kimi_k3.md), the
collectives each deployment needs, and the one-line refusal of impossible deployments."""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from stepgraph.errors import UserError
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.ir.printer import format_graph
from stepgraph.ir.types import Storage
from stepgraph.ir.values import Split
from stepgraph.ir.verify import verify
from stepgraph.passes.manager import CompileContext, PassError
from stepgraph.passes.shard import Shard
from stepgraph.spec import Deployment, Spec
from stepgraph.spec_loader import load_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
K3, K31 = "kimi_k3", "kimi_k3_1"


@cache
def spec(name: str) -> Spec:
    return load_spec(MODELS / f"{name}.yaml")


def variant(name: str, edit: Any) -> Spec:
    """A copy of a model spec with ``edit(data)`` applied to its JSON form."""
    data = spec(name).model_dump(mode="json")
    edit(data["model"])
    return Spec.model_validate(data)


def shard(model: Spec | str, **deployment: int) -> Graph:
    s = spec(model) if isinstance(model, str) else model
    d = Deployment(**deployment)
    graph = build_step(s.model, d)
    result = Shard().run(graph, CompileContext(s.model, d))
    verify(result.graph)
    return result.graph


@cache
def sharded(model: str, **deployment: int) -> Graph:
    return shard(model, **deployment)


def shape(graph: Graph, name: str) -> tuple:
    return graph.values[name].type.shape


def ops(graph: Graph) -> Counter[str]:
    return Counter(node.op for node in graph)


# ---------------------------------------------------------------------- TP


def test_k3_tp8_per_rank_shapes() -> None:
    g = sharded(K3, tp=8)
    # o_proj 7168 x 1536 at TP8 (issue 3); row-parallel: split on dim 1.
    assert shape(g, "layers.1.self_attn.o_proj") == (7168, 1536)
    assert g.values["layers.1.self_attn.o_proj"].split == Split("tp", 1, 8)
    assert shape(g, "layers.3.self_attn.o_proj") == (7168, 1536)
    # KDA: 96 heads / 8 = 12 heads x 128; f_a (128 rows) replicated; b 96 / 8.
    for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
        assert shape(g, f"layers.1.self_attn.{proj}") == (1536, 7168)
    assert shape(g, "layers.1.self_attn.f_a_proj") == (128, 7168)
    assert g.values["layers.1.self_attn.f_a_proj"].split is None
    assert shape(g, "layers.1.self_attn.b_proj") == (12, 7168)
    assert shape(g, "layers.1.self_attn.recurrent_state") == ("S", 12, 128, 128)
    assert shape(g, "layers.1.self_attn.q_conv_state") == ("S", 1536, 3)
    assert shape(g, "layers.1.self_attn.A_log") == (12,)
    assert g.node("l1.kda_core").attrs["heads"] == 12
    # MLA: q_a / kv_a replicated, gate split, 12 local heads.
    assert shape(g, "layers.3.self_attn.q_a_proj") == (1536, 7168)
    assert shape(g, "layers.3.self_attn.kv_a_proj_with_mqa") == (576, 7168)
    assert shape(g, "layers.3.self_attn.g_proj") == (1536, 7168)
    assert shape(g, "l3.q_latent") == ("B", 12, 576)
    # MoE front per rank: router rows 896 / 8 = 112, latent down 3584 / 8 = 448.
    assert shape(g, "layers.1.mlp.gate") == (112, 7168)
    assert shape(g, "layers.1.mlp.routed_expert_down_proj") == (448, 7168)
    # Experts: 896 / 8 = 112 whole experts per rank.
    assert shape(g, "layers.1.mlp.experts.gate_up_proj") == (112, 6144, 3584)
    experts = g.node("l1.routed_experts")
    assert experts.attrs["local_experts"] == 112
    assert experts.attrs["expert_split"] == {"group": "tp", "ways": 8, "local_experts": 112}
    # Shared expert: gate|up split segment by segment (6144 / 8 each), down on dim 1.
    gate_up = g.values["layers.1.mlp.shared_experts.gate_up_proj"]
    assert gate_up.type.shape == (1536, 7168)
    assert [(s.name, s.rows, s.offset) for s in gate_up.segments] == [
        ("gate", 768, 0), ("up", 768, 768)]
    assert all(s.split == Split("tp", 0, 8) for s in gate_up.segments)
    assert shape(g, "layers.1.mlp.shared_experts.down_proj") == (7168, 768)
    assert shape(g, "layers.0.mlp.down_proj") == (7168, 33792 // 8)
    # Vocab-parallel embedding and lm_head: 163840 / 8.
    assert shape(g, "embed_tokens") == (20480, 7168)
    assert shape(g, "lm_head") == (20480, 7168)
    assert shape(g, "logits") == ("B", 163840)
    assert g.meta["groups"] == {"tp": 8, "dcp": 1, "ep": 1}
    assert g.meta["world"] == 8


def test_k3_tp16_shapes() -> None:
    g = sharded(K3, tp=16)
    assert shape(g, "layers.1.self_attn.o_proj") == (7168, 768)
    assert shape(g, "layers.1.self_attn.b_proj") == (6, 7168)
    assert shape(g, "layers.1.mlp.gate") == (56, 7168)
    assert shape(g, "layers.1.mlp.routed_expert_down_proj") == (224, 7168)
    assert g.node("l1.routed_experts").attrs["local_experts"] == 56


def test_k3_tp8_collectives() -> None:
    g = sharded(K3, tp=8)
    count = ops(g)
    layers, moe_layers = 93, 92
    # One all-reduce per attention, one per MLP (the MoE sums routed + shared first), one
    # after the vocab-parallel embedding.
    assert count["all_reduce"] == 2 * layers + 1
    # Router logits and latent per MoE layer, plus the logits.
    assert count["all_gather"] == 2 * moe_layers + 1
    assert count["reduce_scatter"] == moe_layers
    assert count["dcp_gather"] == count["ep_dispatch"] == 0
    # The MoE output is reduced once, after the sum of the partials.
    reduce = g.node("l1.mlp_out.all_reduce")
    assert reduce.inputs == ("l1.mlp_out.partial",) and reduce.outputs == ("l1.mlp_out",)
    assert g.node("l1.mlp_out").inputs == ("l1.routed_up.partial", "l1.shared.partial")
    # Collectives sit between their producer and the first reader.
    order = [n.name for n in g]
    assert order.index("l1.o_proj") < order.index("l1.attn_out.all_reduce") < order.index(
        "l1.residual_attn")
    # The latent is reduce-scattered; the latent norm is sharded on its columns.
    norm = g.node("l1.latent_norm")
    assert norm.inputs[0] == "l1.routed.part"
    assert shape(g, "l1.routed.part") == ("B", 448)
    assert shape(g, "layers.1.mlp.routed_expert_norm") == (448,)
    assert (norm.attrs["group"], norm.attrs["ways"]) == ("tp", 8)
    assert shape(g, "layers.1.mlp.routed_expert_up_proj") == (7168, 448)


def test_placements_of_sharded_nodes() -> None:
    g = sharded(K3, tp=8)
    assert str(g.node("l1.kda_core").placement) == "sharded[heads]@tp8"
    assert str(g.node("l1.o_proj").placement) == "sharded[columns]@tp8"
    assert str(g.node("l1.routed_experts").placement) == "sharded[experts]@tp8"
    assert str(g.node("embed").placement) == "sharded[vocab]@tp8"
    assert g.node("l1.router").placement.kind == "replicated"
    assert g.node("l1.f_a").placement.kind == "replicated"
    gather = g.node("l1.router_logits.all_gather")
    assert gather.attrs == {"group": "tp", "ways": 8}


def test_tp1_changes_nothing_but_meta() -> None:
    s = spec("tiny_k3")
    d = Deployment()
    graph = build_step(s.model, d)
    result = Shard().run(graph, CompileContext(s.model, d))
    assert not result.changed
    assert format_graph(result.graph) == format_graph(graph)
    assert result.graph.meta["groups"] == {"tp": 1, "dcp": 1, "ep": 1}


def test_shard_is_pure() -> None:
    s = spec("tiny_k3")
    d = Deployment(tp=2)
    graph = build_step(s.model, d)
    before = format_graph(graph)
    Shard().run(graph, CompileContext(s.model, d))
    assert format_graph(graph) == before


def test_tiny_kimi_linear_tp2_without_latent() -> None:
    g = shard("tiny_kimi_linear", tp=2)
    # No latent: the experts read the whole normalized rows; routed + shared reduced once.
    assert "l1.mlp_out.all_reduce" in {n.name for n in g}
    assert ops(g)["reduce_scatter"] == 0
    # The low-rank output gate's g_a stays replicated, g_b is split with the heads.
    assert g.values["layers.1.self_attn.g_a_proj"].split is None
    assert shape(g, "layers.1.self_attn.g_b_proj") == (32, 16)


# ---------------------------------------------------------------------- DCP


def test_k3_dcp8_tp8() -> None:
    g = sharded(K3, tp=8, dcp=8)
    count = ops(g)
    assert count["dcp_gather"] == count["lse_merge"] == 24  # one per MLA layer
    cache_value = g.values["layers.3.self_attn.latent_cache"]
    assert cache_value.split == Split("dcp", 0, 8)
    assert shape(g, "l3.q_latent") == ("B", 12, 576)
    assert shape(g, "l3.q_latent.dcp") == ("B", 96, 576)
    core = g.node("l3.core")
    assert core.inputs[0] == "l3.q_latent.dcp"
    assert core.outputs == ("l3.o_latent.dcp", "l3.o_latent.lse")
    assert shape(g, "l3.o_latent.dcp") == ("B", 96, 512)
    assert g.values["l3.o_latent.lse"].type.dtype == "float32"
    assert str(core.placement) == "sharded[tokens]@dcp8"
    merge = g.node("l3.o_latent.lse_merge")
    assert merge.outputs == ("l3.o_latent",)
    assert shape(g, "l3.o_latent") == ("B", 12, 512)
    assert g.meta["groups"] == {"tp": 8, "dcp": 8, "ep": 1}
    # KDA layers are untouched by DCP.
    assert g.values["layers.1.self_attn.recurrent_state"].split == Split("tp", 1, 8)


# ---------------------------------------------------------------------- DEP


def test_k3_dep16() -> None:
    g = sharded(K3, dep=16)
    count = ops(g)
    assert count["ep_dispatch"] == count["ep_combine"] == 92
    assert count["all_reduce"] == count["all_gather"] == 0
    # Attention at TP1: whole weights, all 96 heads.
    assert shape(g, "layers.1.self_attn.o_proj") == (7168, 12288)
    assert g.node("l1.kda_core").attrs["heads"] == 96
    assert shape(g, "layers.1.mlp.experts.gate_up_proj") == (56, 6144, 3584)
    assert g.values["layers.1.mlp.experts.down_proj"].split == Split("ep", 0, 16)
    experts = g.node("l1.routed_experts")
    assert experts.attrs["local_experts"] == 56
    assert experts.inputs[:3] == ("l1.latent.ep", "l1.topk_ids.ep", "l1.topk_weights.ep")
    assert shape(g, "l1.latent.ep") == ("B*16", 3584)
    assert shape(g, "l1.routed.ep") == ("B*16", 3584)
    assert shape(g, "l1.routed") == ("B", 3584)
    assert g.meta["groups"] == {"tp": 1, "dcp": 1, "ep": 16}
    assert g.meta["world"] == 16
    others = {n.placement.kind for n in g if n.op not in (
        "routed_experts", "ep_dispatch", "ep_combine")}
    assert others == {"data"}


@pytest.mark.parametrize("model", ["tiny_k3", "tiny_kimi_linear"])
@pytest.mark.parametrize("deployment", [{"tp": 1}, {"tp": 2}, {"dep": 2}, {"tp": 2, "dcp": 2},
                                        {"tp": 4}])
def test_tiny_models_shard_and_verify(model: str, deployment: dict[str, int]) -> None:
    g = shard(model, **deployment)
    assert g.meta["world"] == max(deployment.get("tp", 1), deployment.get("dep", 1))
    # every temp or output that is read has a writer (checked by verify) and no temp is
    # left without a reader or writer
    written = {o for n in g for o in n.outputs}
    read = {i for n in g for i in n.inputs}
    for value in g.values.values():
        if value.storage is Storage.TEMP and value.view is None:
            assert value.name in written or value.name in read, value.name


def test_k31_tp8() -> None:
    g = sharded(K31, tp=8)
    assert g.node("l3.core").op == "dsa_core"
    assert g.node("l3.core").attrs["heads"] == 12
    # The indexer stays replicated.
    assert g.values["layers.3.self_attn.indexer.wk"].split is None
    assert shape(g, "l3.index_q") == ("B", 32, 128)


# ---------------------------------------------------------------------- refusals


def _tiny_without(kind: str):
    def edit(model: dict) -> None:
        if kind == "mla":
            model["layers"]["overrides"] = [{"at": 0, "mlp": "dense"}]
        else:
            model["layers"]["default"]["mlp"] = "dense"
            model["layers"]["overrides"] = [{"at": "3, 5", "attention": "mla"}]
    return edit


def _tiny_with(path: tuple[str, ...], value: int):
    def edit(model: dict) -> None:
        target = model
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


REFUSALS = [
    (K3, {"tp": 7}, "pass shard: tp=7 does not divide the 96 KDA heads (tp must divide 96; "
                    "every split of kimi_k3 allows tp = 1, 2, 4, 8, 16, 32)"),
    (K3, {"tp": 3}, "tp=3 does not divide the 896 routed experts"),
    (K3, {"tp": 64}, "tp=64 does not divide the 96 KDA heads"),
    (K31, {"tp": 64}, "tp=64 does not divide the 96 KDA heads"),
    (K3, {"tp": 8, "dep": 16}, "dep=16 with tp=8: DEP runs the attention at TP1"),
    (K3, {"dcp": 8}, "dcp=8 without tp"),
    (K3, {"tp": 8, "dcp": 4}, "dcp=4 with tp=8: dcp must equal tp"),
    (K31, {"tp": 8, "dcp": 8}, "dcp=8 with 24 DSA layers (first: 3)"),
    (K3, {"dep": 1024}, "dep=1024 is more EP ranks than the 896 routed experts"),
    (K3, {"dep": 12}, "dep=12 does not divide the 896 routed experts"),
    ("tiny_k3", {"tp": 8}, "tp=8 does not divide the 4 KDA heads"),
    ("tiny_k3", {"tp": 32}, "tp=32 does not divide the 4 KDA heads"),
]


@pytest.mark.parametrize(("model", "deployment", "message"), REFUSALS)
def test_refused_deployments(model: str, deployment: dict[str, int], message: str) -> None:
    with pytest.raises(PassError) as caught:
        shard(model, **deployment)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text
    assert isinstance(caught.value, UserError)


@pytest.mark.parametrize(("edit", "deployment", "message"), [
    (_tiny_with(("vocab_size",), 255), {"tp": 2}, "tp=2 does not divide the 255 vocabulary "
                                                  "rows"),
    (_tiny_with(("mlp", "moe", "latent", "width"), 30), {"tp": 4},
     "tp=4 does not divide the 30 latent MoE width"),
    (_tiny_with(("mlp", "moe", "shared_width"), 42), {"tp": 4},
     "tp=4 does not divide the 42 shared expert width"),
    (_tiny_with(("mlp", "dense", "intermediate_size"), 126), {"tp": 4},
     "tp=4 does not divide the 126 dense MLP intermediate size"),
    (_tiny_with(("attention", "mla", "heads"), 6), {"tp": 4},
     "tp=4 does not divide the 6 MLA heads"),
    (_tiny_with(("mlp", "moe", "experts"), 6), {"tp": 4},
     "tp=4 does not divide the 6 routed experts"),
    (_tiny_without("mla"), {"tp": 2, "dcp": 2}, "has no MLA or DSA layer"),
    (_tiny_without("moe"), {"dep": 2}, "has no MoE layer"),
])
def test_refused_sizes(edit: Any, deployment: dict[str, int], message: str) -> None:
    with pytest.raises(PassError, match=r"^pass shard: ") as caught:
        shard(variant("tiny_k3", edit), **deployment)
    assert message in str(caught.value)
