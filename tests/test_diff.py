"""``stepgraph diff``: what differs between two artifacts, told from what the compiles were
asked to change (a tactic table variant, a flag, a deployment), through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, run_cli

RANK = "models/k3_rank_tp8.yaml"
TINY = "models/tiny_k3.yaml"


def _compile(spec: str, out: Path, *flags: str) -> Path:
    result = run_cli("compile", spec, "-o", str(out), *flags)
    assert result.returncode == 0, result.stderr
    return out


def _diff(a: Path, b: Path, *flags: str) -> tuple[int, str, str]:
    result = run_cli("diff", str(a), str(b), *flags)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(RANK, tmp_path_factory.mktemp("diff") / "rank.sgart", "--batches", "1,2")


def test_two_compiles_of_one_spec_are_the_same_step(rank: Path, tmp_path: Path) -> None:
    again = _compile(RANK, tmp_path / "again.sgart", "--batches", "1,2")
    code, out, err = _diff(rank, again)
    assert code == 0, err
    assert "same step" in out
    data = json.loads(_diff(rank, again, "--format", "json")[1])
    assert data["same"] is True
    assert all(not b["decisions"] for b in data["bins"])


def test_a_table_variant_changes_exactly_the_nodes_of_its_row(rank: Path, tmp_path: Path) -> None:
    """The H200 table with one tactic changed (the 7168 x 1536 row, bin 1, m_tile 32 -> 16):
    the diff names every launch reading a 7168 x 1536 weight at one row, nothing at two."""
    table = yaml.safe_load((ROOT / "stepgraph/data/tactics/h200.yaml").read_text())
    row = next(r for r in table["tactics"]["projection"]["rows"]
               if r["match"] == {"n": 7168, "k": 1536})
    assert row["bins"][1][0] == 32
    row["bins"][1][0] = 16
    table["version"] += "-test"
    variant = tmp_path / "variant.yaml"
    variant.write_text(yaml.safe_dump(table))
    other = _compile(RANK, tmp_path / "variant.sgart", "--batches", "1,2", "--tactics",
                     str(variant))
    graph = json.loads(run_cli("inspect", str(rank), "--format", "json").stdout)["graph"]
    shapes = {v["name"]: v["shape"] for v in graph["values"]}
    readers = {n["name"] for n in graph["nodes"]
               if any(shapes[i] == [7168, 1536] for i in n["inputs"])}
    assert len(readers) == 12  # one o_proj a layer

    code, out, err = _diff(rank, other, "--format", "json")
    assert code == 1, err
    data = json.loads(out)
    assert data["inputs"] == {"spec": [], "deployment": [], "options": []}
    assert data["tables"][0] != data["tables"][1] and "-test" in data["tables"][1]
    assert not data["nodes_changed"] and not data["weights_changed"]
    by_rows = {b["rows"]: b for b in data["bins"]}
    assert by_rows[2]["decisions"] == []
    [change] = by_rows[1]["decisions"]
    assert set(change["nodes"]) == readers
    assert "m_tile=32" in change["a"] and "m_tile=16" in change["b"]
    assert by_rows[1]["in_chain"][0] == by_rows[1]["in_chain"][1]

    text = _diff(rank, other, "--bin", "1")[1]
    assert "rows 1: 12 decisions differ" in text and "rows 2" not in text
    assert "o_proj x12" in text


def test_a_flag_and_a_deployment_show_as_input_and_graph_changes(tmp_path: Path) -> None:
    plain = _compile(TINY, tmp_path / "t1.sgart")
    tp2 = _compile(TINY, tmp_path / "t2.sgart", "--tp", "2", "--no-pdl")
    code, out, err = _diff(plain, tp2, "--format", "json")
    assert code == 1, err
    data = json.loads(out)
    assert data["inputs"]["deployment"] == ["tp: 1 -> 2"]
    assert data["inputs"]["options"] == ["pdl: True -> False"]
    assert data["nodes_only"]["a"] == []
    ops = {n["name"]: n["op"] for n in json.loads(
        run_cli("inspect", str(tp2), "--format", "json").stdout)["graph"]["nodes"]}
    collectives = {name for name, op in ops.items()
                   if op in ("all_reduce", "all_gather", "reduce_scatter")}
    assert len(collectives) == 24
    assert collectives <= set(data["nodes_only"]["b"])  # (and what TP2 leaves unfused)
    assert data["weights_changed"]  # split over two ranks
    assert all(b["in_chain"][0] and b["in_chain"][1] is None for b in data["bins"])
    text = _diff(plain, tp2)[1]
    assert "PDL chain 9 launches -> off" in text and "tp: 1 -> 2" in text


def test_a_spec_edit_shows_as_its_path(tmp_path: Path) -> None:
    """Another top_k in a copy of the spec: the diff names that one spec path, a -> b."""
    text = (ROOT / TINY).read_text()
    assert text.count("top_k: 2") == 1
    edited = tmp_path / "tiny_top3.yaml"
    edited.write_text(text.replace("top_k: 2", "top_k: 3"))
    plain = _compile(TINY, tmp_path / "t.sgart")
    other = _compile(str(edited), tmp_path / "e.sgart")
    data = json.loads(_diff(plain, other, "--format", "json")[1])
    assert data["inputs"]["spec"] == ["mlp.moe.top_k: 2 -> 3"]  # the spec's model section
    assert data["inputs"]["deployment"] == [] and data["inputs"]["options"] == []


@pytest.mark.parametrize("case", ["missing", "bin", "not an artifact"])
def test_bad_input_is_one_line_and_status_2(rank: Path, tmp_path: Path, case: str) -> None:
    if case == "missing":
        code, out, err = _diff(rank, tmp_path / "nope.sgart")
    elif case == "bin":
        code, out, err = _diff(rank, rank, "--bin", "3")
        assert "1, 2" in err
    else:
        junk = tmp_path / "junk.sgart"
        junk.write_text("not an artifact")
        code, out, err = _diff(junk, rank)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
