"""Benchmark results and their Markdown tables (one per row bin) and JSON.

A :class:`BenchReport` holds where and when it ran (GPU, date, commit, command), the copy
bandwidth measured in the run, and per bin (:class:`BinResult`) the floor, the numerical
check and the median step time of each mode (:data:`MODES`). A bin whose check failed
reports the failure in place of the compiled step's times. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stepgraph.bench.floor import format_bytes

MODES = ("eager", "torch_compile", "stepgraph", "stepgraph_loop", "stepgraph_nopdl")
MODE_LABELS = {
    "eager": "eager (reference executor, bf16)",
    "torch_compile": "torch.compile (reduce-overhead)",
    "stepgraph": "stepgraph (graph replay)",
    "stepgraph_loop": "stepgraph, decode loop (tokens from the last logits)",
    "stepgraph_nopdl": "stepgraph, PDL/prefetch pass off",
}
COMPILED_MODES = ("stepgraph", "stepgraph_loop", "stepgraph_nopdl")
ARTIFACT_MODES = ("stepgraph", "stepgraph_loop")  # the artifact's own step, as compiled
CHECKED_AS = {"stepgraph_loop": "stepgraph"}  # a mode whose step another mode's check covers
CHECK_LIMIT = 1e-2
NOISE_FACTOR = 1.5


def within_bf16_criterion(error: float, bf16_reference: float | None,
                          limit: float = CHECK_LIMIT) -> bool:
    """The BF16 check: ``error`` (against the float32 reference) is finite and under
    ``limit``, or under :data:`NOISE_FACTOR` times the BF16 reference executor's own error
    (the model's BF16 rounding noise at these weights and inputs, on the same routing)."""
    if not math.isfinite(error):
        return False
    noise = bf16_reference if bf16_reference is not None and math.isfinite(bf16_reference) \
        else 0.0
    return error < max(limit, NOISE_FACTOR * noise)


@dataclass
class Timing:
    """Step times of one mode in one bin (microseconds over ``replays`` replays), or why
    there are none (``error``)."""

    median_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    replays: int = 0
    warmup_s: float | None = None
    error: str = ""

    @classmethod
    def of(cls, times_us: list[float]) -> Timing:
        """The summary of measured step times."""
        if not times_us:
            return cls(error="no replay measured")
        ordered = sorted(times_us)
        middle = len(ordered) // 2
        median = (ordered[middle] if len(ordered) % 2
                  else (ordered[middle - 1] + ordered[middle]) / 2)
        return cls(median_us=median, min_us=ordered[0], max_us=ordered[-1],
                   replays=len(ordered))


@dataclass
class Check:
    """The compiled step's logits against the float32 reference over ``steps`` consecutive
    steps (worst step): ``rel_err`` = ``||out - ref|| / ||ref||`` with the reference on the
    compiled step's own expert choices (the verdict), ``strict_rel_err`` with the float32
    reference's own routing, ``flips`` of ``decisions`` row routings where the two differ,
    ``eager_rel_err`` the bf16 reference executor's error on the same routing (what BF16
    itself costs), ``replay_rel_err`` the graph replay against the same launches run one by
    one, and whether any output was NaN."""

    rel_err: float | None = None
    strict_rel_err: float | None = None
    eager_rel_err: float | None = None
    replay_rel_err: float | None = None
    flips: int = 0
    decisions: int = 0
    nan: bool = False
    steps: int = 0
    when: str = "first steps"
    limit: float = CHECK_LIMIT
    error: str = ""

    @property
    def passed(self) -> bool:
        """Whether the check ran, found no NaN, and met :func:`within_bf16_criterion`."""
        return (not self.error and not self.nan and self.rel_err is not None
                and within_bf16_criterion(self.rel_err, self.eager_rel_err, self.limit))

    def describe(self) -> str:
        """One line for the table's footer."""
        if self.error:
            return f"check ({self.when}) FAILED: {self.error}"
        verdict = "passed" if self.passed else "FAILED"
        nan = "NaN in the output" if self.nan else "no NaN"
        text = (f"check ({self.when}, {self.steps} step(s)) {verdict}: logits vs the float32 "
                f"reference {_sci(self.rel_err)} (limit max({_sci(self.limit)}, "
                f"{NOISE_FACTOR:g} x the bf16 reference executor's)), {nan}")
        if self.decisions:
            text += (f"; routing: {self.flips} of {self.decisions} row choices differ from "
                     f"float32's own, whose error is {_sci(self.strict_rel_err)}")
        if self.eager_rel_err is not None:
            text += f"; bf16 reference executor: {_sci(self.eager_rel_err)}"
        if self.replay_rel_err is not None:
            text += f"; graph replay vs its launches one by one: {_sci(self.replay_rel_err)}"
        return text


@dataclass
class BinResult:
    """One row bin: the floor (bytes, microseconds, bytes by category, distinct routed
    experts touched summed over layers and whether they were measured), the numerical
    checks of each compiled mode and the timings by mode."""

    rows: int
    floor_bytes: float
    floor_us: float
    bytes_by_category: dict[str, float] = field(default_factory=dict)
    touched_experts: float | None = None
    exact_experts: bool = False
    checks: dict[str, list[Check]] = field(default_factory=dict)
    timings: dict[str, Timing] = field(default_factory=dict)

    def check_failed(self, mode: str) -> bool:
        """Whether a check of ``mode`` (or of the mode that checks its step) ran and
        failed."""
        checked = CHECKED_AS.get(mode, mode)
        return any(not check.passed for check in self.checks.get(checked, []))


@dataclass
class BenchReport:
    """A whole benchmark run of one artifact."""

    title: str
    artifact: str
    artifact_hash: str
    gpu: str
    date: str
    commit: str
    command: str
    bandwidth: float
    context: int
    replays: int
    input_sets: int
    bins: list[BinResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data (NaN and infinities as None)."""
        return _finite(asdict(self))


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    return data


def _sci(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ratio(numerator: float | None, denominator: float | None, percent: bool = False) -> str:
    if numerator is None or denominator is None or denominator <= 0:
        return "n/a"
    ratio = numerator / denominator
    return f"{100 * ratio:.1f} %" if percent else f"{ratio:.2f}x"


def _no_time(result: BinResult, mode: str, timing: Timing) -> str:
    """What a table says in place of ``mode``'s time when it has none to show (its check
    failed, or it was not measured: the first line of why); empty when it has one."""
    if mode in COMPILED_MODES and result.check_failed(mode):
        return "check failed"
    if timing.median_us is None:
        return (timing.error or "not measured").replace("|", "/").splitlines()[0]
    return ""


def bin_table(result: BinResult) -> str:
    """The Markdown table of one bin: a line per mode with its median time, the floor,
    floor / time, and the speed-up over eager and over torch.compile (their time / this)."""
    eager = result.timings.get("eager", Timing()).median_us
    compiled = result.timings.get("torch_compile", Timing()).median_us
    lines = ["| mode | time us | floor us | floor / time | x eager | x torch.compile |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode in MODES:
        timing = result.timings.get(mode)
        if timing is None:
            continue
        label = MODE_LABELS[mode]
        missing = _no_time(result, mode, timing)
        if missing:
            lines.append(f"| {label} | {missing} | {_us(result.floor_us)} | - | - | - |")
            continue
        time = timing.median_us
        lines.append(
            f"| {label} | {_us(time)} | {_us(result.floor_us)} | "
            f"{_ratio(result.floor_us, time, percent=True)} | {_ratio(eager, time)} | "
            f"{_ratio(compiled, time)} |"
        )
    return "\n".join(lines)


def bin_heading(report: BenchReport, result: BinResult) -> str:
    """The heading line of one bin's table, with the floor's bytes by category."""
    parts = [f"{k} {format_bytes(v)}" for k, v in result.bytes_by_category.items()]
    experts = ""
    if result.touched_experts is not None:
        how = "measured" if result.exact_experts else "upper bound"
        experts = f"; routed experts touched: {result.touched_experts:g} ({how})"
    return (f"#### B = {result.rows}: floor {format_bytes(result.floor_bytes)} "
            f"({', '.join(parts)}){experts}")


BAR_CELLS = 25  # the bar's width at 100 % of the floor (4 % a cell)
_EIGHTHS = " ▏▎▍▌▋▊▉"


def floor_bar(fraction: float, cells: int = BAR_CELLS) -> str:
    """``fraction`` (floor / time, 0..1) as a bar of block characters ``cells`` wide at 1,
    in eighths of a cell; past 1 (faster than the floor says: a sign the floor's bytes or
    bandwidth are off) the bar is full and ends in ``+``."""
    eighths = round(max(0.0, min(fraction, 1.0)) * cells * 8)
    whole, part = divmod(eighths, 8)
    bar = "█" * whole + (_EIGHTHS[part] if part else "")
    return bar.ljust(cells) + ("+" if fraction > 1.0 else "")


def summary_table(report: BenchReport) -> str:
    """The compiled step over every bin of the run, in one table with a picture: each bin's
    graph-replay time, its floor, floor / time as a number and as a bar (full = the floor),
    and the speed-up over torch.compile; a bin whose check failed or that has no time says
    so instead. Empty when no bin ran the compiled step."""
    header = ["| B | stepgraph us | floor us | floor / time | of the floor (full bar: 100 %) "
              "| x torch.compile |",
              "| ---: | ---: | ---: | ---: | :--- | ---: |"]
    lines: list[str] = []
    for result in report.bins:
        timing = result.timings.get("stepgraph")
        if timing is None:
            continue
        floor = _us(result.floor_us)
        missing = _no_time(result, "stepgraph", timing)
        if missing:
            lines.append(f"| {result.rows} | {missing} | {floor} | - | - | - |")
            continue
        time = timing.median_us
        compiled = result.timings.get("torch_compile", Timing()).median_us
        lines.append(f"| {result.rows} | {_us(time)} | {floor} | "
                     f"{_ratio(result.floor_us, time, percent=True)} | "
                     f"`{floor_bar(result.floor_us / time)}` | {_ratio(compiled, time)} |")
    return "\n".join(header + lines) if lines else ""


def format_report(report: BenchReport) -> str:
    """The whole report as Markdown: the run's facts, the compiled step over every bin
    (:func:`summary_table`), then one table per bin."""
    lines = [
        f"### {report.title}",
        "",
        f"- GPU: {report.gpu}; date: {report.date}; commit: {report.commit}",
        f"- command: `{report.command}`",
        f"- artifact: {report.artifact} (hash {report.artifact_hash[:12]})",
        f"- copy bandwidth measured in this run: {report.bandwidth / 1e12:.3f} TB/s "
        f"(bytes read + written); MLA context {report.context} tokens a request; median of "
        f"{report.replays} replays (CUDA events), inputs rotating over {report.input_sets} sets",
    ]
    lines += [f"- {note}" for note in report.notes]
    summary = summary_table(report)
    if summary:
        lines += ["", "#### The compiled step, every bin", "", summary]
    for result in report.bins:
        lines += ["", bin_heading(report, result), "", bin_table(result), ""]
        for mode in MODES:
            for check in result.checks.get(mode, []):
                lines.append(f"- {MODE_LABELS[mode]}: {check.describe()}")
        for mode in COMPILED_MODES:
            timing = result.timings.get(mode)
            if result.check_failed(mode) and timing is not None and timing.median_us:
                lines.append(f"- not a result (its check failed): {MODE_LABELS[mode]} took "
                             f"{_us(timing.median_us)} us")
    return "\n".join(lines).rstrip() + "\n"
