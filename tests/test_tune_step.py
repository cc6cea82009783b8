"""``stepgraph tune --step``: tactic values of tabled ops measured in the step
(:mod:`stepgraph.runtime.tune_step`) and the A/B core it shares with scripts/ab_replay.py
(:mod:`stepgraph.bench.ab`).

CPU: the settings' parsing and refusals, the variant and the written table (its decisions
compiled back), the command's one-line errors, and the A/B core on tiny_k3 with the torch
providers (its check tells other weights apart). GPU (``-m gpu``): the whole command on
tiny_k3.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from conftest import MODELS, card_target, run_cli

from stepgraph.artifact import load_artifact
from stepgraph.bench.ab import Compared
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.runtime.tune_step import (
    Timed,
    candidates,
    check_settings,
    new_candidates,
    parse_settings,
    recorded,
    summary,
    variant,
)
from stepgraph.tactics import load_tables, table_path

torch = pytest.importorskip("torch")


def h200() -> dict:
    """The packaged H200 table file's data."""
    return yaml.safe_load(table_path("h200").read_text())


def compiled_with(data: dict, folder: Path, batches: str) -> Graph:
    """k3-rank-tp8 compiled by the CLI at ``batches`` with the table ``data`` (written to
    ``folder`` and checked to load as a valid table first)."""
    path = folder / "tuned.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_tables("h200", path=path)
    artifact = folder / "rank.sgart"
    result = run_cli("compile", str(MODELS / "k3_rank_tp8.yaml"), "--batches", batches,
                     "--tactics", str(path), "-o", str(artifact))
    assert result.returncode == 0, result.stderr
    return load_artifact(artifact).graph


def test_settings_parse_into_every_combination_after_the_base() -> None:
    settings = parse_settings(["mla_core.split=64,128", "mla_core.stages=1,2,1"])
    assert [(s.op, s.field, s.values) for s in settings] == [
        ("mla_core", "split", (64, 128)), ("mla_core", "stages", (1, 2))]
    grid = candidates(settings)
    assert grid[0] == ()
    assert len(grid) == 1 + 2 * 2
    assert (("mla_core", "split", 128), ("mla_core", "stages", 1)) in grid


def test_more_candidates_than_a_bin_can_load_are_refused() -> None:
    settings = parse_settings(["mla_core.split=16,32,64,128", "mla_core.stages=1,2,3,4"])
    with pytest.raises(UserError, match=r"17 candidates .* at most 16"):
        candidates(settings)


def test_nothing_is_written_when_the_base_gives_nan() -> None:
    results = {1: [Timed((), Compared(float("nan"), [10.0])),
                   Timed((("mla_core", "split", 64),), Compared(float("nan"), [9.0]))]}
    with pytest.raises(UserError, match="NaN logits"):
        recorded(h200(), results, "measured on a test")


@pytest.mark.parametrize("text", ["mla_core.split", "mla_core=64", "mla_core.split=6x4",
                                  ".split=64", "mla_core.split=64,"])
def test_malformed_settings_are_refused_with_the_form_to_use(text: str) -> None:
    with pytest.raises(UserError, match=r"OP\.FIELD=V1,V2"):
        parse_settings([text])


@pytest.mark.parametrize("text,rows,why", [
    ("mla_value.block_v=16", 1, "has no tactic table"),
    ("mla_core.warps=4", 1, "no field 'warps'"),
    ("mla_core.split=64", 8, r"tabulates bin 8 \(its bins: \[1, 64\]\)"),
    ("nothing.split=1", 1, "no op 'nothing'"),
])
def test_settings_the_table_cannot_take_are_refused(text: str, rows: int, why: str) -> None:
    with pytest.raises(UserError, match=why):
        check_settings(h200(), parse_settings([text]), rows)


def test_a_variant_sets_its_values_in_its_bin_only() -> None:
    data = h200()
    out = variant(data, (("mla_core", "split", 96), ("mla_core", "stages", 2)), 1)
    bins = out["tactics"]["mla_core"]["rows"][0]["bins"]
    assert bins[1] == [96, 32, 4, 2] and bins[64] == []
    assert data["tactics"]["mla_core"]["rows"][0]["bins"][1] == [128, 32, 4, 1]  # a copy
    assert out["version"].endswith("+mla_core.split=96+mla_core.stages=2@bin1")
    assert variant(data, (), 1) == data


def test_a_candidate_equal_to_the_table_is_not_measured_again() -> None:
    """mla_core.split=64,128 at bin 1, where the H200 table holds split 128: the 128
    candidate is the base itself and is dropped (the base stands for it); at bin 64, whose
    row leaves split to the provider, setting 128 is a change and stays."""
    grid = candidates(parse_settings(["mla_core.split=64,128"]))
    assert new_candidates(h200(), grid, 1) == [(), (("mla_core", "split", 64),)]
    assert new_candidates(h200(), grid, 64) == grid


def test_the_written_table_keeps_the_fastest_usable_candidate(tmp_path: Path) -> None:
    """The fastest candidate whose logits passed goes into its bin (a faster one that failed
    the check does not); the op's rows record every time; compiled back, bin 1 takes the
    kept values and bin 8 keeps the provider's rule."""
    base = ()
    slower = (("mla_core", "split", 64),)
    kept = (("mla_core", "split", 96),)
    broken = (("mla_core", "split", 256),)
    results = {1: [Timed(base, Compared(0.0, [10.0])), Timed(slower, Compared(0.01, [11.0])),
                   Timed(kept, Compared(0.01, [9.0])),
                   Timed(broken, Compared(float("nan"), [5.0]))]}
    out = recorded(h200(), results, "measured on a test")
    table = out["tactics"]["mla_core"]
    assert table["rows"][0]["bins"][1] == [96, 32, 4, 1]
    source = table["rows"][0]["source"]
    assert "bin 1: mla_core.split=96 kept, measured on a test" in source
    assert "the table's own 10.0" in source and "mla_core.split=64 11.0" in source
    assert "mla_core.split=256 refused" in source
    decisions = compiled_with(out, tmp_path, "1,8").meta["decisions"]["l2.core"]
    assert decisions["1"]["tactic"]["split"] == 96, decisions
    assert "split" not in decisions["8"]["tactic"], decisions


def test_the_summary_marks_the_kept_and_explains_a_refusal() -> None:
    base, slower, flipped = (), (("mla_core", "split", 64),), (("mla_core", "split", 96),)
    ok = {1: [Timed(base, Compared(0.0, [10.0])), Timed(slower, Compared(0.01, [11.0]))]}
    lines = summary(ok).splitlines()
    assert lines[1].endswith("the table's own  <- kept") and lines[2].endswith("split=64")
    assert "refused" not in summary(ok)
    refused = {1: [*ok[1], Timed(flipped, Compared(0.44, [9.0]))]}
    text = summary(refused)
    assert "mla_core.split=96  (refused)" in text and "the table's own  <- kept" in text
    assert "routing" in text.splitlines()[-1] and "stepgraph bench" in text.splitlines()[-1]


def test_the_base_candidate_wins_when_nothing_is_faster() -> None:
    results = {1: [Timed((), Compared(0.0, [10.0])),
                   Timed((("mla_core", "split", 64),), Compared(0.0, [12.0]))]}
    out = recorded(h200(), results, "measured on a test")
    assert out["tactics"]["mla_core"]["rows"][0]["bins"][1] == [128, 32, 4, 1]
    assert "bin 1: the table's own kept" in out["tactics"]["mla_core"]["rows"][0]["source"]


@pytest.mark.parametrize("text,why", [
    ("streams.side_ops=1", "no integer or yes/no key 'side_ops'"),
    ("streams.nothing=0,1", "no integer or yes/no key 'nothing'"),
    ("streams.root_fork=0,2", "a yes/no key takes 0 and 1"),
])
def test_section_settings_the_file_cannot_take_are_refused(text: str, why: str) -> None:
    with pytest.raises(UserError, match=why):
        check_settings(h200(), parse_settings([text]), 1)


def test_a_section_key_is_set_typed_and_the_winner_written(tmp_path: Path) -> None:
    """A section setting sets the key as the file types it (a yes/no key stays a bool); the
    written table keeps the fastest usable value with every time in the section's source,
    and compiled back the graph follows it."""
    data = h200()
    assert data["streams"]["root_fork"] is True
    off = variant(data, (("streams", "root_fork", 0),), 1)
    assert off["streams"]["root_fork"] is False and data["streams"]["root_fork"] is True
    assert variant(data, (("streams", "join_lead", 0),), 1)["streams"]["join_lead"] == 0
    results = {1: [Timed((), Compared(0.0, [10.0])),
                   Timed((("streams", "root_fork", 0),), Compared(0.0, [9.0])),
                   Timed((("streams", "root_fork", 1),), Compared(0.0, [10.5]))]}
    out = recorded(data, results, "measured on a test")
    assert out["streams"]["root_fork"] is False
    assert "bin 1: streams.root_fork=0 kept, measured on a test" in out["streams"]["source"]
    assert "the table's own 10.0" in out["streams"]["source"]
    assert compiled_with(out, tmp_path, "1").meta["streams"]["root_fork"] is False


@pytest.mark.parametrize("extra,why", [
    (["--step", "streams.root_fork=0,1", "--bins", "1,8"], "holds for every bin"),
    (["--step", "mla_core.split"], "OP.FIELD=V1,V2"),
    (["--step", "mla_core.split=64,128"], "needs --bins"),
    (["--step", "mla_core.split=64", "--bins", "1", "--quick"], "belong to the projection"),
    (["--table", "t.yaml"], "--table is the base table of --step"),
    (["--step", "mla_core.split=64", "--bins", "1", "--cublas-margin-us", "3"],
     "belong to the projection"),
    (["--cublas-margin-us", "-1"], "give a margin of 0 or more"),
    (["--cublas-margin-us", "nan"], "give a margin of 0 or more"),
    (["--cublas-margin-us", "3", "--splitk-only"], "not allowed with argument"),
    (["--shapes", "560x"], "expected comma-separated NxK"),
    (["--shapes", "560*7168"], "expected comma-separated NxK"),
    (["--shapes", "0x7168"], "with positive sizes"),
    (["--shapes", ","], "give at least one NxK"),
    (["--step", "mla_core.split=64", "--bins", "1", "--shapes", "560x7168"],
     "--shapes belongs to the projection tuning"),
])
def test_the_command_refuses_bad_step_arguments_in_one_line(tmp_path: Path, extra: list[str],
                                                           why: str) -> None:
    out = tmp_path / "t.yaml"
    result = run_cli("tune", "nothing.sgart", "--out", str(out), *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and why in result.stderr, result.stderr
    assert not out.exists()


def test_the_step_mode_refuses_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "t.yaml"
    artifact = tmp_path / "rank.sgart"  # the settings are checked against its table first
    assert run_cli("compile", str(MODELS / "k3_rank_tp8.yaml"), "--batches", "1", "-o",
                   str(artifact)).returncode == 0
    result = run_cli("tune", str(artifact), "--out", str(out), "--bins", "1", "--step",
                     "mla_core.split=64,128")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "CUDA" in result.stderr, result.stderr
    assert not out.exists()


def test_both_tunings_refuse_an_artifact_for_another_card(tmp_path: Path, monkeypatch) -> None:
    """On an H100 (the card's name patched in; the check reads only the name), an artifact
    compiled for the H200 is refused by the projection tuning and by ``--step`` before
    anything is measured or written: rows measured on one card do not belong in another
    card's table. The refusal names the --target and no Python-API escape."""
    import stepgraph.runtime.tune as tune_module
    from stepgraph.runtime.tune_step import tune_step

    monkeypatch.setattr(tune_module, "require_cuda", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: "NVIDIA H100 80GB HBM3")
    artifact = tmp_path / "tiny.sgart"
    assert run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--target", "h200", "-o",
                   str(artifact)).returncode == 0
    out = tmp_path / "t.yaml"
    for tuning in (lambda: tune_module.tune(artifact, out, bins=[1], show_progress=False),
                   lambda: tune_step(artifact, out, ["mla_core.split=64,128"], [1],
                                     show_progress=False)):
        with pytest.raises(UserError) as refused:
            tuning()
        message = str(refused.value)
        assert "compiled for target h200" in message and "--target h100" in message, message
        assert "allow_target_mismatch" not in message, message
        assert not out.exists()


def test_the_ab_core_checks_and_times_every_step_on_the_cpu(tmp_path: Path) -> None:
    """Two loads of one tiny_k3 artifact on the same weights agree exactly; one whose
    lm_head differs (routing untouched) is told apart by the error over its rows; one on
    other weights everywhere routes its rows otherwise, so no row can be compared and its
    error is NaN (a refusal in ``tune --step``); every step gets its rounds timed."""
    from stepgraph.bench.ab import compare, load_step, shared_weights

    path = tmp_path / "tiny.sgart"
    result = run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--batches", "1,2",
                     "--target", "cpu", "-o", str(path))
    assert result.returncode == 0, result.stderr
    artifact = load_artifact(path)
    weights = shared_weights(artifact, device="cpu")
    other = shared_weights(artifact, seed=1, device="cpu")
    head = {**weights, "lm_head": other["lm_head"]}
    steps = [load_step(artifact, w, [2], 32, "cpu") for w in (weights, weights, head, other)]
    compared = compare(steps, 2, 32, rounds=2, replays=2)
    assert (compared[1].error, compared[1].rerouted, compared[1].rows) == (0.0, 0, 2)
    assert compared[2].rerouted == 0 and compared[2].error > 0.1, compared[2]
    assert compared[3].rerouted == 2 and math.isnan(compared[3].error), compared[3]
    assert all(len(c.rounds) == 2 and c.us > 0 for c in compared)


def test_the_check_leaves_rerouted_rows_out() -> None:
    """A step whose second row picked other experts at one router: the error is taken over
    the first and third rows only (the second row's logits are far off, as a whole expert's
    output would make them); every row rerouted or a NaN anywhere gives NaN."""
    from stepgraph.bench.ab import checked

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3, 50, generator=generator)
    base_ids = {"l1.router": torch.tensor([[3, 7], [1, 2], [5, 6]]),
                "l2.router": torch.tensor([[0, 4], [4, 0], [2, 3]])}
    ids = {"l1.router": torch.tensor([[7, 3], [1, 9], [5, 6]]),  # row 0 same set, row 1 not
           "l2.router": base_ids["l2.router"].clone()}
    noise = 1e-3 * torch.randn(3, 50, generator=generator)
    logits = base + noise
    logits[1] += 10.0
    got = checked(ids, logits, base_ids, base)
    alike = [0, 2]
    want = float(noise[alike].norm() / base[alike].norm())
    assert (got.rerouted, got.rows) == (1, 3)
    assert got.error == pytest.approx(want, rel=1e-5) and got.error < 1e-2
    everywhere = {"l1.router": ids["l1.router"] + 20, "l2.router": ids["l2.router"]}
    assert math.isnan(checked(everywhere, logits, base_ids, base).error)
    logits[0, 0] = float("nan")
    assert math.isnan(checked(base_ids, logits, base_ids, base).error)


def test_the_summary_and_table_say_which_rows_were_rerouted() -> None:
    """A candidate kept with one of four rows rerouted says so in the summary (column and
    note) and in the written table's source; one with every row rerouted is refused with
    that reason."""
    base, some, every = (), (("routed_experts", "stages", 3),), (("routed_experts", "stages", 5),)
    results = {4: [Timed(base, Compared(0.0, [10.0], 0, 4)),
                   Timed(some, Compared(0.01, [9.0], 1, 4)),
                   Timed(every, Compared(float("nan"), [8.0], 4, 4))]}
    text = summary(results)
    assert "1/4  routed_experts.stages=3  <- kept" in text, text
    assert "4/4  routed_experts.stages=5  (refused)" in text, text
    assert any(line.startswith("(rerouted:") for line in text.splitlines()), text
    source = recorded(h200(), results, "measured on a test")["description"]
    assert "routed_experts.stages=3 9.0 (1 of 4 rows rerouted)" in source, source
    assert "routed_experts.stages=5 refused (every row rerouted)" in source, source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tune_step_on_gpu(tmp_path: Path) -> None:
    """`stepgraph tune --step` on tiny_k3's MLA split tactic at one row writes a table that
    loads and records the measurement in the mla_core row."""
    target = card_target()
    if table_path(target).name == "default.yaml":
        pytest.skip(f"no tactic table of its own for this GPU ({torch.cuda.get_device_name()}):"
                    f" the default table has no MLA split rows to tune")
    artifact = tmp_path / "tiny.sgart"
    result = run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--target", target, "-o",
                     str(artifact))
    assert result.returncode == 0, result.stderr
    out = tmp_path / "tuned.yaml"
    result = run_cli("tune", str(artifact), "--out", str(out), "--bins", "1", "--step",
                     "mla_core.split=4,8", "--rounds", "2", "--context", "256",
                     "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    tables = load_tables(target, path=out)
    row = tables.data.tactics["mla_core"].rows[0]
    assert "by stepgraph tune --step" in row.source and "bin 1:" in row.source, row.source
    assert result.stdout.count("kept") == 1, result.stdout
