"""The pdl pass: PDL marks with reasons, pre-wait weight bytes, prefetch forks at the seeds'
fork points, and the ablation switch."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from stepgraph.compiler import compile_graph
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node, Placement
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Segment, Value
from stepgraph.ir.verify import verify
from stepgraph.passes.bin import Bin
from stepgraph.passes.manager import CompileContext, run_pipeline
from stepgraph.passes.pdl import Pdl, pre_wait_inputs
from stepgraph.spec import Deployment
from stepgraph.spec_loader import load_spec
from stepgraph.tactics import TABLES_DIR, load_tables
from tests.conftest import MODELS, fork_tables

# H200 SMs (132, datasheet) x two tiles before the wait (seeds 000) x a 128 x 64 BF16 tile.
PRE_WAIT_CAP = 132 * 2 * 128 * 64 * 2


def _tables(tmp_path: Path, budget: int = 16 << 20, rule: str = "seeds") -> object:
    return load_tables("h200", fork_tables(tmp_path, budget, rule))


def _compiled(name: str, passes: list, tables=None, **deployment) -> Graph:
    spec = load_spec(MODELS / name)
    dep = spec.deployment.model_copy(update=deployment) if deployment else spec.deployment
    ctx = CompileContext(spec.model, dep, {"tactics": tables} if tables else {})
    graph, _ = run_pipeline(build_step(spec.model, dep), passes, ctx)
    return graph


def _chain_graph() -> Graph:
    """norm -> projection (6288 x 7168, split-K at TP8) -> all_reduce -> norm -> norm."""
    g = Graph("chain")
    bf16 = "bfloat16"
    g.add_value(Value("x", TensorType(("B", 7168), bf16), Storage.INPUT))
    g.add_value(Value("n_w", TensorType((7168,), bf16), Storage.WEIGHT,
                      (Segment("w", "n_w", 7168),)))
    g.add_value(Value("w", TensorType((6288, 7168), bf16), Storage.WEIGHT,
                      (Segment("w", "w", 6288),)))
    g.add_value(Value("v_w", TensorType((6288,), bf16), Storage.WEIGHT,
                      (Segment("w", "v_w", 6288),)))
    for name, width in (("a", 7168), ("b", 6288), ("c", 6288), ("d", 6288)):
        g.add_value(Value(name, TensorType(("B", width), bf16), Storage.TEMP))
    g.add_value(Value("out", TensorType(("B", 6288), bf16), Storage.OUTPUT))
    g.add_node(Node("norm0", "rmsnorm", ("x", "n_w"), ("a",), {"eps": 1e-5}))
    g.add_node(Node("norm1", "rmsnorm", ("a", "n_w"), ("a2",), {"eps": 1e-5}))
    g.add_value(Value("a2", TensorType(("B", 7168), bf16), Storage.TEMP))
    g.add_node(Node("proj", "projection", ("a2", "w"), ("b",)))
    g.add_node(Node("reduce", "all_reduce", ("b",), ("c",), {"group": "tp", "ways": 8},
                    Placement("sharded", "tp", 8, "columns")))
    g.add_node(Node("norm2", "rmsnorm", ("c", "v_w"), ("d",), {"eps": 1e-5}))
    g.add_node(Node("norm3", "rmsnorm", ("d", "v_w"), ("out",), {"eps": 1e-5}))
    g.meta.update(groups={"tp": 8, "dcp": 1, "ep": 1}, layers=[])
    verify(g)
    return g


def _chain_marks(batches: tuple[int, ...] = (1, 8)) -> dict:
    spec = load_spec(MODELS / "kimi_k3.yaml")
    ctx = CompileContext(spec.model, Deployment(tp=8, batches=batches))
    graph, _ = run_pipeline(_chain_graph(), [Bin(), Pdl()], ctx)
    return graph.meta["pdl"]


def test_first_launch_collectives_and_their_followers_cannot_use_pdl() -> None:
    marks = _chain_marks()
    assert not marks["norm0"]["pdl"] and "first launch" in marks["norm0"]["reason"]
    assert marks["norm1"]["pdl"] and marks["proj"]["pdl"]
    assert not marks["reduce"]["pdl"] and "NCCL" in marks["reduce"]["reason"]
    assert not marks["norm2"]["pdl"] and "follows collective reduce" in marks["norm2"]["reason"]
    assert marks["norm3"]["pdl"]
    assert all(m["prefetch_bytes"] == 0 for n, m in marks.items() if not m["pdl"])


def test_pre_wait_bytes_are_the_weight_bytes_capped_at_the_first_tiles() -> None:
    marks = _chain_marks()
    assert marks["norm1"]["prefetch_bytes"] == 7168 * 2
    assert marks["norm3"]["prefetch_bytes"] == 6288 * 2
    assert marks["proj"]["prefetch_bytes"] == PRE_WAIT_CAP == 4325376  # 86 MiB weight, capped


def test_providers_without_pdl_and_their_followers_are_marked_per_bin() -> None:
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl()])
    marks, decisions = graph.meta["pdl"], graph.meta["decisions"]
    # every launch after the first and not a collective: cuBLAS projections cannot wait
    proj = marks["l2.q"]
    assert decisions["l2.q"]["1"]["provider"] == "cublas"
    assert not proj["pdl"] and "cublas cannot wait" in proj["reason"]
    follower = marks["l2.k"]  # after l2.q, also cuBLAS
    assert not follower["pdl"]
    after_fla = marks["l2.o_proj"]  # o_proj after the fla KDA core
    assert not after_fla["pdl"]
    norm = marks["l2.input_norm"]  # triton after the triton AttnRes mix
    assert norm["pdl"] and norm["prefetch_bytes"] == 64 * 2
    routed = marks["l2.routed_experts"]  # triton_fused_moe after the cuBLAS latent projection
    assert not routed["pdl"] and "never triggers" in routed["reason"]
    assert set(marks) == {n.name for n in graph}


def test_routed_experts_load_no_expert_weights_before_the_wait(tmp_path: Path) -> None:
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    for op in ("projection", "o_proj"):
        data["ops"][op]["providers"] = ["splitk"]
    data["tactics"]["projection"]["default"] = "splitk"
    data["tactics"]["projection"]["rows"] = [r for r in data["tactics"]["projection"]["rows"]
                                             if not isinstance(r["bins"][64], str)]
    path = tmp_path / "h200.yaml"
    path.write_text(yaml.safe_dump(data))
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl()], load_tables("h200", path))
    routed = graph.meta["pdl"]["l2.routed_experts"]
    assert routed["pdl"] and routed["prefetch_bytes"] == 0


def test_stock_bins_are_listed_off(tmp_path: Path) -> None:
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    data["caps"]["mla"]["rows"] = data["caps"]["mla"]["dcp_rows"] = 4
    data["prefetch"]["fork_budget_bytes"] = 4096
    path = tmp_path / "h200.yaml"
    path.write_text(yaml.safe_dump(data))
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl()], load_tables("h200", path),
                      batches=(1, 8))
    norm = graph.meta["pdl"]["l2.input_norm"]
    assert norm["pdl"] and norm["off_bins"] == {"8": "bin 8 runs the stock path"}
    fork = next(n for n in graph if n.op == "prefetch")
    assert graph.meta["decisions"][fork.name]["8"]["provider"] == "stock"
    assert graph.meta["decisions"][fork.name]["1"]["provider"] == "l2_prefetch"


# ----------------------------------------------------------------------------- prefetch forks


def test_forks_sit_at_the_seeds_fork_points(tmp_path: Path) -> None:
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl()], _tables(tmp_path, 4096))
    order = [n.name for n in graph]
    for layer, entry in enumerate(graph.meta["layers"]):
        fork = f"l{layer}.prefetch_attention_moe"
        if entry["attention"] == "kda":  # seeds: forked before the KDA core runs
            assert order[order.index(fork) + 1] == f"l{layer}.kda_core"
        else:  # seeds: forked after the MLA core
            assert order[order.index(fork) - 1] == f"l{layer}.core"
        down = f"l{layer}.prefetch_oproj_down"
        assert order[order.index(down) - 1] == f"l{layer}.o_proj"


def test_forks_warm_the_mlp_weights_in_launch_order(tmp_path: Path) -> None:
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl()], _tables(tmp_path, 4096))
    first = graph.node("l2.prefetch_attention_moe")
    # tiny MoE layer: gate 8x64 bf16 = 1024 B, then the latent down 32x64 bf16 = 4096 B.
    assert first.inputs == ("layers.2.mlp.gate", "layers.2.mlp.routed_expert_down_proj")
    assert first.outputs == ()
    assert first.attrs == {"bytes": 4096, "weight_offsets": [0, 0],
                           "weight_bytes": [1024, 3072], "target": "l2.router_logits",
                           "fork": "attention_moe"}
    second = graph.node("l2.prefetch_oproj_down")
    # the rest of the latent down, then the latent up 64x32 bf16 (routed experts skipped).
    assert second.inputs == ("layers.2.mlp.routed_expert_down_proj",
                             "layers.2.mlp.routed_expert_up_proj")
    assert second.attrs["weight_offsets"] == [3072, 0]
    assert second.attrs["weight_bytes"] == [1024, 3072]
    assert second.attrs["target"] == "l2.latent"
    assert graph.meta["pdl"][second.name]["pdl"] is False


def test_k3_forks_fill_their_budget(tmp_path: Path) -> None:
    graph = _compiled("kimi_k3.yaml", [Bin(), Pdl()], _tables(tmp_path))
    forks = [n for n in graph if n.op == "prefetch"]
    assert len(forks) == 2 * 93
    fork = graph.node("l4.prefetch_attention_moe")
    # router gate 896 x 7168 bf16, then the first bytes of the latent down 3584 x 7168.
    assert fork.attrs["weight_bytes"] == [896 * 7168 * 2, 16 * 2**20 - 896 * 7168 * 2]
    assert fork.attrs["target"] == "l4.router_logits"


def test_the_h200_table_inserts_no_forks() -> None:
    """The shipped H200 table turns the forks off (measured slower, docs/perf.md): the pass
    inserts none and records the zero budget."""
    graph = _compiled("kimi_k3.yaml", [Bin(), Pdl()])
    assert not [n for n in graph if n.op == "prefetch"]
    assert graph.meta["pdl_config"]["fork_budget_bytes"] == 0


def test_next_weights_forks_warm_the_next_streaming_launch(tmp_path: Path) -> None:
    """``next_weights``: a fork right after each weight-streaming launch that small launches
    follow, warming the next streaming launch's first weight bytes; never the routed experts
    (the router has not chosen them), never two streaming launches in a row."""
    budget = 16 << 20
    spec = load_spec(MODELS / "kimi_k3.yaml")
    graph, _ = compile_graph(spec, spec.deployment,
                             tables_path=fork_tables(tmp_path, budget, "next_weights"))
    order = list(graph)
    forks = [i for i, n in enumerate(order) if n.op == "prefetch"]
    assert forks
    for i in forks:
        fork, before = order[i], order[i - 1]
        target = graph.node(fork.attrs["target"])
        assert fork.attrs["fork"] == "next_weights" and fork.attrs["bytes"] <= budget
        assert target.op != "routed_experts"
        assert set(fork.inputs) <= set(target.inputs)
        assert graph.meta["pdl"][fork.name]["pdl"] is False
        # between the launch before the fork and the target: only small launches
        between = order[i + 1: order.index(target)]
        assert between and all(n.op != "prefetch" for n in between)
        assert before.op in ("projection", "o_proj", "shared_expert", "routed_experts",
                             "dense_mlp", "mla_query", "mla_value", "lm_head")
    # K3 layer 4 (KDA, MoE): the KDA core runs between the packed in_proj and o_proj, so
    # o_proj's first 16 MiB are warmed right after in_proj
    warm = graph.node("l4.o_proj.prefetch")
    assert order[order.index(warm) - 1].name == "l4.in_proj"
    assert warm.inputs == ("layers.4.self_attn.o_proj",)
    assert warm.attrs["weight_bytes"] == [budget] and warm.attrs["weight_offsets"] == [0]


# ----------------------------------------------------------------------------- ablation


def test_disabled_pass_leaves_a_valid_graph_that_says_so(tmp_path: Path) -> None:
    on = _compiled("tiny_k3.yaml", [Bin(), Pdl()], _tables(tmp_path))
    off = _compiled("tiny_k3.yaml", [Bin(), Pdl(enabled=False)])
    verify(off)
    assert not [n for n in off if n.op == "prefetch"]
    assert [n for n in on if n.op == "prefetch"]
    assert set(off.meta["pdl"]) == {n.name for n in off}
    assert all(not m["pdl"] and "disabled" in m["reason"] and m["prefetch_bytes"] == 0
               for m in off.meta["pdl"].values())
    assert off.meta["pdl_config"]["enabled"] is False
    assert any(m["pdl"] for m in on.meta["pdl"].values())


def test_rerunning_replaces_forks_and_disabling_removes_them(tmp_path: Path) -> None:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    tables = _tables(tmp_path)
    ctx = CompileContext(spec.model, spec.deployment, {"tactics": tables})
    once = _compiled("tiny_k3.yaml", [Bin(), Pdl()], tables)
    assert [n for n in once if n.op == "prefetch"]
    twice = Pdl().run(once, ctx).graph
    assert [n.name for n in twice] == [n.name for n in once]
    assert twice.meta["pdl"] == once.meta["pdl"]
    off = Pdl(enabled=False).run(once, ctx).graph
    assert not [n for n in off if n.op == "prefetch"]
    assert not [n for n in off.meta["decisions"] if "prefetch" in n]


def test_prefetch_option_off_keeps_the_marks(tmp_path: Path) -> None:
    graph = _compiled("tiny_k3.yaml", [Bin(), Pdl(prefetch=False)], _tables(tmp_path))
    assert not [n for n in graph if n.op == "prefetch"]
    assert any(m["pdl"] for m in graph.meta["pdl"].values())


@pytest.mark.parametrize("name", ["kimi_k3.yaml", "kimi_k3_1.yaml", "tiny_kimi_linear.yaml"])
def test_every_node_has_a_mark_and_a_decision(name: str) -> None:
    graph = _compiled(name, [Bin(), Pdl()])
    assert set(graph.meta["pdl"]) == {n.name for n in graph}
    assert set(graph.meta["decisions"]) == {n.name for n in graph}


def test_pre_wait_inputs_leave_out_what_the_predecessor_writes() -> None:
    """A launch may read before its wait what launches before its predecessor wrote (they
    have completed once the predecessor passed its own wait), never the predecessor's
    output: norm0 -> norm1 -> add(a, a2) may preload ``a`` but not ``a2``."""
    g = _chain_graph()
    g.add_value(Value("s", TensorType(("B", 7168), "bfloat16"), Storage.TEMP))
    nodes = list(g)
    add = Node("add", "add", ("a", "a2"), ("s",))
    g.set_nodes([*nodes[:2], add, *nodes[2:]])
    safe = pre_wait_inputs(g, list(g), {})
    assert safe["add"] == ["a"]
    assert safe["norm1"] == ["n_w"]  # norm0 wrote a, the predecessor's output
    assert safe["norm0"] == ["x", "n_w"]  # a step input and a weight


def test_k3_mixes_preload_their_sources_and_never_a_fresh_output() -> None:
    """On k3-rank-tp8: every input a PDL launch may read before its wait was written by no
    launch, by a main-stream launch before its predecessor, or by a side branch joined at or
    before it; every AttnRes mix after the first layer may preload all its sources (the
    fresh deltas wait)."""
    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    graph, _ = compile_graph(spec, spec.deployment)
    side = graph.meta["streams"]["side"]
    order = [n.name for n in graph]
    main = [n for n in graph if n.name not in side]
    preloading = 0
    for previous, node in pairwise(main):
        mark = graph.meta["pdl"][node.name]
        if not mark["pdl"]:
            continue
        here = order.index(node.name)
        for name in mark["pre_wait_inputs"]:
            writers = [i for i, n in enumerate(graph.nodes[:here])
                       if graph.root(name) in {graph.root(o) for o in (*n.outputs, *n.updates)}]
            if not writers:
                continue
            writer = graph.nodes[writers[-1]]
            assert writer.name != previous.name, (node.name, name)
            if writer.name in side:
                assert order.index(side[writer.name]) <= here, (node.name, name)
        if node.op == "attn_res_norm":
            fresh = {name for name in node.inputs
                     if graph.root(name) in {graph.root(o) for o in previous.outputs}}
            assert fresh and not fresh & set(mark["pre_wait_inputs"]), node.name
            sources = set(node.inputs[:int(node.attrs["sources"])])
            assert sources - fresh <= set(mark["pre_wait_inputs"]), node.name
            preloading += not sources & fresh
    # 24 mixes (layer 0 has no attention mix; the final one): all but layer 0's MLP mix and
    # layer 11's (a new AttnRes block: the o-projection's fresh output is a source there)
    assert preloading == 24 - 2


def test_explain_lists_the_inputs_readable_before_the_wait() -> None:
    """``inspect --explain`` of an AttnRes mix names the sources it loads before its wait
    (and the joined side branch's output), never the predecessor's fresh output."""
    from stepgraph.passes.bin import explain

    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    graph, _ = compile_graph(spec, spec.deployment)
    line = next(ln for ln in explain(graph, "l3.attn_mix").splitlines()
                if "readable before the wait" in ln)
    assert line.split(": ", 1)[1] == "embedded, l2.residual_attn, l2.shared"


def test_a_launch_follows_the_launch_before_it_on_its_own_stream(tmp_path: Path) -> None:
    """With the shared experts on cuBLAS (which never trigger the dependent launch) on the
    side stream, the main-stream launch listed right after each one still uses PDL: its
    predecessor is the main stream's previous launch, not the side node listed before it."""
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    data["ops"]["shared_expert"] = {"providers": ["cublas"]}
    path = tmp_path / "shared-on-cublas.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    graph, _ = compile_graph(spec, spec.deployment, tables_path=path)
    side = graph.meta["streams"]["side"]
    marks = graph.meta["pdl"]
    assert len(side) == 12
    order = list(graph)
    for name in side:
        assert not marks[name]["pdl"], name
        after = order[order.index(graph.node(name)) + 1]
        assert after.name not in side and marks[after.name]["pdl"], (name, after.name)
