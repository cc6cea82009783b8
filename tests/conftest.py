"""Shared fixtures: the repository's spec files, a runner for the CLI, the compile target of
the GPU in hand, and H200 tactic tables with the L2 prefetch forks turned on (the shipped
H200 table turns them off)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


@pytest.fixture
def models() -> Path:
    """The folder of model specs."""
    return MODELS


def card_target() -> str:
    """The compile target of this machine's GPU (``h200``, ``h100``, ...), or skip the test
    on a GPU that no target names."""
    import torch

    from stepgraph.runtime.loader import device_target

    target = device_target(torch.device("cuda"))
    if target is None:
        pytest.skip(f"no compile target names this GPU ({torch.cuda.get_device_name()})")
    return target


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m stepgraph ARGS`` in a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "stepgraph", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=300,
    )


def fork_tables(directory: Path, budget: int = 16 << 20, rule: str = "seeds",
                stream_min: int = 4 << 20) -> Path:
    """A copy of the H200 tactic tables in ``directory`` whose pdl pass inserts L2 prefetch
    forks (``budget`` bytes a fork, fork ``rule``, launches of ``stream_min`` weight bytes
    streaming); returns its path."""
    data = yaml.safe_load((ROOT / "stepgraph/data/tactics/h200.yaml").read_text())
    data["prefetch"].update(fork_budget_bytes=budget, rule=rule, stream_min_bytes=stream_min)
    path = directory / f"h200-forks-{rule}-{budget}-{stream_min}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
