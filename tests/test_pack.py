"""The pack pass: packed per-rank weights with the row counts issue 3 and reference/kimi_k3.md
pin, segments that remember their sources, views in place of the member outputs, and the
MoE front's merged all-gather."""

from __future__ import annotations

import time
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.ir.printer import format_graph
from stepgraph.ir.values import Split, View
from stepgraph.passes.manager import CompileContext, PassError, run_pipeline
from stepgraph.passes.pack import Pack
from stepgraph.passes.shard import Shard
from stepgraph.spec import Deployment, Spec
from stepgraph.spec_loader import load_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
K3, K31 = "kimi_k3", "kimi_k3_1"


@cache
def spec(name: str) -> Spec:
    return load_spec(MODELS / f"{name}.yaml")


def compile_step(model: str, pack: Pack | None = None, **deployment: int) -> Graph:
    """Frontend -> shard -> pack, verified after every pass by the pass manager."""
    s = spec(model)
    d = Deployment(**deployment)
    graph, _ = run_pipeline(build_step(s.model, d), [Shard(), pack or Pack()],
                            CompileContext(s.model, d))
    return graph


@cache
def packed(model: str, **deployment: int) -> Graph:
    return compile_step(model, **deployment)


def segments(graph: Graph, weight: str) -> list[tuple[str, int]]:
    return [(s.name, s.rows) for s in graph.values[weight].segments]


def rows(graph: Graph, weight: str) -> int:
    return graph.values[weight].type.shape[0]


# ---------------------------------------------------------------------- pinned row counts


def test_k3_tp1_packed_shapes() -> None:
    g = packed(K3)
    # 12288 x 4 + 128 + 96 = 49376 rows x 7168 (reference/kimi_k3.md).
    kda = "layers.1.self_attn.in_proj_qkvgfab"
    assert g.values[kda].type.shape == (49376, 7168)
    assert segments(g, kda) == [("q", 12288), ("k", 12288), ("v", 12288), ("g", 12288),
                                ("f_a", 128), ("b", 96)]
    # [q_a 1536 | kv_a 576 | gate 12288]
    assert rows(g, "layers.3.self_attn.fused_qkv_a_g_proj") == 1536 + 576 + 12288
    front = "layers.1.mlp.front_proj"
    assert segments(g, front) == [("router_logits", 896), ("latent", 3584)]
    assert g.values["l1.front"].type.dtype == "float32"


@pytest.mark.parametrize(("tp", "kda_rows", "mla_rows"), [(8, 6288, 3648), (16, 3216, 2880)])
def test_k3_tp_packed_rows(tp: int, kda_rows: int, mla_rows: int) -> None:
    g = packed(K3, tp=tp)
    kda = "layers.1.self_attn.in_proj_qkvgfab"
    assert g.values[kda].type.shape == (kda_rows, 7168)
    assert rows(g, "layers.3.self_attn.fused_qkv_a_g_proj") == mla_rows
    assert rows(g, "layers.92.self_attn.fused_qkv_a_g_proj") == mla_rows
    assert g.values["l1.in_proj"].type.shape == ("B", kda_rows)


def test_k3_tp8_kda_segments() -> None:
    g = packed(K3, tp=8)
    weight = g.values["layers.1.self_attn.in_proj_qkvgfab"]
    # 6144 + 128 + 12 = 6284 -> 6288 (reference/kimi_k3.md).
    assert [(s.name, s.rows, s.offset) for s in weight.segments] == [
        ("q", 1536, 0), ("k", 1536, 1536), ("v", 1536, 3072), ("g", 1536, 4608),
        ("f_a", 128, 6144), ("b", 12, 6272), ("b.pad", 4, 6284)]
    by_name = {s.name: s for s in weight.segments}
    assert by_name["q"].source == "layers.1.self_attn.q_proj"
    assert by_name["q"].split == Split("tp", 0, 8)
    assert by_name["f_a"].source == "layers.1.self_attn.f_a_proj"
    assert by_name["f_a"].split is None  # replicated
    assert by_name["b.pad"].source is None
    # The member weights are gone; their outputs are views of the packed output.
    assert "layers.1.self_attn.q_proj" not in g.values
    assert g.values["l1.q"].view == View("l1.in_proj", 0, 1536)
    assert g.values["l1.b"].view == View("l1.in_proj", 6272, 6284)
    # The core reads the same names as before.
    assert g.node("l1.kda_core").inputs[:6] == ("l1.q", "l1.k", "l1.v", "l1.g", "l1.f_a",
                                                "l1.b")
    assert sum(1 for n in g if n.layer == 1 and n.op == "projection"
               and n.unit == "attention") == 1


def test_k3_tp8_mla_segments() -> None:
    g = packed(K3, tp=8)
    assert segments(g, "layers.3.self_attn.fused_qkv_a_g_proj") == [
        ("q_a", 1536), ("kv_a", 576), ("gate", 1536)]


def test_k3_tp8_moe_front_and_merged_gather() -> None:
    g = packed(K3, tp=8)
    # 112 + 448 rows per rank at TP8 (issue 3).
    assert segments(g, "layers.1.mlp.front_proj") == [("router_logits", 112), ("latent", 448)]
    front = g.node("l1.front")
    assert g.values["l1.front"].type.shape == ("B", 560)
    assert g.values["l1.front"].type.dtype == "float32"
    gathers = [n for n in g if n.layer == 1 and n.op == "all_gather"]
    assert len(gathers) == 1 and gathers[0].inputs == ("l1.front",)
    assert g.values[gathers[0].outputs[0]].type.shape == ("B", 4480)
    assert g.values["l1.router_logits"].view == View(gathers[0].outputs[0], 0, 112, 8, 560)
    assert g.values["l1.latent"].view == View(gathers[0].outputs[0], 112, 560, 8, 560)
    assert g.values["l1.router_logits"].type.shape == ("B", 896)
    assert g.values["l1.latent"].type.shape == ("B", 3584)
    assert g.node("l1.router").inputs[0] == "l1.router_logits"
    order = [n.name for n in g]
    assert order.index(front.name) < order.index(gathers[0].name) < order.index("l1.router")
    # One gather per MoE layer plus the logits'.
    assert Counter(n.op for n in g)["all_gather"] == 92 + 1


def test_k3_tp16_front_pads_router_rows() -> None:
    g = packed(K3, tp=16)
    # 896 / 16 = 56 router rows, padded to 64, then 3584 / 16 = 224 latent rows.
    assert segments(g, "layers.1.mlp.front_proj") == [
        ("router_logits", 56), ("router_logits.pad", 8), ("latent", 224)]
    gathered = g.node("l1.front.all_gather").outputs[0]
    assert g.values["l1.router_logits"].view == View(gathered, 0, 56, 16, 288)
    assert g.values["l1.latent"].view == View(gathered, 64, 288, 16, 288)


def test_k31_dsa_packed_rows() -> None:
    g = packed(K31)
    dsa = "layers.3.self_attn.fused_qkv_a_g_index_proj"
    # [q_a 1536 | kv_a 576 | gate 12288 | wk 128 | weights 32] = 14560 (reference/kimi_k3.md).
    assert g.values[dsa].type.shape == (14560, 7168)
    assert segments(g, dsa) == [("q_a", 1536), ("kv_a", 576), ("gate", 12288),
                                ("index_k", 128), ("index_weights", 32)]
    sources = [s.source for s in g.values[dsa].segments]
    assert sources[3:] == ["layers.3.self_attn.indexer.wk",
                           "layers.3.self_attn.indexer.weights_proj"]
    g8 = packed(K31, tp=8)
    assert rows(g8, dsa) == 1536 + 576 + 1536 + 128 + 32


def test_tiny_kimi_linear_low_rank_gate_and_plain_mla() -> None:
    g = packed("tiny_kimi_linear")
    assert segments(g, "layers.1.self_attn.in_proj_qkvgfab") == [
        ("q", 64), ("k", 64), ("v", 64), ("g_a", 16), ("f_a", 16), ("b", 4), ("b.pad", 12)]
    # No q_lora and no output gate: [q 4 x 24 | kv_a 40 (+8)].
    assert segments(g, "layers.3.self_attn.fused_qkv_a_proj") == [
        ("q", 96), ("kv_a", 40), ("kv_a.pad", 8)]
    # No latent: the MoE front is the router alone, nothing to pack.
    assert "layers.1.mlp.gate" in g.values


# ---------------------------------------------------------------------- every deployment


@pytest.mark.parametrize(("model", "deployment"), [
    (K3, {"tp": 8}), (K3, {"tp": 16}), (K3, {"tp": 8, "dcp": 8}), (K3, {"dep": 16}),
    (K31, {"tp": 8}),
    ("tiny_k3", {}), ("tiny_k3", {"tp": 2}), ("tiny_k3", {"dep": 2}),
    ("tiny_kimi_linear", {}), ("tiny_kimi_linear", {"tp": 2}), ("tiny_kimi_linear", {"dep": 2}),
])
def test_compiles_and_verifies(model: str, deployment: dict[str, int]) -> None:
    g = packed(model, **deployment)  # run_pipeline verifies after shard and after pack
    kinds = [e["attention"] for e in g.meta["layers"]]
    packed_attention = [n for n in g if n.op == "projection" and n.unit == "attention"
                        and "packed" in n.attrs]
    assert len(packed_attention) == len(kinds)


def test_dep16_front_is_packed_at_tp1() -> None:
    g = packed(K3, dep=16)
    assert segments(g, "layers.1.mlp.front_proj") == [("router_logits", 896), ("latent", 3584)]
    assert rows(g, "layers.1.self_attn.in_proj_qkvgfab") == 49376
    dispatch = g.node("l1.routed_experts.ep_dispatch")
    assert dispatch.inputs[0] == "l1.latent"
    assert g.values["l1.latent"].view == View("l1.front", 896, 4480)


# ---------------------------------------------------------------------- options


def test_disabled_and_front_off() -> None:
    s = spec("tiny_k3")
    d = Deployment(tp=2)
    sharded = Shard().run(build_step(s.model, d), CompileContext(s.model, d)).graph
    off = Pack(enabled=False).run(sharded, CompileContext(s.model, d))
    assert not off.changed and format_graph(off.graph) == format_graph(sharded)
    g = compile_step("tiny_k3", Pack(front="off"), tp=2)
    assert "layers.1.mlp.front_proj" not in g.values
    assert "layers.1.mlp.gate" in g.values
    assert "layers.1.self_attn.in_proj_qkvgfab" in g.values


@pytest.mark.parametrize(("option", "message"), [
    ({"front": "bf16"}, "pass pack: front='bf16': use one of fp32, off"),
    ({"align": 0}, "pass pack: align=0: use a positive row multiple"),
])
def test_bad_options(option: dict, message: str) -> None:
    with pytest.raises(PassError) as caught:
        compile_step("tiny_k3", Pack(**option))
    assert str(caught.value) == message


def test_pack_is_pure() -> None:
    s = spec("tiny_k3")
    d = Deployment(tp=2)
    sharded = Shard().run(build_step(s.model, d), CompileContext(s.model, d)).graph
    before = format_graph(sharded)
    Pack().run(sharded, CompileContext(s.model, d))
    assert format_graph(sharded) == before


def test_full_k3_shard_and_pack_are_fast() -> None:
    s = spec(K3)
    d = Deployment(tp=8)
    ctx = CompileContext(s.model, d)
    graph = build_step(s.model, d)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        Pack().run(Shard().run(graph, ctx).graph, ctx)
        best = min(best, time.perf_counter() - start)
    assert best < 0.3
