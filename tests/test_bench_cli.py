"""``stepgraph bench``: argument errors on one line with exit status 2, the refusal without
CUDA, and the whole protocol as a CPU dry run (GPU run: ``-m gpu``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import card_target, run_cli

TINY = "models/tiny_k3.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "tiny.sgart"
    result = run_cli("compile", TINY, "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


@pytest.mark.parametrize(("flags", "message"), [
    (["--weights", "ckpt/"], "--weights 'ckpt/': the benchmark runs on random weights only"),
    (["--weights", "random", "--batches", "3"], "--batches 3: not a bin of this artifact"),
    (["--weights", "random", "--batches", "x"], "--batches 'x': expected comma-separated"),
    (["--weights", "random", "--replays", "0"], "--replays 0: must be at least 1"),
    (["--weights", "random", "--context", "0"], "--context 0: must be at least 1"),
    (["--weights", "random", "--sets", "0"], "--sets 0: must be at least 1"),
    (["--weights", "random", "--modes", "fast"], "--modes 'fast': choose from"),
    (["--weights", "random", "--json", "/no/such/folder/x.json"], "folder /no/such/folder"),
    (["--weights", "random", "--device", "tpu"], "--device 'tpu': choose cuda"),
])
def test_argument_errors_are_one_line(tiny: Path, flags: list[str], message: str) -> None:
    result = run_cli("bench", str(tiny), *flags, "--no-progress")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def test_missing_artifact_and_weights_flag(tmp_path: Path) -> None:
    result = run_cli("bench", str(tmp_path / "none.sgart"), "--weights", "random")
    assert result.returncode == 2
    assert "no such artifact" in result.stderr
    result = run_cli("bench", str(tmp_path / "none.sgart"))
    assert result.returncode == 2
    assert "--weights" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda(tiny: Path) -> None:
    result = run_cli("bench", str(tiny), "--weights", "random", "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: stepgraph bench needs a CUDA GPU and none is "
                                     "available here (run it on the GPU machine; --device cpu "
                                     "is a dry run)")


def _run_bench(tiny: Path, tmp_path: Path, device: str, modes: str, batches: str
               ) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    result = run_cli("bench", str(tiny), "--weights", "random", "--device", device,
                     "--batches", batches, "--replays", "3", "--warmup", "1", "--context", "40",
                     "--modes", modes, "--json", str(out), "--no-progress", "--commit", "abc")
    print(result.stdout)
    print(result.stderr[-4000:])
    assert result.returncode in (0, 1), result.stderr  # 1: a check failed (the table says)
    return result.stdout, json.loads(out.read_text())


def _check_report(stdout: str, data: dict, modes: tuple[str, ...], bins: list[int]) -> None:
    assert stdout.startswith("### tiny_k3")
    assert "commit: abc" in stdout
    assert [b["rows"] for b in data["bins"]] == bins
    assert data["bandwidth"] > 0
    for result in data["bins"]:
        assert result["floor_bytes"] > 0 and result["exact_experts"]
        assert result["touched_experts"] > 0
        for mode in modes:
            timing = result["timings"][mode]
            assert timing["error"] == "" and timing["median_us"] > 0, (mode, timing)
            assert timing["replays"] == 3
        for mode in ("stepgraph", "stepgraph_nopdl"):
            for check in result["checks"][mode]:
                assert check["error"] == "", check
                assert check["rel_err"] is not None and not check["nan"], check
                assert check["replay_rel_err"] < 1e-2, check
                # a routing choice per row, MoE layer (5) and checked step
                assert check["decisions"] == result["rows"] * 5 * check["steps"], check
        assert len(result["checks"]["stepgraph"]) == 2  # first steps, after the replays
    assert stdout.count("| mode | time us |") == len(bins)


@pytest.mark.slow
def test_cpu_dry_run_of_the_whole_protocol(tiny: Path, tmp_path: Path) -> None:
    stdout, data = _run_bench(tiny, tmp_path, "cpu", "eager,stepgraph,loop,nopdl", "1,4")
    assert "CPU (dry run" in stdout
    _check_report(stdout, data, ("eager", "stepgraph", "stepgraph_loop", "stepgraph_nopdl"),
                  [1, 4])
    assert stdout.count("| stepgraph, decode loop (tokens from the last logits) |") == 2


def test_a_spent_budget_skips_every_measurement(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_cli("bench", str(tiny), "--weights", "random", "--device", device,
                     "--batches", "1", "--budget-s", "0", "--json", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    (only,) = data["bins"]
    assert set(only["timings"]) == {"eager", "torch_compile", "stepgraph", "stepgraph_loop",
                                    "stepgraph_nopdl"}
    assert all(t["error"].startswith("skipped: the --budget-s 0 s was spent")
               for t in only["timings"].values())
    assert only["checks"] == {}
    assert out.with_suffix(".md").read_text() == result.stdout
    assert "| stepgraph (graph replay) | skipped: the --budget-s 0 s was spent |" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_of_tiny(tmp_path: Path) -> None:
    """Every mode of the protocol on the GPU (torch.compile included), tiny_k3 compiled for
    this GPU's target, one bin."""
    tiny = tmp_path / "tiny.sgart"
    result = run_cli("compile", TINY, "--target", card_target(), "-o", str(tiny))
    assert result.returncode == 0, result.stderr
    stdout, data = _run_bench(tiny, tmp_path, "cuda", "eager,compile,stepgraph,loop,nopdl", "4")
    _check_report(stdout, data, ("eager", "torch_compile", "stepgraph", "stepgraph_loop",
                                 "stepgraph_nopdl"), [4])
    assert data["bandwidth"] > 1e12, "a device-to-device copy below 1 TB/s"


def test_a_step_that_does_not_load_still_gets_its_baselines(tiny: Path, monkeypatch) -> None:
    import stepgraph.runtime
    from stepgraph.artifact import load_artifact
    from stepgraph.bench.options import BenchOptions
    from stepgraph.bench.session import run_bench

    def refuse(*args, **kwargs):
        raise RuntimeError("no provider of op 'kda_core'")

    monkeypatch.setattr(stepgraph.runtime, "load", refuse)
    options = BenchOptions(batches=(1,), replays=2, warmup=0, context=20, sets=2,
                           modes=("eager", "stepgraph", "stepgraph_nopdl"), device="cpu",
                           progress=False, commit="x")
    report = run_bench(load_artifact(tiny), str(tiny), options)
    (only,) = report.bins
    assert only.timings["eager"].median_us > 0
    assert only.floor_bytes > 0 and only.exact_experts
    assert "did not load" in only.timings["stepgraph"].error
    assert "did not load" in only.timings["stepgraph_nopdl"].error
    assert any("no provider of op 'kda_core'" in note for note in report.notes)
    assert only.checks == {}
