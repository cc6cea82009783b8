"""The streams pass: side-stream nodes move to their earliest position, join before their
first reader, and the arena keeps their bytes through the window (CPU, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MODELS

from stepgraph.compiler import compile_graph
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage
from stepgraph.passes.pipeline import CompileOptions
from stepgraph.spec_loader import load_spec, override_deployment
from stepgraph.tactics import TABLES_DIR


def _compiled(name: str, target: str = "h200", **options: bool) -> Graph:
    spec = load_spec(MODELS / name)
    deployment = override_deployment(spec.deployment, target=target)
    graph, _ = compile_graph(spec, deployment, CompileOptions(**options))
    return graph


def _roots(graph: Graph, names: tuple[str, ...]) -> set[str]:
    return {graph.root(n) for n in names if graph.values[graph.root(n)].storage is Storage.TEMP}


def test_shared_experts_fork_after_their_input_and_join_before_their_reader() -> None:
    """k3-rank-tp8 on the H200: every shared expert runs on the side stream, right after the
    node writing its input, and joins before the first node reading its output (the next
    layer's AttnRes step; the H200 table hands it over there by a flag, ``signal``, so
    ``join_lead`` is 0); nothing between the fork and that reader reads the output."""
    graph = _compiled("k3_rank_tp8.yaml")
    side = graph.meta["streams"]["side"]
    lead = graph.meta["streams"]["join_lead"]
    assert graph.meta["streams"]["signal"] is True and lead == 0
    shared = [n.name for n in graph if n.op == "shared_expert"]
    assert sorted(side) == sorted(shared) and len(shared) == 12
    order = [n.name for n in graph]
    for name, join in side.items():
        node = graph.node(name)
        at = order.index(name)
        before = graph.nodes[at - 1]
        assert _roots(graph, node.inputs) & _roots(graph, before.outputs), name
        assert join is not None
        outputs = _roots(graph, node.outputs)
        reader = next(i for i in range(at + 1, len(order))
                      if outputs & _roots(graph, graph.nodes[i].inputs))
        main = [i for i in range(at + 1, reader + 1) if order[i] not in side]
        assert order.index(join) == main[-1 - lead], (name, join)
        assert graph.node(join).op == "attn_res_norm"  # the reader itself
        for between in graph.nodes[at + 1:reader]:
            assert not outputs & _roots(graph, between.inputs), (name, between.name)
        # the branch overlaps the routed path: the router runs between fork and join
        assert any(n.op == "router" for n in graph.nodes[at + 1:order.index(join)])


def test_join_lead_zero_joins_at_the_reader(tmp_path: Path) -> None:
    """A table with ``join_lead: 0`` joins each branch right before its first reader, and a
    lead longer than the window stops at the launch right after the branch."""
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    data["streams"]["signal"] = False  # the lead applies to graph joins
    for lead, expect in ((0, "attn_res_norm"), (99, "projection")):
        data["streams"]["join_lead"] = lead
        path = tmp_path / f"lead{lead}.yaml"
        path.write_text(yaml.safe_dump(data))
        spec = load_spec(MODELS / "k3_rank_tp8.yaml")
        deployment = override_deployment(spec.deployment, target="h200")
        graph, _ = compile_graph(spec, deployment, tables_path=path)
        side = graph.meta["streams"]["side"]
        order = [n.name for n in graph]
        for name, join in side.items():
            if join is None:
                continue
            assert graph.node(join).op == expect, (lead, name, join)
            if lead:
                assert order.index(join) == order.index(name) + 1


def test_no_streams_keeps_program_order() -> None:
    """--no-streams (and a target whose tables list no side op) leaves one stream: no side
    node, and the shared expert where the frontend put it (after the routed experts)."""
    for graph in (_compiled("k3_rank_tp8.yaml", streams=False),
                  _compiled("k3_rank_tp8.yaml", target="cpu")):
        assert graph.meta["streams"]["side"] == {}
        order = [n.op for n in graph if n.layer == 1]
        assert order.index("shared_expert") > order.index("routed_experts")


def test_root_fork_only_where_a_table_asks_and_branches_exist(tmp_path: Path) -> None:
    """The H200 table's ``root_fork`` marks a graph with side branches; the same table with
    the key off, --no-streams (no branch) and a target without side ops do not."""
    assert _compiled("k3_rank_tp8.yaml").meta["streams"]["root_fork"] is True
    assert _compiled("k3_rank_tp8.yaml", streams=False).meta["streams"]["root_fork"] is False
    assert _compiled("k3_rank_tp8.yaml", target="cpu").meta["streams"]["root_fork"] is False
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    data["streams"]["root_fork"] = False
    path = tmp_path / "no_root.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    graph, _ = compile_graph(spec, deployment, tables_path=path)
    assert graph.meta["streams"]["side"] and graph.meta["streams"]["root_fork"] is False


def test_no_root_fork_in_a_graph_with_a_collective() -> None:
    """The root fork's window is the whole step: k3-rank-tp8's graph with one all_reduce
    appended after its last node (outside every branch's window, so the branches stay on
    the side stream) gets no root fork."""
    from stepgraph.ir.nodes import Node
    from stepgraph.ir.values import Value
    from stepgraph.passes.manager import CompileContext
    from stepgraph.passes.streams import Streams

    graph = _compiled("k3_rank_tp8.yaml")
    last = graph.nodes[-1]
    out = graph.values[last.outputs[0]]
    graph.add_value(Value("reduced", out.type, Storage.TEMP))
    graph.add_node(Node("reduce", "all_reduce", (out.name,), ("reduced",),
                        {"group": "tp", "ways": 2}))
    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    result = Streams().run(graph, CompileContext(spec.model, deployment))
    assert result.graph.meta["streams"]["side"]
    assert result.graph.meta["streams"]["root_fork"] is False


def test_the_arena_keeps_side_branch_bytes_through_the_window() -> None:
    """In every bin's plan, no temp written by a main-stream node between a side node's fork
    and its join shares a byte with a temp the side node reads or writes (checked here from
    the offsets and sizes the plan wrote, not from the planner's lifetimes)."""
    graph = _compiled("k3_rank_tp8.yaml")
    side = graph.meta["streams"]["side"]
    order = [n.name for n in graph]
    memory = graph.meta["memory"]
    for entry in memory["bins"].values():
        offsets, sizes = entry["offsets"], entry["sizes"]

        def span(name: str, offsets=offsets, sizes=sizes) -> range:
            return range(offsets[name], offsets[name] + sizes[name])

        for name, join in side.items():
            node = graph.node(name)
            held = _roots(graph, (*node.inputs, *node.outputs))
            window = graph.nodes[order.index(name) + 1:order.index(join)]
            for other in window:
                for temp in _roots(graph, other.outputs) - held:
                    for mine in held:
                        a, b = span(temp), span(mine)
                        assert a.stop <= b.start or b.stop <= a.start, (name, other.name, temp)


def test_side_ops_must_be_compute_ops(tmp_path: Path) -> None:
    """A table listing a collective (or an unknown op) as a side op is refused."""
    text = (TABLES_DIR / "h200.yaml").read_text()
    bad = tmp_path / "collective.yaml"
    bad.write_text(text.replace("side_ops: [shared_expert]", "side_ops: [all_reduce]"))
    spec = load_spec(MODELS / "tiny_k3.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    with pytest.raises(UserError, match=r"all_reduce.*not a compute op"):
        compile_graph(spec, deployment, tables_path=bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(text.replace("side_ops: [shared_expert]", "side_ops: [warp_drive]"))
    with pytest.raises(UserError, match="unknown op 'warp_drive'"):
        compile_graph(spec, deployment, tables_path=unknown)


def test_trace_puts_branches_on_the_side_track_and_joins_after_them() -> None:
    """`inspect --trace`: each shared expert is a slice on the side track, and the node it
    joins before starts no earlier than that slice ends."""
    from stepgraph.trace import MAIN_TID, PREFETCH_TID, chrome_trace

    graph = _compiled("k3_rank_tp8.yaml")
    slices = {e["name"]: e for e in chrome_trace(graph, 1)["traceEvents"] if e["ph"] == "X"}
    for name, join in graph.meta["streams"]["side"].items():
        branch, joined = slices[name], slices[join]
        assert branch["tid"] == PREFETCH_TID and joined["tid"] == MAIN_TID
        assert joined["ts"] >= branch["ts"] + branch["dur"] - 1e-3


def test_a_branch_beside_a_collective_stays_on_the_main_stream() -> None:
    """k3_tp2: each shared expert's window would hold the MoE's all_gather and
    reduce_scatter; NCCL beside a side stream is not verified, so the branch stays where the
    frontend put it, on the main stream, and the summary says why."""
    spec = load_spec(MODELS / "k3_tp2.yaml")
    graph, reports = compile_graph(spec, spec.deployment)
    assert graph.meta["streams"]["side"] == {}
    layer = [n.op for n in graph if n.layer == 0]
    assert layer.index("shared_expert") > layer.index("routed_experts")
    summary = next(r.summary for r in reports if r.name == "streams")
    assert "kept on the main stream (a collective in their window)" in summary


def test_inspect_shows_the_side_branches(tmp_path: Path) -> None:
    """`stepgraph inspect`: a `streams` line in the summary and a `streams` key in the JSON
    (side node -> the node it joins before; the count per op)."""
    artifact = tmp_path / "rank.sgart"
    run = [sys.executable, "-m", "stepgraph"]
    subprocess.run([*run, "compile", str(MODELS / "k3_rank_tp8.yaml"), "-o", str(artifact)],
                   check=True, capture_output=True)
    text = subprocess.run([*run, "inspect", str(artifact), "--summary"], check=True,
                          capture_output=True, text=True).stdout
    assert "streams    12 launches on a side stream (12 shared_expert)" in text
    assert "an empty launch forked there at the root" in text
    data = json.loads(subprocess.run([*run, "inspect", str(artifact), "--summary", "--format",
                                      "json"], check=True, capture_output=True,
                                     text=True).stdout)
    graph = _compiled("k3_rank_tp8.yaml")
    assert data["streams"]["side"] == graph.meta["streams"]["side"]
    assert data["streams"]["side_ops"] == {"shared_expert": 12}
    assert data["streams"]["root_fork"] is True


def test_explain_says_where_a_node_runs() -> None:
    """`inspect --explain`: a side node names the main-stream node it forks after and the
    node it joins before (the streams pass's meta), the join's carrier names the branch it
    waits for, and a node of neither kind has no stream line."""
    from stepgraph.passes.bin import explain

    graph = _compiled("k3_rank_tp8.yaml")
    side = graph.meta["streams"]["side"]
    order = [n.name for n in graph]
    name, join = next(iter(side.items()))
    before = order[order.index(name) - 1]
    assert before not in side
    assert f"stream: side (forked after {before}, joined before {join})" in explain(graph, name)
    assert f"stream: main; waits here for the side branch of {name}" in explain(graph, join)
    plain = next(n.name for n in graph if n.op == "kda_core")
    assert "stream:" not in explain(graph, plain)


def test_signal_joins_each_branch_at_its_reader(tmp_path: Path) -> None:
    """A table with ``streams.signal`` joins every branch right before its first reader (the
    next layer's AttnRes step, ``join_lead`` unused) and marks the graph for the runtime's
    flag hand-over; the table without it keeps the lead and no signal."""
    data = yaml.safe_load((TABLES_DIR / "h200.yaml").read_text())
    spec = load_spec(MODELS / "k3_rank_tp8.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    graphs = {}
    for signal in (True, False):
        data["streams"]["signal"] = signal
        data["streams"]["join_lead"] = 1
        path = tmp_path / f"signal{int(signal)}.yaml"
        path.write_text(yaml.safe_dump(data))
        graphs[signal], _ = compile_graph(spec, deployment, tables_path=path)
    on, off = graphs[True].meta["streams"], graphs[False].meta["streams"]
    assert on["signal"] is True and on["join_lead"] == 0
    assert off["signal"] is False and off["join_lead"] == 1
    assert sorted(on["side"]) == sorted(off["side"]) and len(on["side"]) == 12
    graph = graphs[True]
    for name, join in on["side"].items():
        assert graph.node(join).op == "attn_res_norm", (name, join)
        assert _roots(graph, graph.node(name).outputs) & _roots(graph, graph.node(join).inputs)
        assert graphs[False].node(off["side"][name]).op == "projection"  # routed_up
