"""The fuse pass: which AttnRes paths become one ``attn_res_norm`` node, which are left alone,
and that the fused plan computes what the unfused one does (reference executor, float32,
random weights, several decode steps)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import MODELS, run_cli

from stepgraph.compiler import compile_graph
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Value
from stepgraph.ir.verify import verify
from stepgraph.passes.fuse import Fuse
from stepgraph.passes.manager import CompileContext
from stepgraph.passes.pipeline import CompileOptions
from stepgraph.spec_loader import load_spec, override_deployment

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [200, 100, 50, 25, 12]]


def _compiled(model: str, fuse: bool = True, **deployment: int) -> Graph:
    spec = load_spec(MODELS / f"{model}.yaml")
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, **deployment),
                             CompileOptions(fuse=fuse))
    return graph


def _before_fuse(model: str) -> tuple[Graph, CompileContext]:
    spec = load_spec(MODELS / f"{model}.yaml")
    graph, _ = compile_graph(spec, spec.deployment, stop_after="pack")
    return graph, CompileContext(spec.model, spec.deployment)


def test_every_k3_mix_fuses_with_its_norm_and_adds() -> None:
    unfused, fused = _compiled("kimi_k3", fuse=False), _compiled("kimi_k3")
    before, after = Counter(n.op for n in unfused), Counter(n.op for n in fused)
    # 92 layers with two mixes, layer 0 with one, and the final mix
    assert before["attn_res_mix"] == after["attn_res_norm"] == 2 * 92 + 1 + 1
    assert after["attn_res_mix"] == 0
    # every rmsnorm behind a mix went; layer 0's input norm (of the embedding itself) and
    # the MoE latent norms became their projections' input norms (one world: not sharded)
    assert after["rmsnorm"] == 0
    normed = [n for n in fused if "input_norm_eps" in n.attrs]
    assert len(normed) == before["rmsnorm"] - before["attn_res_mix"] == 92 + 1
    # every add went: each (binary) prefix-sum add, and the MoE's routed + shared add
    # flattened into it, is one delta of a fused node
    assert after["add"] == 0
    assert before["add"] == sum(n.attrs["deltas"] for n in fused if n.op == "attn_res_norm")
    assert len(fused) < len(unfused)


def test_fused_node_shape_at_an_moe_layer() -> None:
    graph = _compiled("tiny_k3")
    node = graph.node("l2.attn_mix")
    assert node.op == "attn_res_norm"
    assert node.outputs == ("l2.input_norm", "l1.residual_mlp")
    assert node.attrs["sources"] == 2 and node.attrs["deltas"] == 2
    # blocks..., old prefix, deltas (routed + shared, the flattened MoE add), query, norms
    assert node.inputs == ("embedded", "l1.residual_attn", "l1.routed_up", "l1.shared",
                           "layers.2.attn_res.query", "layers.2.attn_res.norm",
                           "layers.2.input_layernorm")
    assert "l1.mlp_out" not in graph.values and "l2.attn_mix" not in graph.values
    # right after a block push the mix reads the attention output directly: no deltas
    pushed = graph.node("l2.mlp_mix")
    assert pushed.attrs["deltas"] == 0 and pushed.outputs == ("l2.post_attention_norm",)


def test_norms_fuse_into_their_projections_unless_sharded() -> None:
    """A replicated RMSNorm read only by a projection becomes its input norm (the norm's
    weight the third input, its eps and output dtype in attrs, the projection keeps its
    name and tactic lookup); at TP8 K3's latent norm is sharded (an all-reduced mean
    square) and stays, layer 0's replicated input norm still fuses."""
    graph = _compiled("kimi_k3")
    up = graph.node("l5.routed_up")
    assert up.op == "projection" and up.inputs == (
        "l5.routed", "layers.5.mlp.routed_expert_up_proj", "layers.5.mlp.routed_expert_norm")
    assert up.attrs["input_norm_eps"] == 1e-5 and up.attrs["input_norm_dtype"] == "bfloat16"
    assert "l5.latent_norm" not in graph.values
    sharded = _compiled("kimi_k3", tp=8)
    ops = Counter(n.op for n in sharded)
    assert ops["rmsnorm"] == 92
    assert all(int(n.attrs.get("ways", 1)) == 8 for n in sharded if n.op == "rmsnorm")
    assert [n.name for n in sharded if "input_norm_eps" in n.attrs] == ["l0.in_proj"]
    verify(sharded)


@pytest.mark.parametrize("deployment", [{"tp": 2}, {"tp": 2, "dcp": 2}, {"dep": 2}])
def test_fuses_under_every_parallelism(deployment: dict[str, int]) -> None:
    graph = _compiled("tiny_k3", **deployment)
    ops = Counter(n.op for n in graph)
    assert ops["attn_res_mix"] == 0 and ops["attn_res_norm"] == 12
    verify(graph)


def test_plain_residual_models_only_fuse_norms_into_projections() -> None:
    """Without AttnRes only the norm -> projection rewrite applies: each norm read by one
    projection goes, the projection keeps its name and place; nothing else changes."""
    graph, ctx = _before_fuse("tiny_kimi_linear")
    result = Fuse(combine_top_k=0).run(graph, ctx)
    fused = result.graph
    assert result.changed and Counter(n.op for n in fused)["attn_res_norm"] == 0
    gone = [n.name for n in graph if not fused.has_node(n.name)]
    assert gone and all(graph.node(name).op == "rmsnorm" for name in gone)
    assert len([n for n in fused if "input_norm_eps" in n.attrs]) == len(gone)
    assert [n.name for n in fused] == [n.name for n in graph if n.name not in gone]


def test_expert_sums_move_into_their_projections_at_small_top_k() -> None:
    """k3-rank-tp8 (top-2 of 112, every expert held): each routed_experts node writes its
    slots [B, 2, 3584] in float32 and routed_expert_up sums them as its input combine (its
    latent norm fused in too); k3-slice-tp1 (top-16), a DEP deployment (experts split over
    ranks) and ``combine_top_k=0`` keep the experts' own sum."""
    graph = _compiled("k3_rank_tp8")
    experts = [n for n in graph if n.op == "routed_experts"]
    assert len(experts) == 12 and all(n.attrs["slots"] for n in experts)
    for node in experts:
        (slots,) = node.outputs
        assert graph.values[slots].type == TensorType(("B", 2, 3584), "float32")
        (reader,) = graph.users()[slots]
        up = graph.node(reader)
        assert up.name.endswith("routed_up") and up.inputs[0] == slots
        assert up.attrs["input_combine_top_k"] == 2
        assert up.attrs["input_combine_dtype"] == node.attrs["slot_dtype"] == "bfloat16"
        assert "input_norm_eps" in up.attrs
    assert not any(name.endswith(".routed") for name in graph.values)
    verify(graph)
    for other in (_compiled("k3_slice_tp1"), _compiled("tiny_k3", dep=2)):
        assert not any(n.attrs.get("slots") for n in other)
        assert not any("input_combine_top_k" in n.attrs for n in other)
    graph, ctx = _before_fuse("k3_rank_tp8")
    kept = Fuse(combine_top_k=0).run(graph, ctx).graph
    assert not any(n.attrs.get("slots") for n in kept)


def test_disabled_leaves_the_graph() -> None:
    graph, ctx = _before_fuse("tiny_k3")
    result = Fuse(enabled=False).run(graph, ctx)
    assert not result.changed and result.summary == "disabled"
    assert Counter(n.op for n in result.graph)["attn_res_mix"] == 12


def _with_reader(graph: Graph, value: str, after: str) -> Graph:
    """``graph`` with an extra rmsnorm reading ``value``, placed after node ``after``."""
    g = graph.copy()
    source = g.values[value]
    probe = f"probe.{value}"
    g.add_value(Value(probe, TensorType(source.type.shape, source.type.dtype), Storage.TEMP))
    hidden = source.type.shape[-1]
    weight = next(v.name for v in g.values.values() if v.storage is Storage.WEIGHT
                  and v.type.shape == (hidden,))
    reader = Node(probe, "rmsnorm", (value, weight), (probe,), {"eps": 1e-5})
    nodes = list(g)
    at = [n.name for n in nodes].index(after) + 1
    g.set_nodes([*nodes[:at], reader, *nodes[at:]])
    verify(g)
    return g


def test_a_mix_read_twice_keeps_its_own_node() -> None:
    graph, ctx = _before_fuse("tiny_k3")
    g = _with_reader(graph, "l2.attn_mix", "l2.input_norm")
    fused = Fuse().run(g, ctx).graph
    verify(fused)
    assert fused.node("l2.attn_mix").op == "attn_res_mix"
    assert fused.node("l1.residual_mlp").op == "add"
    assert fused.node("l3.attn_mix").op == "attn_res_norm"  # the others still fuse


def test_an_add_read_before_the_mix_stays_an_add() -> None:
    graph, ctx = _before_fuse("tiny_k3")
    g = _with_reader(graph, "l1.residual_mlp", "l1.residual_mlp")
    fused = Fuse().run(g, ctx).graph
    verify(fused)
    assert fused.node("l1.residual_mlp").op == "add"
    node = fused.node("l2.attn_mix")
    assert node.op == "attn_res_norm" and node.attrs["deltas"] == 0


def test_cli_no_fuse_flag(tmp_path) -> None:
    out = tmp_path / "plain.sgart"
    result = run_cli("compile", str(MODELS / "tiny_k3.yaml"), "-o", str(out), "--no-fuse", "-v")
    assert result.returncode == 0, result.stderr
    assert any(line.split()[:1] == ["fuse"] and "disabled" in line
               for line in result.stderr.splitlines()), result.stderr


# ------------------------------------------------------------------ numerics


def test_fused_plan_computes_the_unfused_plan() -> None:
    """Random weights, three requests of several decode steps: the logits of the fused plan
    against the unfused plan's, both through the reference executor in float32. (Not in
    BF16: on tiny_k3's random weights BF16 flips top-2-of-8 routing, and the BF16 reference
    is itself ~0.5 from float32; the kernel tests compare the fused op in BF16.)"""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from stepgraph.lower.decode import DecodeRunner, run_prompts
    from stepgraph.lower.weights import random_weights

    logits = []
    for fuse in (True, False):
        graph = _compiled("tiny_k3", fuse=fuse)
        weights = random_weights(graph, 3, dtype=torch.float32)
        runner = DecodeRunner(graph, weights, 4, 12)
        logits.append(run_prompts(runner, PROMPTS))
    fused, plain = logits
    steps = ~np.isnan(plain)  # shorter prompts are padded with NaN
    assert (np.isnan(fused) == ~steps).all() and float(np.abs(plain[steps]).max()) > 0
    err = float(np.linalg.norm(fused[steps] - plain[steps]) / np.linalg.norm(plain[steps]))
    assert err < 2e-6, f"fused vs unfused logits {err:.2e}"
