"""`compile --tactics FILE`: a tuned tactic table (``stepgraph tune``'s output) drives the bin
pass instead of the target's own file; the artifact records it by digest (its input hash does
not depend on where the file lies) and the graph by path, which the runtime and the bench's
recompile use again. A table for another target is refused in one line."""

from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MODELS, run_cli

from stepgraph.artifact import load_artifact
from stepgraph.runtime.tune import Measurement, ProjShape, table_rows, write_table
from stepgraph.tactics import table_path

K3 = str(MODELS / "kimi_k3.yaml")


def _tuned(folder: Path) -> Path:
    """A table where cuBLAS measured fastest at 1 row and split-K at 64 rows for the K3 TP8
    KDA projection (the h200 table picks split-K at 1 row: the 8-row tactic)."""
    shape = ProjShape(6288, 7168, "bfloat16")
    results = [Measurement(shape, 1, 10.0, {(128, 8, 2, 6): 12.0}),
               Measurement(shape, 64, 30.0, {(64, 64, 1, 6): 20.0})]
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "tuned.yaml"
    write_table(table_path("h200"), table_rows(results, 1, "measured by a test"), out,
                "TEST", "2026-11-30")
    return out


def _in_proj(artifact: Path, rows: str) -> dict:
    return load_artifact(artifact).graph.meta["decisions"]["l1.in_proj"][rows]


def _compile(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    result = run_cli("compile", K3, "--tp", "8", "--batches", "1,64", "-o", str(out), *extra)
    assert result.returncode == 0, result.stderr
    return out


def test_a_tuned_table_drives_the_bin_pass(tmp_path: Path) -> None:
    table = _tuned(tmp_path / "a")
    plain = _compile(tmp_path, "plain.sgart")
    tuned = _compile(tmp_path, "tuned.sgart", "--tactics", str(table))
    assert _in_proj(plain, "1")["provider"] == "splitk"
    assert _in_proj(tuned, "1")["provider"] == "cublas"
    assert "measured by a test" in _in_proj(tuned, "1")["reason"]
    assert _in_proj(tuned, "64")["tactic"]["n_tile"] == 64
    document = load_artifact(tuned).document
    digest = hashlib.sha256(table.read_bytes()).hexdigest()
    assert document["tables"]["digest"] == digest != load_artifact(plain).document["tables"][
        "digest"]
    assert load_artifact(tuned).graph.meta["tactics"]["path"] == str(table.resolve())
    assert "path" not in load_artifact(plain).graph.meta["tactics"]


def test_the_input_hash_follows_the_digest_not_the_path(tmp_path: Path) -> None:
    first = _tuned(tmp_path / "a")
    second = tmp_path / "b" / "same.yaml"
    second.parent.mkdir()
    shutil.copy(first, second)
    one = load_artifact(_compile(tmp_path, "one.sgart", "--tactics", str(first))).document
    two = load_artifact(_compile(tmp_path, "two.sgart", "--tactics", str(second))).document
    plain = load_artifact(_compile(tmp_path, "plain.sgart")).document
    assert one["input_hash"] == two["input_hash"] != plain["input_hash"]


def test_a_table_for_another_target_is_refused(tmp_path: Path) -> None:
    result = run_cli("compile", K3, "--tp", "8", "--target", "b200", "-o",
                     str(tmp_path / "x.sgart"), "--tactics", str(_tuned(tmp_path / "a")))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "target h200" in result.stderr, result.stderr
    assert not (tmp_path / "x.sgart").exists()
    missing = run_cli("compile", K3, "-o", str(tmp_path / "y.sgart"), "--tactics",
                      str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr


def test_runtime_preferences_and_bench_recompile_use_the_recorded_table(tmp_path) -> None:
    pytest.importorskip("torch")
    from stepgraph.bench.session import recompile_graph
    from stepgraph.runtime.loader import _preferences

    table = _tuned(tmp_path / "a")
    artifact = load_artifact(_compile(tmp_path, "tuned.sgart", "--tactics", str(table)))
    notes: list[str] = []
    _preferences(artifact.graph, "h200", notes)
    assert notes == []  # the recorded file is found: no "tables changed" note
    again = recompile_graph(artifact, pdl=False)
    assert again.meta["tactics"]["digest"] == artifact.graph.meta["tactics"]["digest"]
    assert again.meta["decisions"]["l1.in_proj"]["1"]["provider"] == "cublas"
    table.unlink()
    _preferences(artifact.graph, "h200", notes)
    assert len(notes) == 1 and "changed since this artifact was compiled" in notes[0]


def test_a_variant_table_sets_a_field_in_every_decision(tmp_path: Path) -> None:
    """scripts/tactics_variant.py: optional fields of tabled ops (routed_experts' combine,
    kda_core's out_norm) and a required one (kda_core's block_v) reach every bin's decision
    of the compiled K3 rank; the packaged table's own decisions lack the optional ones (or
    spell out the provider's default: combine 0 stands before the one-row GEMV fields of
    routed_experts' bin 1) and give block_v its default 32."""
    variant = tmp_path / "variant.yaml"
    script = Path(__file__).resolve().parents[1] / "scripts" / "tactics_variant.py"
    done = subprocess.run([sys.executable, str(script), "routed_experts.combine=1",
                           "kda_core.out_norm=1", "kda_core.block_v=16", "-o", str(variant)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    spec = str(MODELS / "k3_rank_tp8.yaml")
    settings = (("l1.routed_experts", "combine", 1), ("l1.kda_core", "out_norm", 1),
                ("l1.kda_core", "block_v", 16))
    for name, extra, variant_on in (("plain.sgart", (), False),
                                    ("variant.sgart", ("--tactics", str(variant)), True)):
        out = tmp_path / name
        result = run_cli("compile", spec, "--batches", "1,8,64", "-o", str(out), *extra)
        assert result.returncode == 0, result.stderr
        decisions = load_artifact(out).graph.meta["decisions"]
        for node, field, value in settings:
            for rows, decision in decisions[node].items():
                got = decision["tactic"].get(field)
                if variant_on:
                    assert got == value, (name, node, rows, decision)
                elif field == "block_v":  # the packaged kda_core row spells it out
                    assert got == 32, (name, node, rows, decision)
                else:  # absent, or routed_experts' combine 0 ahead of bin 1's gemv fields
                    assert got is None or (field == "combine" and got == 0), (name, node, rows)


def test_a_variant_past_a_bins_end_names_the_fields_to_set_first(tmp_path: Path) -> None:
    """scripts/tactics_variant.py: routed_experts' gemv lies past bins that stop at pre
    (the top-16 row): one error line naming combine, exit status 2, no file written; with
    combine set first the same setting goes through."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tactics_variant.py"
    out = tmp_path / "variant.yaml"
    refused = subprocess.run([sys.executable, str(script), "routed_experts.gemv=16",
                              "--bin", "1", "-o", str(out)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert "set combine first" in refused.stderr and refused.stderr.count("\n") == 1
    assert not out.exists()
    done = subprocess.run([sys.executable, str(script), "routed_experts.combine=0",
                           "routed_experts.gemv=16", "--bin", "1", "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = yaml.safe_load(out.read_text())["tactics"]["routed_experts"]["rows"]
    assert all(row["bins"][1][8] == 16 for row in rows)


@pytest.mark.parametrize("shape", ["7168x", "0x1536", "7168*1536"])
def test_a_variant_refuses_a_shape_that_is_not_nxk(tmp_path: Path, shape: str) -> None:
    """scripts/tactics_variant.py --shape: one error line, exit status 2, no file written
    (the same setting at a well-formed shape goes through)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tactics_variant.py"
    out = tmp_path / "variant.yaml"
    refused = subprocess.run([sys.executable, str(script), "projection.stages=4", "--shape",
                              shape, "-o", str(out)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert "is not NxK" in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    assert not out.exists()
    done = subprocess.run([sys.executable, str(script), "projection.stages=4", "--shape",
                           "7168x1536", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_section_key_is_typed_by_the_schema() -> None:
    """A section key is set as the table file's schema types it (a yes/no key from 0 / 1,
    also where the file leaves the key out); a key the schema does not hold as an integer
    or yes/no, and a yes/no key given 2, are refused."""
    from stepgraph.tactics_variant import VariantError, set_section_key

    data = yaml.safe_load(table_path("h200").read_text())
    del data["streams"]["root_fork"]
    set_section_key(data, "streams", "root_fork", 0)
    assert data["streams"]["root_fork"] is False
    set_section_key(data, "streams", "join_lead", 2)
    assert data["streams"]["join_lead"] == 2
    set_section_key(data, "prefetch", "stream_min_bytes", 1024)
    assert data["prefetch"]["stream_min_bytes"] == 1024
    for key, value in (("side_ops", 1), ("source", 1), ("nothing", 0), ("root_fork", 2)):
        with pytest.raises(VariantError):
            set_section_key(data, "streams", key, value)


def test_a_tune_at_some_bins_keeps_the_base_rows_other_bins(tmp_path: Path) -> None:
    """`stepgraph tune --bins 8,64` on the K3 rank's KDA projection (tp 1): bins 8 and 64
    take the measured tactics, bins 1 and 2 keep the base file's one-row and two-row GEMV
    forms for that shape (they were dropped once, so a later compile at one row read the
    8-row MMA tactic), and the row's source says which bins came from where."""
    from stepgraph.tactics import load_tables

    shape = ProjShape(6288, 7168, "bfloat16")
    results = [Measurement(shape, 8, 40.0, {(64, 8, 1, 4): 30.0}),
               Measurement(shape, 64, 40.0, {(64, 64, 2, 4): 30.0})]
    out = tmp_path / "tuned.yaml"
    write_table(table_path("h100"), table_rows(results, 1, "measured by a test"), out,
                "TEST", "2026-12-06")
    base, tuned = load_tables("h100"), load_tables("h100", path=out)
    for rows in (1, 2):
        kept = tuned.choose("projection", rows, 6288, 7168, tp=1)
        assert kept.tactic == base.choose("projection", rows, 6288, 7168, tp=1).tactic
        assert kept.tactic["k_tile"] == 0  # the GEMV form, not an MMA tile
    assert tuned.choose("projection", 8, 6288, 7168, tp=1).tactic["split"] == 1
    assert tuned.choose("projection", 64, 6288, 7168, tp=1).tactic["split"] == 2
    shape_match = {"n": 6288, "k": 7168}
    base_rows = yaml.safe_load(table_path("h100").read_text())["tactics"]["projection"]["rows"]
    base_bins = next(r["bins"] for r in base_rows if r["match"] == shape_match)
    others = sorted(set(base_bins) - {8, 64})
    assert others[:2] == [1, 2]
    source = tuned.choose("projection", 1, 6288, 7168, tp=1).reason
    assert (f"measured by a test at bins 8, 64; bins {', '.join(map(str, others))} as in "
            "h100.yaml") in source
    rows = yaml.safe_load(out.read_text())["tactics"]["projection"]["rows"]
    same = [r for r in rows if r["match"] == shape_match]
    assert len(same) == 1 and sorted(same[0]["bins"]) == sorted(set(base_bins) | {8, 64})


@pytest.mark.parametrize("margin,picked", [
    (0.0, ["cublas", "cublas", "cublas"]),  # cuBLAS faster alone by 1.5, 2 and 8.5 us
    (2.0, ["splitk", "splitk", "cublas"]),  # 16 rows: faster by exactly the margin
    (6.0, ["splitk", "splitk", "cublas"]),
    (9.0, ["splitk", "splitk", "splitk"]),
    (math.inf, ["splitk", "splitk", "splitk"]),
])
def test_cublas_is_picked_only_where_it_beats_split_k_by_more_than_the_margin(
        margin: float, picked: list[str]) -> None:
    """The tune's pick: cuBLAS only where it is faster alone than the fastest split-K tactic
    by more than the margin (a cuBLAS launch breaks the PDL chain); the split-K pick is the
    fastest tactic; with no split-K tactic measured, cuBLAS is all there is."""
    shape = ProjShape(6288, 7168, "bfloat16")
    results = [Measurement(shape, 1, 10.0, {(16, 1, 1, 2): 11.5, (16, 1, 2, 2): 12.0}),
               Measurement(shape, 16, 20.0, {(64, 16, 1, 4): 22.0, (64, 16, 2, 4): 25.0}),
               Measurement(shape, 64, 30.0, {(64, 64, 1, 6): 38.5})]
    assert [m.choice(margin)[0] for m in results] == picked
    rows = table_rows(results, 1, "measured by a test", margin)
    assert [rows[0]["bins"][b] == "cublas" for b in (1, 16, 64)] == [
        p == "cublas" for p in picked]
    assert Measurement(shape, 4, 10.0).choice(math.inf) == ("cublas", None, 10.0)
    assert results[0].choice(math.inf) == ("splitk", (16, 1, 1, 2), 11.5)


def test_the_gpu_tables_carry_the_chain_break_the_tune_defaults_to(tmp_path: Path) -> None:
    """h100.yaml's rough measurement, h200.yaml's assumed copy of it; the portable table has
    no PDL chain to break, and a table with a negative break is refused in one line."""
    from stepgraph.tactics import TacticsError, load_tables

    assert load_tables("h100").data.pdl.cublas_break_us == 6.0
    assert load_tables("h200").data.pdl.cublas_break_us == 6.0
    assert load_tables("default").data.pdl.cublas_break_us == 0.0
    data = yaml.safe_load(table_path("h200").read_text())
    data["pdl"]["cublas_break_us"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(TacticsError) as refused:
        load_tables("h200", path=bad)
    assert "cublas_break_us" in str(refused.value) and "\n" not in str(refused.value)
