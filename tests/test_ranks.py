"""Multi-rank steps on CPU processes: two ranks (Gloo) run the compiled TP2, TP2 + DCP2 and
DEP2 steps of tiny_k3 through the runtime (the collective providers, the vocab-parallel
embedding, the sharded latent norm, each rank's expert offset, DCP's cache shards, DEP's
agreed bins) and their logits match the reference executor's on the full weights, for every
bin. The same check runs on two GPUs with NCCL and CUDA graphs in test_ranks_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import MODELS  # noqa: E402

from stepgraph.artifact import write_artifact  # noqa: E402
from stepgraph.compiler import compile_document  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.runtime.launch import launch  # noqa: E402
from stepgraph.runtime.rank_check import RankCheckOptions, check_rank  # noqa: E402
from stepgraph.spec_loader import load_spec, override_deployment  # noqa: E402

DEPLOYMENTS = {"tp2": {"tp": 2}, "tp2-dcp2": {"tp": 2, "dcp": 2}, "dep2": {"dep": 2}}


def artifact(tmp_path: Path, name: str, target: str = "cpu", **deployment) -> str:
    """tiny_k3 (or ``name``) compiled for ``deployment``, written to ``tmp_path``."""
    spec = load_spec(MODELS / f"{name}.yaml")
    document, _ = compile_document(spec, override_deployment(
        spec.deployment, target=target, batches=(1, 2, 4), **deployment))
    path = tmp_path / f"{name}.sgart"
    write_artifact(document, path)
    return str(path)


@pytest.mark.parametrize("label", sorted(DEPLOYMENTS))
def test_two_cpu_ranks_match_the_reference_at_every_bin(tmp_path: Path, label: str) -> None:
    path = artifact(tmp_path, "tiny_k3", **DEPLOYMENTS[label])
    options = RankCheckOptions(dtype="float32", device="cpu", capture=False, steps=3)
    checks = launch(check_rank, 2, path, options, device="cpu")
    assert [c.rank for c in checks] == [0, 1]
    for check in checks:
        assert sorted(check.errors) == [1, 2, 4]
        for size, error in check.errors.items():
            assert not check.nan[size]
            assert error < 1e-4, f"{label} rank {check.rank} bin {size}: {error:.2e}"
    if label == "dep2":  # each rank serves its own requests: their logits differ
        assert "rank 1 of 2 (gloo)" in checks[1].report


def test_a_rank_error_reaches_the_launcher_as_one_line(tmp_path: Path) -> None:
    path = artifact(tmp_path, "tiny_k3", tp=2)
    with pytest.raises(UserError, match=r"rank \d: the artifact's step runs on 2 ranks but "
                                        r"1 processes were started: use --nproc 2"):
        launch(check_rank, 1, path, RankCheckOptions(device="cpu", capture=False),
               device="cpu")


def test_run_of_a_tp2_artifact_on_two_cpu_ranks_equals_the_reference_run(tmp_path: Path
                                                                          ) -> None:
    import numpy as np
    from conftest import run_cli

    path = artifact(tmp_path, "tiny_k3", tp=2)
    requests = ["--tokens", "1,2,3", "--tokens", "200,5", "--tokens", "9"]
    got = run_cli("run", path, "--weights", "random", *requests, "--device", "cpu",
                  "--logits-out", str(tmp_path / "ranks.npy"))
    assert got.returncode == 0, got.stderr
    want = run_cli("run", str(MODELS / "tiny_k3.yaml"), "--weights", "random", *requests,
                   "--logits-out", str(tmp_path / "reference.npy"))
    assert want.returncode == 0, want.stderr
    a, b = np.load(tmp_path / "ranks.npy"), np.load(tmp_path / "reference.npy")
    assert a.shape == b.shape == (3, 3, 256)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    defined = ~np.isnan(b)
    assert np.abs(b[defined]).max() > 0.1
    assert np.abs(a[defined] - b[defined]).max() < 1e-4

    wrong = run_cli("run", path, "--weights", "random", "--tokens", "1", "--nproc", "3",
                    "--device", "cpu", "--logits-out", str(tmp_path / "x.npy"))
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "error: --nproc 3: the artifact was compiled for 2 rank(s)"]


def test_the_rank_report_takes_the_slowest_rank_and_hides_a_failed_check() -> None:
    from stepgraph.bench.ranks import RankBench, RankBin, format_rank_bench

    def rank(index: int, step_us: float, passed: bool = True) -> RankBench:
        bins = [RankBin(rows=1, check_error=3e-3, bf16_reference_error=2e-3, floor_us=400.0,
                        stepgraph_us=step_us, no_collectives_us=450.0, eager_us=5000.0,
                        check_passed=True),
                RankBin(rows=4, check_error=0.4, floor_us=300.0, stepgraph_us=350.0,
                        check_passed=passed)]
        return RankBench(rank=index, device="NVIDIA H200", bandwidth=4.2e12, bins=bins)

    text = format_rank_bench([rank(0, 480.0), rank(1, 500.0, passed=False)], "### tp2")
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    one = dict(zip(head, (c.strip() for c in lines[1].strip("|").split("|")), strict=True))
    four = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    # the slowest rank's 500 us: floor / time 400 / 500, 20 of 25 cells; collectives 500 - 450
    assert (one["stepgraph us"], one["floor/time"]) == ("500.0", "80.0 %")
    assert one["of the floor"] == f"`{'█' * 20}{' ' * 5}`"
    assert (one["collectives us"], one["eager/stepgraph"]) == ("50.0", "10.00x")
    assert four["check (max over ranks)"] == "4.00e-01 FAILED"
    assert (four["stepgraph us"], four["floor/time"], four["of the floor"]) == ("-", "-", "-")
