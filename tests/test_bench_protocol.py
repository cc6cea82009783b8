"""The benchmark protocol's torch pieces on the CPU: input sets, the relative error, random
caches and weights, touched experts, imposed routing and the float32 reference over BF16
weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import stepgraph.bench.protocol as protocol
import stepgraph.bench.weights as bench_weights
from stepgraph.bench.protocol import (
    Routing,
    build_feeds,
    clone_caches,
    device_feed,
    fill_caches,
    fp32_reference,
    next_feed,
    relative_error,
    time_calls,
    touched_experts,
)
from stepgraph.compiler import compile_graph
from stepgraph.ir.graph import Graph
from stepgraph.ir.types import Storage
from stepgraph.lower.caches import allocate_caches
from stepgraph.lower.reference import REFERENCE_OPS, ReferenceExecutor
from stepgraph.lower.weights import random_weights
from stepgraph.spec_loader import load_spec
from tests.conftest import MODELS

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny() -> Graph:
    graph, _ = compile_graph(load_spec(MODELS / "tiny_k3.yaml"))
    return graph


def test_input_sets_touch_disjoint_slots_and_blocks() -> None:
    feeds = build_feeds(rows=4, q=1, sets=3, context=100, block_size=16, width=8, vocab=50,
                        seed=1)
    slots = [set(f["kda_state_indices"].tolist()) for f in feeds]
    blocks = [set(f["block_tables"].reshape(-1).tolist()) for f in feeds]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not slots[a] & slots[b] and not blocks[a] & blocks[b]
    feed = feeds[1]  # requests 4..7: slots 4..7, request r owns blocks 8r..8r+7
    assert feed["kda_state_indices"].tolist() == [4, 5, 6, 7]
    assert feed["block_tables"][0].tolist() == list(range(32, 40))
    assert feed["seq_lens"].tolist() == [100] * 4
    assert feed["positions"].tolist() == [99] * 4
    # token 99 of request 4 sits in its block 99 // 16 = 6 (block 38), offset 3
    assert feed["slot_mapping"][0] == 38 * 16 + 3
    assert ((feed["tokens"] >= 0) & (feed["tokens"] < 50)).all()
    assert not np.array_equal(feeds[0]["tokens"], feeds[1]["tokens"])
    later = next_feed(feed, q=1, block_size=16, seed=3)
    assert later["positions"].tolist() == [100] * 4 and later["seq_lens"].tolist() == [101] * 4
    assert later["slot_mapping"][0] == 38 * 16 + 4
    assert later["kda_state_indices"].tolist() == [4, 5, 6, 7]
    with pytest.raises(Exception, match="exceeds"):
        build_feeds(rows=1, q=1, sets=1, context=200, block_size=16, width=8, vocab=5, seed=0)


def test_verify_rows_group_by_request() -> None:
    (feed,) = build_feeds(rows=4, q=2, sets=1, context=10, block_size=4, width=4, vocab=9,
                          seed=0)
    assert feed["kda_state_indices"].tolist() == [0, 1, 2, 3]
    assert feed["positions"].tolist() == [8, 9, 8, 9]
    assert feed["seq_lens"].tolist() == [9, 10, 9, 10]
    assert feed["num_accepted_tokens"].tolist() == [2, 2, 2, 2]
    assert feed["block_tables"][2].tolist() == [4, 5, 6, 7]


def test_relative_error() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) == math.inf
    assert math.isnan(relative_error(torch.tensor([math.nan, 0.0]), ref))
    with pytest.raises(ValueError):
        relative_error(torch.ones(3), ref)


def test_random_caches_are_seeded_and_scaled(tiny: Graph) -> None:
    caches = allocate_caches(tiny, 9, 9, 16, CPU, torch.bfloat16)
    fill_caches(caches, seed=5)
    again = allocate_caches(tiny, 9, 9, 16, CPU, torch.bfloat16)
    fill_caches(again, seed=5)
    for name, tensor in caches.items():
        assert torch.equal(tensor, again[name])
        assert tensor.float().abs().sum() > 0, name
        std = tensor.float().std().item()
        expected = 0.1 if name.endswith("recurrent_state") else 1.0
        assert std == pytest.approx(expected, rel=0.1), name
    copy = clone_caches(caches)
    name = next(iter(copy))
    copy[name].zero_()
    assert caches[name].abs().sum() > 0


def test_device_weights_match_the_graph_and_random_weights(tiny: Graph, monkeypatch) -> None:
    monkeypatch.setattr(bench_weights, "HOST_LIMIT", 4096)  # draw the bigger ones "on device"
    weights = bench_weights.device_random_weights(tiny, seed=3, device=CPU)
    reference = random_weights(tiny, seed=3, dtype=torch.bfloat16)
    drawn = 0
    for value in tiny.values_of(Storage.WEIGHT):
        tensor = weights[value.name]
        assert tensor.shape == reference[value.name].shape and \
            tensor.dtype == reference[value.name].dtype, value.name
        if tensor.numel() <= 4096:
            assert torch.equal(tensor, reference[value.name]), value.name
            continue
        drawn += 1
        for segment in value.segments:  # padding rows stay zero, real rows are random
            rows = tensor[segment.offset : segment.offset + segment.rows].float()
            if segment.source is None:
                assert rows.abs().sum() == 0, (value.name, segment.name)
            else:
                scale = 1.0 if segment.source == "embed_tokens" else tensor.shape[-1] ** -0.5
                assert rows.std().item() == pytest.approx(scale, rel=0.15), value.name
    assert drawn >= 5
    again = bench_weights.device_random_weights(tiny, seed=3, device=CPU)
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    other = bench_weights.device_random_weights(tiny, seed=4, device=CPU)
    assert not torch.equal(weights["lm_head"], other["lm_head"])


def test_touched_experts_count_distinct_local_ids(tiny: Graph) -> None:
    nodes = [n for n in tiny if n.op == "routed_experts"]
    values = {n.inputs[1]: torch.tensor([[0, 1], [1, 3], [7, 7]], dtype=torch.int32)
              for n in nodes}
    assert touched_experts(tiny, values, rows=3) == {n.name: 4 for n in nodes}
    assert touched_experts(tiny, values, rows=1) == {n.name: 2 for n in nodes}


def _setup(tiny: Graph, rows: int):
    weights = random_weights(tiny, seed=0, dtype=torch.bfloat16)
    caches = allocate_caches(tiny, 8, 8, 16, CPU, torch.bfloat16)
    fill_caches(caches, seed=1)
    (feed,) = build_feeds(rows, 1, 1, context=20, block_size=16, width=2, vocab=256, seed=2)
    return weights, caches, device_feed(tiny, feed, CPU)


def test_fp32_reference_keeps_big_weights_and_computes_in_fp32(tiny: Graph,
                                                                monkeypatch) -> None:
    monkeypatch.setattr(protocol, "UPCAST_LIMIT", 1000)
    weights, caches, feed = _setup(tiny, rows=2)
    mine = fp32_reference(tiny, weights, clone_caches(caches), CPU)
    kept = [name for name, w in weights.items() if w.numel() > 1000]
    assert kept and all(mine.fixed[n].data_ptr() == weights[n].data_ptr() for n in kept)
    assert all(mine.fixed[n].dtype == torch.float32 for n in weights if n not in kept
               and weights[n].is_floating_point())
    upcast = {k: v.float() for k, v in weights.items()}
    plain = ReferenceExecutor(tiny, upcast, clone_caches(caches), CPU, "float32")
    out = mine.step(feed)["logits"]
    expected = plain.step(feed)["logits"]
    assert relative_error(out, expected) < 1e-6


def test_imposed_routing_is_used_counted_and_undone(tiny: Graph) -> None:
    weights, caches, feed = _setup(tiny, rows=2)
    free = fp32_reference(tiny, weights, clone_caches(caches), CPU)
    free.step(feed, keep_values=True)
    routers = [n for n in tiny if n.op == "router"]
    own = {n.name: free.last_values[n.outputs[0]].clone() for n in routers}
    first = routers[0]
    forced = dict(own)
    flipped = own[first.name].clone()
    flipped[0] = torch.tensor([e for e in range(8) if e not in flipped[0].tolist()][:2])
    forced[first.name] = flipped
    routing = Routing(forced)
    original = REFERENCE_OPS["router"]
    imposed = fp32_reference(tiny, weights, clone_caches(caches), CPU)
    bystander = fp32_reference(tiny, weights, clone_caches(caches), CPU)
    with routing.forced(imposed):
        imposed.step(feed, keep_values=True)
        bystander.step(feed, keep_values=True)
    assert REFERENCE_OPS["router"] is original and imposed.ops["router"] is original
    # only the executor given is forced: another one keeps its own choice
    assert torch.equal(bystander.last_values[first.outputs[0]].long(), own[first.name].long())
    assert torch.equal(imposed.last_values[first.outputs[0]].long(), flipped.long())
    assert routing.decisions == 2 * len(routers)
    # the first router would have chosen row 0's own experts: one flip there; later layers
    # may flip too (their inputs changed), never more than the rows they route
    assert routing.flips_by_node[first.name] == 1
    assert routing.flips == sum(routing.flips_by_node.values()) >= 1
    probs = imposed.last_values[first.outputs[1]]
    assert torch.allclose(probs.sum(-1), torch.ones(2), atol=1e-5)  # renormalized
    with pytest.raises(RuntimeError), Routing(own).forced(imposed):
        raise RuntimeError("inside")
    assert imposed.ops["router"] is original


def test_time_calls_on_the_cpu() -> None:
    calls = []
    times = time_calls(calls.append, ["a", "b"], replays=5, warmup=2, device=CPU)
    assert len(times) == 5 and all(t >= 0 for t in times)
    assert calls == ["a", "b", "a", "b", "a", "b", "a"]


def test_decode_loop_feeds_each_step_the_last_steps_argmax(tiny: Graph) -> None:
    """The bench's decode-loop call: a step's tokens are the argmax of the logits of the
    step before (the second call's logits are those of a step on those tokens, from the
    same caches), not the tokens the one fill wrote."""
    from stepgraph.bench.protocol import decode_loop_call
    from stepgraph.runtime import StepInputs, load

    step = load(tiny, weights="random", device="cpu", dtype="float32", block_size=16,
                max_context=64, progress=False, allow_target_mismatch=True)
    fill_caches(step.caches, seed=1)
    (feed,) = build_feeds(3, 1, 1, context=20, block_size=16, width=2, vocab=256, seed=2)
    inputs = StepInputs.from_feed(feed)
    call = decode_loop_call(step, inputs)
    logits = step.bindings.outputs["logits"][:3]
    call(None)
    first = logits.clone()
    tokens = first.argmax(-1)
    assert not torch.equal(tokens.int(), torch.as_tensor(inputs.tokens).int())
    before = {name: cache.clone() for name, cache in step.caches.items()}
    call(None)
    looped = logits.clone()
    results = {}
    for name, given in (("argmax", tokens.tolist()), ("filled", list(inputs.tokens))):
        for cache_name, cache in step.caches.items():
            cache.copy_(before[cache_name])
        results[name] = step.step(StepInputs.from_feed({**feed, "tokens": np.array(
            given, np.int32)})).clone()
    assert torch.equal(looped, results["argmax"])
    assert not torch.equal(looped, results["filled"])
