"""The reference executor: `stepgraph run`, batch invariance, padding that touches no real
slot, verify steps (q > 1) against single-token steps, and compiled plans against the
frontend's graph."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny tensors: threads only add overhead on a 2-core box

from conftest import MODELS, run_cli  # noqa: E402

from stepgraph.compiler import compile_graph  # noqa: E402
from stepgraph.frontend import build_step  # noqa: E402
from stepgraph.lower.decode import DecodeRunner, run_prompts  # noqa: E402
from stepgraph.lower.weights import random_weights  # noqa: E402
from stepgraph.spec_loader import load_spec, override_deployment  # noqa: E402

SPECS = ("tiny_k3.yaml", "tiny_kimi_linear.yaml")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [200, 100, 50, 25, 12]]


def _graph(spec_name: str, **deployment):
    spec = load_spec(MODELS / spec_name)
    return build_step(spec.model, override_deployment(spec.deployment, **deployment))


def _runner(graph, seed: int = 0, requests: int = 4, tokens: int = 12) -> DecodeRunner:
    weights = random_weights(graph, seed, dtype=torch.float32)
    return DecodeRunner(graph, weights, requests, tokens)


def _close(a: np.ndarray, b: np.ndarray, tol: float = 2e-5) -> bool:
    scale = max(float(np.nanmax(np.abs(b))), 1e-6)
    return bool(np.nanmax(np.abs(a - b)) / scale < tol)


def test_cli_run_tiny_k3_random(tmp_path) -> None:
    out = tmp_path / "l.npy"
    result = run_cli("run", "models/tiny_k3.yaml", "--weights", "random", "--tokens", "1,2,3",
                     "--tokens", "7,8", "--logits-out", str(out))
    assert result.returncode == 0, result.stderr
    logits = np.load(out)
    assert logits.shape == (2, 3, 256) and logits.dtype == np.float32
    assert np.isfinite(logits[0]).all() and np.isfinite(logits[1, :2]).all()
    assert np.isnan(logits[1, 2]).all()


def test_cli_run_errors_are_one_line(tmp_path) -> None:
    out = str(tmp_path / "l.npy")
    for args, needle in (
        (("--weights", "random", "--tokens", "1,999"), "outside the vocabulary"),
        (("--weights", str(tmp_path / "nope"), "--tokens", "1"), "no such checkpoint"),
        (("--weights", "random", "--tokens", "1", "--dtype", "int8"), "--dtype"),
    ):
        result = run_cli("run", "models/tiny_k3.yaml", *args, "--logits-out", out)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


@pytest.mark.parametrize("spec_name", SPECS)
def test_a_request_does_not_depend_on_the_batch(spec_name) -> None:
    """Alone, with other requests, in another row, or padded to a larger bin: same logits."""
    graph = _graph(spec_name)
    alone = run_prompts(_runner(graph), [PROMPTS[0]])[0]
    batched = run_prompts(_runner(graph), PROMPTS)
    reordered = run_prompts(_runner(graph), PROMPTS, order=[2, 1, 0])
    assert _close(batched[0], alone) and _close(reordered[0], alone)
    assert _close(reordered, batched)
    others = run_prompts(_runner(graph), [PROMPTS[0], [5, 5, 5, 5, 5, 5, 5]])
    assert _close(others[0], alone)
    runner = _runner(graph)
    runner.add(0)
    padded = [runner.step([(0, [t])], rows=8)[0][0].numpy() for t in PROMPTS[0]]
    assert _close(np.stack(padded), alone)
    # the test can fail: a different prompt changes the logits
    assert not _close(others[1], alone)


@pytest.mark.parametrize("spec_name", SPECS)
def test_padded_rows_touch_no_real_slot(spec_name) -> None:
    graph = _graph(spec_name)
    runner = _runner(graph, requests=3)
    runner.add(7)
    for token in (3, 4, 5):
        runner.step([(7, [token])], rows=8)
    used_slots = set(runner.requests[7].slots)
    used_blocks = set(runner.requests[7].blocks)
    for name, tensor in runner.caches.items():
        shape = graph.values[name].type.shape
        if shape[0] == "S":
            for slot in range(tensor.shape[0]):
                assert bool(tensor[slot].any()) == (slot in used_slots), (name, slot)
        else:  # paged cache: only the request's first block holds its 3 tokens
            for block in range(tensor.shape[0]):
                written = bool(tensor[block].any())
                assert written == (block == min(used_blocks)), (name, block)


@pytest.mark.parametrize("spec_name", SPECS)
def test_verify_step_equals_single_token_steps(spec_name) -> None:
    """q = 4: two verify steps with every token accepted == eight single-token steps; after
    a partial accept the next step resumes from the accepted prefix."""
    single = _graph(spec_name)
    verify = _graph(spec_name, q=4, batches=(4, 8, 16))
    tokens = [11, 22, 33, 44, 55, 66, 77, 88]
    reference = run_prompts(_runner(single), [tokens])[0]
    runner = _runner(verify)
    runner.add(0)
    runner.add(1)
    first = runner.step([(1, [9, 9, 9, 9]), (0, tokens[:4])])
    second = runner.step([(0, tokens[4:]), (1, [8, 8, 8, 8])])
    got = np.concatenate([first[0].numpy(), second[0].numpy()])
    assert _close(got, reference)

    # accept 2 of 4, then continue with other tokens: equals the single-token path a,b,x,y,..
    runner = _runner(verify)
    runner.add(0)
    runner.step([(0, [11, 22, 33, 44])])
    runner.accept(0, 2)
    after = runner.step([(0, [55, 66, 77, 88])])[0].numpy()
    path = run_prompts(_runner(single), [[11, 22, 55, 66, 77, 88]])[0]
    assert _close(after, path[2:])
    wrong = run_prompts(_runner(single), [[11, 22, 33, 44, 55, 66, 77, 88]])[0]
    assert not _close(after, wrong[4:])


@pytest.mark.parametrize("spec_name", SPECS)
def test_compiled_plan_matches_frontend_graph(spec_name) -> None:
    """The pipeline's plan at a world of one (packed weights, views, prefetches) computes the
    frontend graph's logits."""
    spec = load_spec(MODELS / spec_name)
    compiled, _ = compile_graph(spec, spec.deployment)
    assert any(v.view is not None for v in compiled.values.values())
    frontend = run_prompts(_runner(_graph(spec_name)), PROMPTS)
    planned = run_prompts(_runner(compiled), PROMPTS)
    assert _close(planned, frontend)


def test_bfloat16_run_tracks_float32() -> None:
    graph = _graph("tiny_k3.yaml")
    weights = random_weights(graph, 0, dtype=torch.bfloat16)
    low = run_prompts(DecodeRunner(graph, weights, 2, 8, dtype="bfloat16"), [[1, 2, 3]])
    high = run_prompts(_runner(graph), [[1, 2, 3]])
    assert np.isfinite(low).all()
    assert np.abs(low - high).max() / np.abs(high).max() < 0.1
