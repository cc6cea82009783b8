"""The floor's byte accounting (stepgraph.bench.floor), against hand-computed figures: tiny
graphs built by hand, and launches of tiny_k3 whose bytes follow from the spec's sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stepgraph.bench.floor import (
    CATEGORIES,
    StepBytes,
    floor_us,
    format_bytes,
    step_bytes,
    touched_upper_bound,
)
from stepgraph.compiler import compile_graph
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Value
from stepgraph.spec_loader import load_spec
from tests.conftest import MODELS, ROOT, fork_tables


def _graph(*values: Value, nodes: tuple[Node, ...]) -> Graph:
    graph = Graph("hand")
    for value in values:
        graph.add_value(value)
    for node in nodes:
        graph.add_node(node)
    return graph


def _v(name: str, shape: tuple, dtype: str, storage: Storage) -> Value:
    return Value(name, TensorType(shape, dtype), storage)


def projection_graph(n: int, k: int) -> Graph:
    return _graph(
        _v("x", ("B", k), "bfloat16", Storage.INPUT),
        _v("w", (n, k), "bfloat16", Storage.WEIGHT),
        _v("y", ("B", n), "bfloat16", Storage.OUTPUT),
        nodes=(Node("proj", "projection", ("x", "w"), ("y",)),),
    )


def experts_graph(experts: int, width: int, inner: int, top_k: int) -> Graph:
    return _graph(
        _v("x", ("B", width), "float32", Storage.INPUT),
        _v("ids", ("B", top_k), "int32", Storage.INPUT),
        _v("p", ("B", top_k), "float32", Storage.INPUT),
        _v("gate_up", (experts, 2 * inner, width), "bfloat16", Storage.WEIGHT),
        _v("down", (experts, width, inner), "bfloat16", Storage.WEIGHT),
        _v("out", ("B", width), "bfloat16", Storage.OUTPUT),
        nodes=(Node("moe", "routed_experts", ("x", "ids", "p", "gate_up", "down"), ("out",),
                    attrs={"local_experts": experts, "top_k": top_k, "expert_offset": 0,
                           "experts": experts, "width": inner}),),
    )


def test_projection_reads_its_weight_once_and_its_rows() -> None:
    # N x K bf16 weight: 2NK bytes; x [4, K] and y [4, N] bf16: 2*4*K + 2*4*N
    result = step_bytes(projection_graph(96, 64), rows=4, context=1)
    (launch,) = result.launches
    assert launch.weights == 2 * 96 * 64 == 12288
    assert launch.activations == 2 * 4 * 64 + 2 * 4 * 96 == 1280
    assert launch.experts == launch.cache == 0
    assert result.total == 13568
    assert result.by_category() == {"weights": 12288, "experts": 0, "cache": 0,
                                    "activations": 1280}


def test_weight_bytes_do_not_grow_with_rows() -> None:
    one = step_bytes(projection_graph(1000, 512), rows=1, context=1).by_category()["weights"]
    many = step_bytes(projection_graph(1000, 512), rows=64, context=1).by_category()["weights"]
    assert one == many == 1_024_000


def test_routed_experts_count_only_touched_experts() -> None:
    graph = experts_graph(experts=8, width=32, inner=48, top_k=2)
    per_expert = 2 * 48 * 32 * 2 + 32 * 48 * 2  # gate|up + down, bf16: 9216 bytes
    measured = step_bytes(graph, rows=4, context=1, touched={"moe": 3})
    assert measured.launches[0].experts == 3 * per_expert == 27648
    assert measured.exact_experts
    # x f32 [4,32] + ids i32 [4,2] + p f32 [4,2] + out bf16 [4,32]
    assert measured.launches[0].activations == 512 + 32 + 32 + 256
    bound = step_bytes(graph, rows=4, context=1)  # min(8 experts, 4 rows x 2) = 8
    assert bound.launches[0].experts == 8 * per_expert
    assert not bound.exact_experts
    small = step_bytes(graph, rows=1, context=1)  # min(8, 1 x 2) = 2
    assert small.launches[0].experts == 2 * per_expert
    assert touched_upper_bound(graph, graph.node("moe"), 3) == 6


def test_floor_us_is_bytes_over_bandwidth() -> None:
    assert floor_us(4_200_000, 4.2e12) == pytest.approx(1.0)
    result = StepBytes(rows=1, context=1, launches=(), exact_experts=True)
    assert result.floor_us(1e12) == 0.0
    with pytest.raises(ValueError):
        floor_us(1, 0.0)
    assert format_bytes(1.5e9) == "1.50 GB"
    assert format_bytes(999) == "999 B"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Graph:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    tables = fork_tables(tmp_path_factory.mktemp("tables"))  # with prefetch forks to count
    graph, _ = compile_graph(spec, spec.deployment, tables_path=tables)
    return graph


def _launch(result: StepBytes, name: str):
    return next(launch for launch in result.launches if launch.node == name)


def test_tiny_kda_states_read_and_written_once_per_row(tiny: Graph) -> None:
    # tiny_k3: 4 KDA heads of 16: recurrent state f32 4*16*16*4 = 4096 B a slot; conv states
    # bf16 (64 channels x 3 taps x 2 B) = 384 B a slot, for q, k and v
    per_slot = 4096 + 3 * 384
    result = step_bytes(tiny, rows=2, context=10)
    assert _launch(result, "l1.kda_core").cache == 2 * 2 * per_slot == 20992


def test_tiny_mla_reads_the_context_and_writes_one_token(tiny: Graph) -> None:
    # latent cache entries: kv_lora 32 + rope 8 = 40 bf16 = 80 B a token
    result = step_bytes(tiny, rows=2, context=100)
    assert _launch(result, "l3.core").cache == 2 * 100 * 80 + 2 * 80 == 16160


def test_tiny_mla_reads_half_of_kv_b_in_each_launch(tiny: Graph) -> None:
    # kv_b [4 heads x (16 nope + 16 v), 32] bf16 = 8192 B: W_UK is half, W_UV the other half
    result = step_bytes(tiny, rows=1, context=10)
    query = _launch(result, "l3.mla_query")
    assert query.weights == 32 * 2 + 4 * 24 * 32 * 2 + 8192 // 2  # q_a norm, q_b, W_UK
    assert _launch(result, "l3.mla_value").weights == 8192 // 2


def test_tiny_embedding_reads_only_the_token_rows(tiny: Graph) -> None:
    result = step_bytes(tiny, rows=3, context=10)
    assert _launch(result, "embed").weights == 3 * 64 * 2


def test_tiny_prefetch_counts_nothing_and_totals_add_up(tiny: Graph) -> None:
    result = step_bytes(tiny, rows=2, context=10)
    prefetches = [launch for launch in result.launches if launch.op == "prefetch"]
    assert prefetches and all(launch.total == 0 for launch in prefetches)
    assert sum(result.by_category().values()) == result.total
    assert set(result.by_category()) == set(CATEGORIES)


def test_floor_module_never_imports_torch() -> None:
    code = ("import sys\nimport stepgraph.bench.floor, stepgraph.bench.table, "
            "stepgraph.bench.workloads, stepgraph.bench.options, stepgraph.commands.bench\n"
            "assert 'torch' not in sys.modules\nprint('OK')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
