"""Multi-rank steps on two GPUs (nvidia-h200-x2): NCCL collectives captured inside each rank's
CUDA graphs. TP2, TP2 + DCP2 and DEP2 of tiny_k3 and of a 4-layer real-dimension K3 slice
(k3_tp2's model) match the single-GPU reference executor on the same full weights, for every
bin: tiny_k3 in float32 on the torch providers (under 1e-4), the real-dimension slice in BF16
on the H200 providers (the criterion of stepgraph.runtime.rank_check: under 1e-2, or within
1.5x of the reference executor's own BF16 error). Skips without two CUDA devices."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import MODELS  # noqa: E402

from stepgraph.artifact import write_artifact  # noqa: E402
from stepgraph.compiler import compile_document  # noqa: E402
from stepgraph.runtime.launch import launch  # noqa: E402
from stepgraph.runtime.rank_check import (  # noqa: E402
    RankCheckOptions,
    check_rank,
    format_checks,
)
from stepgraph.spec_loader import load_spec, override_deployment  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]
BINS = {"tiny_k3": (1, 2, 4, 8), "k3_tp2": (1, 4, 16, 64)}
DEPLOYMENTS = {"tp2": {"tp": 2}, "tp2-dcp2": {"tp": 2, "dcp": 2}, "dep2": {"dep": 2}}


def artifact(tmp_path: Path, spec_name: str, **deployment) -> str:
    spec = load_spec(MODELS / f"{spec_name}.yaml")
    document, _ = compile_document(spec, override_deployment(spec.deployment, target="h200",
                                                             **deployment))
    path = tmp_path / f"{spec_name}.sgart"
    write_artifact(document, path)
    return str(path)


def _check(path: str, label: str, options: RankCheckOptions, limit: float | None = None
           ) -> None:
    checks = launch(check_rank, 2, path, options)
    table = format_checks(checks)
    print(f"\n{label} ({options.dtype})\n{table}{checks[0].report}")
    for check in checks:
        assert sorted(check.errors) == sorted(int(b) for b in BINS[label.split()[0]])
        for size in check.errors:
            ok = check.passed(size) if limit is None else (
                not check.nan[size] and check.errors[size] < limit)
            assert ok, f"{label} rank {check.rank} bin {size}:\n{table}"


@pytest.mark.parametrize("label", sorted(DEPLOYMENTS))
def test_tiny_k3_on_two_gpus_matches_the_reference_in_fp32(tmp_path: Path, label: str) -> None:
    """The torch providers in float32 (exact arithmetic up to summation order) with the
    NCCL collectives captured in the CUDA graphs."""
    options = RankCheckOptions(dtype="float32", steps=4, providers=("torch", "cublas", "nccl"))
    _check(artifact(tmp_path, "tiny_k3", **DEPLOYMENTS[label]), f"tiny_k3 {label}", options,
           limit=1e-4)


@pytest.mark.parametrize("label", sorted(DEPLOYMENTS))
def test_real_dimension_slice_on_two_gpus_matches_the_reference_in_bf16(tmp_path: Path,
                                                                        label: str) -> None:
    """The H200 providers (Triton kernels, cuBLAS, NCCL) in BF16 on K3's real dimensions."""
    deployment = {"tp": 1, "dcp": 1, "dep": 1, **DEPLOYMENTS[label]}
    _check(artifact(tmp_path, "k3_tp2", **deployment), f"k3_tp2 {label}",
           RankCheckOptions(dtype="bfloat16", steps=4))
