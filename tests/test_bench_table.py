"""The benchmark's tables from fake timings: ratios, failed checks, missing modes, JSON."""

from __future__ import annotations

import json
import math

from stepgraph.bench.table import (
    BenchReport,
    BinResult,
    Check,
    Timing,
    bin_table,
    floor_bar,
    format_report,
    summary_table,
)


def report(*bins: BinResult) -> BenchReport:
    return BenchReport(title="k3-rank-tp8: ONE RANK'S COMPUTE", artifact="r.sgart",
                       artifact_hash="abcdef0123456789", gpu="NVIDIA H200", date="2026-12-01",
                       commit="1234567", command="stepgraph bench r.sgart --weights random",
                       bandwidth=4.2e12, context=4096, replays=50, input_sets=4, bins=list(bins))


def timed(**medians: float | None) -> dict[str, Timing]:
    return {mode: Timing(median_us=t, replays=50) for mode, t in medians.items()}


def passed() -> Check:
    return Check(rel_err=3e-3, strict_rel_err=3e-3, eager_rel_err=2e-3, replay_rel_err=0.0,
                 decisions=48, steps=2)


def row(table: str, label: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {label}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_ratios_of_each_mode() -> None:
    result = BinResult(rows=1, floor_bytes=1.68e9, floor_us=400.0,
                       timings=timed(eager=2000.0, torch_compile=1000.0, stepgraph=500.0,
                                     stepgraph_nopdl=800.0),
                       checks={"stepgraph": [passed()]})
    table = bin_table(result)
    # floor / time = 400/500; x eager = 2000/500; x torch.compile = 1000/500
    assert row(table, "stepgraph (graph replay)") == [
        "stepgraph (graph replay)", "500.0", "400.0", "80.0 %", "4.00x", "2.00x"]
    assert row(table, "stepgraph, PDL/prefetch") == [
        "stepgraph, PDL/prefetch pass off", "800.0", "400.0", "50.0 %", "2.50x", "1.25x"]
    assert row(table, "eager")[3:] == ["20.0 %", "1.00x", "0.50x"]
    assert table.splitlines()[1] == "| --- | ---: | ---: | ---: | ---: | ---: |"


def test_a_failed_check_replaces_the_compiled_times() -> None:
    failed = Check(rel_err=3e-2, eager_rel_err=1.5e-2, steps=2, decisions=10, flips=1,
                   strict_rel_err=0.2)
    result = BinResult(rows=4, floor_bytes=1e9, floor_us=250.0,
                       timings=timed(eager=2000.0, stepgraph=500.0),
                       checks={"stepgraph": [failed]})
    assert result.check_failed("stepgraph") and not result.check_failed("eager")
    table = bin_table(result)
    assert row(table, "stepgraph (graph replay)")[1] == "check failed"
    assert "500.0" not in row(table, "stepgraph (graph replay)")
    text = format_report(report(result))
    assert "FAILED" in text and "3.00e-02" in text and "1 of 10 row choices" in text
    assert "not a result (its check failed): stepgraph (graph replay) took 500.0 us" in text


def test_nan_or_an_error_fails_a_check() -> None:
    assert passed().passed
    assert not Check(rel_err=1e-3, nan=True, steps=1).passed
    assert not Check(rel_err=math.nan, steps=1).passed
    assert not Check(error="RuntimeError: CUDA error", steps=1).passed
    assert not Check(rel_err=1e-2, steps=1).passed  # the limit itself is not under it
    # above 1e-2 but within 1.5x of the BF16 reference executor's own error: BF16 noise
    assert Check(rel_err=1.3e-2, eager_rel_err=1.0e-2, steps=1).passed
    assert not Check(rel_err=1.6e-2, eager_rel_err=1.0e-2, steps=1).passed
    assert not Check(rel_err=1.3e-2, eager_rel_err=math.nan, steps=1).passed
    assert "CUDA error" in Check(error="RuntimeError: CUDA error").describe()


def test_missing_modes_and_errors_say_so() -> None:
    result = BinResult(rows=16, floor_bytes=1e9, floor_us=250.0,
                       timings={"stepgraph": Timing(median_us=300.0, replays=50),
                                "torch_compile": Timing(error="BackendCompilerFailed: boom")})
    table = bin_table(result)
    assert row(table, "torch.compile")[1] == "BackendCompilerFailed: boom"
    assert row(table, "stepgraph (graph replay)")[4:] == ["n/a", "n/a"]  # no eager, no compile
    assert "reference executor" not in table  # eager did not run: no line


def test_timing_medians() -> None:
    assert Timing.of([3.0, 1.0, 2.0]).median_us == 2.0
    assert Timing.of([4.0, 1.0, 2.0, 3.0]).median_us == 2.5
    summary = Timing.of([5.0, 1.0])
    assert (summary.min_us, summary.max_us, summary.replays) == (1.0, 5.0, 2)
    assert Timing.of([]).error


def test_report_header_and_json() -> None:
    result = BinResult(rows=1, floor_bytes=1.68e9, floor_us=400.0,
                       bytes_by_category={"weights": 1.5e9, "experts": 1.3e8},
                       touched_experts=24.0, exact_experts=True,
                       timings=timed(stepgraph=500.0, eager=math.inf),
                       checks={"stepgraph": [passed()]})
    text = format_report(report(result))
    lines = text.splitlines()
    assert lines[0] == "### k3-rank-tp8: ONE RANK'S COMPUTE"
    assert "GPU: NVIDIA H200; date: 2026-12-01; commit: 1234567" in text
    assert "4.200 TB/s" in text
    assert "#### B = 1: floor 1.68 GB (weights 1.50 GB, experts 130.00 MB); routed experts " \
           "touched: 24 (measured)" in text
    data = json.loads(json.dumps(report(result).to_json(), allow_nan=False))
    assert data["bins"][0]["timings"]["stepgraph"]["median_us"] == 500.0
    assert data["bins"][0]["timings"]["eager"]["median_us"] is None
    assert data["bins"][0]["checks"]["stepgraph"][0]["rel_err"] == 3e-3


def test_floor_bar_in_eighths_of_a_cell() -> None:
    assert floor_bar(1.0, cells=4) == "████"
    assert floor_bar(0.5, cells=4) == "██  "
    assert floor_bar(0.0, cells=4) == "    "
    assert floor_bar(0.8, cells=25) == "█" * 20 + " " * 5
    assert floor_bar(1 / 32, cells=4) == "▏   "  # one eighth of one of four cells
    assert floor_bar(0.3, cells=4) == "█▎  "  # 9.6 eighths round to 10: one cell and 2/8
    assert floor_bar(1.2, cells=4) == "████+"  # faster than the floor: the floor is off


def test_summary_table_over_the_bins() -> None:
    fast = BinResult(rows=1, floor_bytes=1e9, floor_us=400.0,
                     timings=timed(torch_compile=1000.0, stepgraph=500.0),
                     checks={"stepgraph": [passed()]})
    failed = BinResult(rows=4, floor_bytes=1e9, floor_us=300.0, timings=timed(stepgraph=350.0),
                       checks={"stepgraph": [Check(rel_err=0.5, steps=1)]})
    untimed = BinResult(rows=16, floor_bytes=1e9, floor_us=200.0,
                        timings={"stepgraph": Timing(error="skipped: budget")})
    eager_only = BinResult(rows=64, floor_bytes=1e9, floor_us=100.0, timings=timed(eager=9.0))
    table = summary_table(report(fast, failed, untimed, eager_only))
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in table.splitlines()[2:]}
    assert cells["1"] == ["1", "500.0", "400.0", "80.0 %", f"`{'█' * 20}{' ' * 5}`", "2.00x"]
    assert cells["4"][1:] == ["check failed", "300.0", "-", "-", "-"]
    assert "350.0" not in table  # a failed check's time is no result
    assert cells["16"][1] == "skipped: budget"
    assert "64" not in cells  # no compiled step ran there
    assert summary_table(report(eager_only)) == ""
    text = format_report(report(fast))
    assert text.index("#### The compiled step, every bin") < text.index("#### B = 1")
    assert "The compiled step" not in format_report(report(eager_only))
