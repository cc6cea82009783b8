"""The Chrome/Perfetto trace of one bin: valid JSON, one slice per launch, PDL edges as flows,
prefetch forks on their own track, durations estimated from bytes and the tables' bandwidth."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from stepgraph.errors import UserError
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.passes.bin import Bin
from stepgraph.passes.manager import CompileContext, run_pipeline
from stepgraph.passes.pdl import Pdl
from stepgraph.spec_loader import load_spec
from stepgraph.tactics import load_tables
from stepgraph.trace import chrome_trace, trace_json
from tests.conftest import MODELS, fork_tables


def _graph(name: str, pdl: bool = True, tables: Path | None = None) -> Graph:
    spec = load_spec(MODELS / name)
    data = {"tactics": load_tables("h200", tables)} if tables else {}
    ctx = CompileContext(spec.model, spec.deployment, data)
    graph, _ = run_pipeline(build_step(spec.model, spec.deployment), [Bin(), Pdl(enabled=pdl)],
                            ctx)
    return graph


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Graph:
    return _graph("tiny_k3.yaml", tables=fork_tables(tmp_path_factory.mktemp("tables")))


def _slices(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_trace_is_json_with_one_slice_per_launch(tiny: Graph) -> None:
    trace = json.loads(trace_json(tiny, 4))
    slices = _slices(trace)
    assert [s["name"] for s in slices] == [n.name for n in tiny]
    prefetches = {n.name for n in tiny if n.op == "prefetch"}
    assert prefetches
    for s in slices:
        assert s["tid"] == (2 if s["name"] in prefetches else 1)
        assert s["dur"] > 0 and "ESTIMATE" in s["args"]["duration"]


def test_main_track_runs_in_program_order_without_overlap(tiny: Graph) -> None:
    main = [s for s in _slices(chrome_trace(tiny, 8)) if s["tid"] == 1]
    for before, after in itertools.pairwise(main):
        assert after["ts"] >= before["ts"] + before["dur"] - 1e-3


def test_pdl_edges_and_forks_are_flow_events(tiny: Graph) -> None:
    trace = chrome_trace(tiny, 2)
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    finishes = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert starts.keys() == finishes.keys()
    pdl_launches = [n for n in tiny if tiny.meta["pdl"][n.name]["pdl"]
                    and "2" not in tiny.meta["pdl"][n.name].get("off_bins", {})]
    assert sum(1 for e in starts.values() if e["cat"] == "pdl") == len(pdl_launches) > 0
    forks = sum(1 for n in tiny if n.op == "prefetch")
    assert sum(1 for e in starts.values() if e["cat"] == "fork") == forks
    assert all(finishes[i]["tid"] == 2 for i, e in starts.items() if e["cat"] == "fork")


def test_without_pdl_every_launch_waits_the_launch_gap() -> None:
    off = _graph("tiny_k3.yaml", pdl=False)
    trace = chrome_trace(off, 1)
    assert not [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    main = _slices(trace)
    gaps = {round(b["ts"] - (a["ts"] + a["dur"]), 3) for a, b in itertools.pairwise(main)}
    assert gaps == {1.5}  # the h200 tables' assumed launch_gap_us


def test_lm_head_duration_is_its_bytes_over_the_assumed_hbm_bandwidth() -> None:
    graph = _graph("kimi_k3.yaml")
    head = next(s for s in _slices(chrome_trace(graph, 1)) if s["name"] == "lm_head")
    # weight 163840 x 7168 bf16, input 1 x 7168 bf16, logits 1 x 163840 fp32
    moved = 163840 * 7168 * 2 + 7168 * 2 + 163840 * 4
    assert head["args"]["bytes"] == moved
    assert head["dur"] == pytest.approx(moved / 4.8e12 * 1e6, abs=1e-3)  # ~489.3 us


def test_unknown_bin_is_a_user_error(tiny: Graph) -> None:
    with pytest.raises(UserError, match="bin 3 is not compiled; the bins are 1, 2, 4, 8"):
        chrome_trace(tiny, 3)


def test_routed_experts_count_the_experts_a_uniform_routing_touches() -> None:
    graph = _graph("kimi_k3.yaml")
    per_expert = (6144 * 3584 + 3584 * 3072) * 2  # gate_up 6144 x 3584 + down 3584 x 3072, bf16
    activations = 3584 * 2 + 16 * 4 + 16 * 4 + 3584 * 2  # latent in, ids, weights, out
    for rows, touched in ((1, 16), (64, 896 * (1 - (1 - 16 / 896) ** 64))):
        # one row picks exactly top_k = 16 distinct experts; 64 rows miss each with
        # probability (1 - 16/896) ** 64, so ~613 of 896 are touched
        routed = next(s for s in _slices(chrome_trace(graph, rows))
                      if s["name"] == "l4.routed_experts")
        moved = per_expert * touched + activations * rows
        assert routed["args"]["bytes"] == pytest.approx(moved, rel=1e-6), rows
    # the formula against routing drawn at random: 64 rows, each 16 distinct experts of 896
    draws = random.Random(0)
    mean = sum(len({e for _ in range(64) for e in draws.sample(range(896), 16)})
               for _ in range(300)) / 300
    assert mean == pytest.approx(896 * (1 - (1 - 16 / 896) ** 64), rel=0.01)


def test_embed_reads_the_rows_of_its_tokens_not_the_table() -> None:
    graph = _graph("kimi_k3.yaml")
    embed = next(s for s in _slices(chrome_trace(graph, 4)) if s["name"] == "embed")
    # 4 table rows of 7168 bf16, 4 int32 token ids in (or int64), 4 x 7168 bf16 out
    low, high = 2 * 4 * 7168 * 2 + 4 * 4, 2 * 4 * 7168 * 2 + 4 * 8
    assert low <= embed["args"]["bytes"] <= high
    assert embed["dur"] < 5.0  # the table is 163840 x 7168 bf16: ~489 us if read whole
