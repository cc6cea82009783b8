"""The owed H200 A/B's inputs (scripts/device/owed_inputs.py), checked on the CPU: the l4
spec compiles to k3-rank-tp8's first four layers, and the seeds variant of the H200 table
changes exactly the KDA in_proj and MLA qkv_a launches (layer 2 is the MLA layer), at every
bin the A/B runs, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, run_cli

BINS = "4,8,16,32,64"


def test_owed_inputs_change_only_the_seeded_projections(tmp_path: Path) -> None:
    made = subprocess.run([sys.executable, str(ROOT / "scripts/device/owed_inputs.py"),
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert made.returncode == 0, made.stderr
    a, b = tmp_path / "a.sgart", tmp_path / "b.sgart"
    for path, extra in ((a, ()), (b, ("--tactics", str(tmp_path / "h200-seeds.yaml")))):
        result = run_cli("compile", str(tmp_path / "l4.yaml"), "--batches", BINS, *extra,
                         "-o", str(path))
        assert result.returncode == 0, result.stderr
    summary = json.loads(run_cli("inspect", str(a), "--summary", "--format", "json").stdout)
    assert [x["attention"] for x in summary["layers"]] == ["kda", "kda", "mla", "kda"]
    diff = run_cli("diff", str(a), str(b), "--format", "json")
    assert diff.returncode == 1, diff.stderr
    data = json.loads(diff.stdout)
    assert data["nodes_only"] == {"a": [], "b": []}
    assert not data["nodes_changed"] and not data["weights_changed"]
    assert [entry["rows"] for entry in data["bins"]] == [4, 8, 16, 32, 64]
    for entry in data["bins"]:
        changed = sorted(n for decision in entry["decisions"] for n in decision["nodes"])
        assert changed == ["l0.in_proj", "l1.in_proj", "l2.in_proj", "l3.in_proj"], entry
