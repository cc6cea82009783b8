"""The memory check before a load or a benchmark: what a step holds, counted from its graph
against what the runtime allocates, and the one-line refusal on a GPU too small for it (the
CUDA queries patched in on a CPU machine; a GPU test runs the refusal inside ``load``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import MODELS, run_cli  # noqa: E402

from stepgraph.artifact import load_artifact  # noqa: E402
from stepgraph.bench import session  # noqa: E402
from stepgraph.bench.options import BenchOptions  # noqa: E402
from stepgraph.compiler import compile_graph  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.ir.graph import Graph  # noqa: E402
from stepgraph.runtime import load  # noqa: E402
from stepgraph.runtime.memory_check import (  # noqa: E402
    StepMemory,
    cache_extent,
    check_fits,
    step_memory,
)
from stepgraph.spec_loader import load_spec, override_deployment  # noqa: E402

GIB = 1 << 30


def compiled(name: str, target: str = "cpu") -> Graph:
    """A spec of models/ compiled at its own deployment for ``target``."""
    spec = load_spec(MODELS / f"{name}.yaml")
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, target=target))
    return graph


def patch_gpu(monkeypatch: pytest.MonkeyPatch, free: int, total: int = 80 * GIB) -> None:
    """An H100 with ``free`` bytes free, as far as the check can tell."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_count_matches_what_load_allocates(dtype: torch.dtype) -> None:
    """Weights, caches and arena counted from the graph equal the tensors a CPU load holds."""
    graph = compiled("tiny_k3")
    requests, context, block = 3, 100, 16
    step = load(graph, weights="random", device="cpu", dtype=str(dtype).split(".")[1],
                max_requests=requests, max_context=context, block_size=block, progress=False)
    need = step_memory(graph, dtype, cache_extent(requests, step.q, context, block))
    caches = set(step.caches)
    held = {name: t for name, t in step.bindings.fixed.items() if name not in caches}
    assert need.weights == sum(t.numel() * t.element_size() for t in held.values())
    assert need.caches == sum(t.numel() * t.element_size() for t in step.caches.values())
    assert need.arena == step.arena.nbytes
    assert step_memory(graph, dtype, cache_extent(requests, step.q, context, block),
                       weights=False).weights == 0


def test_a_k3_rank_does_not_fit_an_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """k3-rank-tp8 holds 86 GiB of weights a rank: on an 80 GB card the check refuses it in
    one line that names the card, the need by kind and what to change: since the weights
    alone exceed the free memory, sharding or a larger GPU (not the caller's cache remedy)."""
    graph = compiled("k3_rank_tp8", target="h100")
    need = step_memory(graph, torch.bfloat16, cache_extent(8, 1, 4160, 64))
    assert 85 * GIB < need.weights < 87 * GIB
    patch_gpu(monkeypatch, free=79 * GIB)
    with pytest.raises(UserError) as error:
        check_fits(need, torch.device("cuda", 0), "use shorter caches")
    text = str(error.value)
    assert "\n" not in text
    assert text.startswith("the step needs at least 86.")
    assert "on cuda:0 (NVIDIA H100 80GB HBM3: 79.0 GiB free of 80.0 GiB)" in text
    assert "weights 86." in text and "caches " in text and "arena " in text
    assert text.endswith("; the weights alone do not fit: shard them over more GPUs (compile "
                         "with a higher --tp or --dep) or use a GPU with more memory")


def test_a_step_that_fits_passes_and_the_cpu_is_never_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    need = StepMemory(weights=10 * GIB, caches=GIB, arena=GIB)
    patch_gpu(monkeypatch, free=12 * GIB)
    check_fits(need, torch.device("cuda", 0), "-")
    patch_gpu(monkeypatch, free=12 * GIB - 1)
    with pytest.raises(UserError, match=r"needs at least 12\.0 GiB.*; use shorter caches$"):
        check_fits(need, torch.device("cuda", 0), "use shorter caches")  # the weights fit
    check_fits(need, torch.device("cpu"), "-")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_refuses_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU whose free memory is reported as 1 MiB, ``load`` refuses tiny_k3 with the
    check's line and has allocated nothing."""
    graph = compiled("tiny_k3")
    before = torch.cuda.memory_allocated()
    real_name = torch.cuda.get_device_name()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 * GIB))
    refusal = rf"needs at least .* \({re.escape(real_name)}: 1\.0 MiB free"
    with pytest.raises(UserError, match=refusal):
        load(graph, weights="random", device="cuda", progress=False,
             allow_target_mismatch=True)
    assert torch.cuda.memory_allocated() == before


def test_the_bench_refuses_before_drawing_weights(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """On a (patched) H100 the bench refuses an h200 artifact with the --target to use and
    no Python-API escape, and an h100 artifact whose step cannot fit the free memory; no
    weight is drawn first."""

    def drawn(*args, **kwargs):
        raise AssertionError("weights drawn before the refusal")

    monkeypatch.setattr(session, "bench_device", lambda name="cuda": torch.device("cuda", 0))
    monkeypatch.setattr(session, "device_random_weights", drawn)
    monkeypatch.setattr(session, "copy_bandwidth", drawn)
    patch_gpu(monkeypatch, free=79 * GIB)
    options = BenchOptions(batches=(1,), modes=("stepgraph",))
    for target in ("h200", "h100"):
        path = tmp_path / f"{target}.sgart"
        assert run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--target", target,
                       "-o", str(path)).returncode == 0
    with pytest.raises(UserError) as error:
        session.run_bench(load_artifact(tmp_path / "h200.sgart"), "h200.sgart", options)
    assert str(error.value).endswith("NVIDIA H100 80GB HBM3: recompile with --target h100")
    session.Session(load_artifact(tmp_path / "h100.sgart"), "h100.sgart", options)  # fits
    patch_gpu(monkeypatch, free=1 << 20)
    with pytest.raises(UserError, match=r"needs at least .*; bench fewer or smaller --batches"):
        session.run_bench(load_artifact(tmp_path / "h100.sgart"), "h100.sgart", options)
