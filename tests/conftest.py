"""Shared fixtures: the repository's spec files and a runner for the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


@pytest.fixture
def models() -> Path:
    """The folder of model specs."""
    return MODELS


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m stepgraph ARGS`` in a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "stepgraph", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=300,
    )
