"""Tune the tactic fields of a tabled op in the step itself (``stepgraph tune ARTIFACT
--step OP.FIELD=V1,V2 ...``): for each bin, the artifact's spec and deployment are compiled
once per candidate (every combination of the given values set in that bin of the op's
table, and the table as it is), every candidate's step is loaded on the same random weights,
its logits are checked against the table's own, and the steps are timed in interleaved
rounds (:mod:`stepgraph.bench.ab`). The fastest candidate's values go into the written
table file (the base table otherwise), and the op's rows record every candidate's time.

A setting may also name a key of a section of the file instead of an op
(``streams.root_fork=0,1``, ``streams.join_lead=0,1,2``; 0 / 1 for a yes-no key): such a key
holds for every bin, so it is tuned at one bin only, and its section's ``source`` records
the times.

Why in the step: isolated launches mislead for the short kernels of a one-row step (e.g.
MLA's split-KV tactics: 4 us a layer faster alone, nothing in the step, where the merge
after the partial pays for it; docs/perf.md, sixteenth session). The artifact only gives
the spec, deployment and options: every candidate, the base one included, is compiled from
the base table (``table``, default the target's own file), so the comparison is between
tables, whatever table the artifact was compiled with.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from stepgraph.errors import UserError
from stepgraph.tactics_variant import (
    SECTIONS,
    VariantError,
    check_section_key,
    set_field,
    set_section_key,
)

if TYPE_CHECKING:
    from stepgraph.bench.ab import Compared

REJECT_ERROR = 5e-2  # a candidate whose logits are farther from the base's is refused
REFUSED_NOTE = (
    f"(refused: logits NaN, or farther than {REJECT_ERROR:.0e} from the table's own step's "
    "over the rows both route alike, or no row routed alike: a near-tie in the MoE routing "
    "broken the other way in every row, which at one row is the only row; to check such a "
    "candidate, compile it and run stepgraph bench, whose check against float32 runs on the "
    "step's own routing)")
REROUTED_NOTE = ("(rerouted: rows whose experts differ from the table's own step's at some "
                 "router, a near-tie broken the other way; they are left out of the logits' "
                 "check)")
MAX_CANDIDATES = 16  # a bin's candidates are all loaded at once (weights shared, caches not)


@dataclass(frozen=True)
class Setting:
    """One ``--step`` setting: the values to try for one tactic field of one op."""

    op: str
    field: str
    values: tuple[int, ...]


Candidate = tuple[tuple[str, str, int], ...]  # (op, field, value) settings; () the base


def candidate_label(candidate: Candidate) -> str:
    """``op.field=value ...`` (``the table's own`` for the base)."""
    return " ".join(f"{op}.{f}={v}" for op, f, v in candidate) or "the table's own"


@dataclass
class Timed:
    """One candidate at one bin and its A/B result (the logits' distance from the base's,
    each round's median step time)."""

    candidate: Candidate
    result: Compared

    @property
    def error(self) -> float:
        """Its logits' distance from the base's."""
        return self.result.error

    @property
    def us(self) -> float:
        """Its median step time (us)."""
        return self.result.us

    @property
    def label(self) -> str:
        """``op.field=value ...`` (``the table's own`` for the base)."""
        return candidate_label(self.candidate)

    @property
    def check(self) -> str:
        """Its logits' check in words: the error, or why there is none."""
        if self.result.rows and self.result.rerouted == self.result.rows:
            return "every row rerouted"
        return f"logits {self.error:.1e} from the table's own"

    @property
    def usable(self) -> bool:
        """Whether its logits passed the check against the base's."""
        return not math.isnan(self.error) and self.error <= REJECT_ERROR


def parse_settings(texts: Sequence[str]) -> list[Setting]:
    """``OP.FIELD=V1,V2,...`` strings as settings; a UserError names a malformed one."""
    settings = []
    for text in texts:
        key, _, values = text.partition("=")
        op, _, field = key.partition(".")
        parts = values.split(",")
        if not (op and field and values) or not all(p.lstrip("-").isdigit() for p in parts):
            raise UserError(f"--step {text!r} is not OP.FIELD=V1,V2,... with integer values "
                            "(e.g. mla_core.split=64,128)")
        settings.append(Setting(op, field, tuple(dict.fromkeys(int(p) for p in parts))))
    return settings


def candidates(settings: Sequence[Setting]) -> list[Candidate]:
    """The base (no setting) first, then every combination of the settings' values; a
    UserError past :data:`MAX_CANDIDATES` (every candidate's step is loaded at once)."""
    grid = [[(s.op, s.field, v) for v in s.values] for s in settings]
    out: list[Candidate] = [(), *(tuple(combo) for combo in itertools.product(*grid))]
    if len(out) > MAX_CANDIDATES:
        raise UserError(f"--step: {len(out)} candidates with the table's own (every "
                        f"combination of the values); at most {MAX_CANDIDATES} a bin, since "
                        "each one's step is loaded at once: give fewer values")
    return out


def check_section_bins(settings: Sequence[Setting], bins: Sequence[int]) -> None:
    """Refuse section keys (which hold for every bin) tuned at more than one bin."""
    sections = sorted({f"{s.op}.{s.field}" for s in settings if s.op in SECTIONS})
    if sections and len(bins) > 1:
        raise UserError(f"--step {sections[0]}: a section key holds for every bin; tune it "
                        "at one bin (e.g. --bins 1)")


def check_settings(data: dict[str, Any], settings: Sequence[Setting], rows: int) -> None:
    """Refuse (UserError, one line) settings the table cannot take at bin ``rows``: an op
    without a tactic table, a field its table lacks, a bin none of its rows tabulates; a
    section key the table file's schema does not hold as an integer or yes/no."""
    for setting in settings:
        if setting.op in SECTIONS:
            try:
                check_section_key(setting.op, setting.field, setting.values)
            except VariantError as error:
                raise UserError(f"--step {setting.op}.{setting.field}: {error}") from None
            continue
        entry = data["ops"].get(setting.op)
        if entry is None:
            raise UserError(f"--step {setting.op}.{setting.field}: the table has no op "
                            f"{setting.op!r}")
        name = entry.get("table")
        if name is None:
            raise UserError(f"--step {setting.op}.{setting.field}: {setting.op} has no tactic "
                            "table in this file; add one (its fields and bins) first, or "
                            "A/B a variant with scripts/tactics_variant.py")
        table = data["tactics"][name]
        if setting.field not in table["fields"]:
            raise UserError(f"--step {setting.op}.{setting.field}: table {name} has no field "
                            f"{setting.field!r} (fields: {', '.join(table['fields'])})")
        tabled = sorted({int(b) for row in table["rows"] for b, t in row["bins"].items()
                         if not isinstance(t, str)})
        if rows not in tabled:
            raise UserError(f"--step {setting.op}.{setting.field}: no row of table {name} "
                            f"tabulates bin {rows} (its bins: {tabled}); tune one of those")


def _apply(out: dict[str, Any], op: str, field: str, value: int, rows: int) -> None:
    """Set one setting in the file's data ``out``: a section key (typed as the schema types
    it), or the op's field in bin ``rows`` of every row of its table."""
    try:
        if op in SECTIONS:
            set_section_key(out, op, field, value)
        else:
            set_field(out, op, field, value, only_bin=rows)
    except VariantError as error:
        raise UserError(f"--step: {error}") from None


def variant(data: dict[str, Any], candidate: Candidate, rows: int) -> dict[str, Any]:
    """A copy of the table file's data with the candidate's fields set in bin ``rows`` of
    every row of the op's table (every shape a projection table holds), and its section
    keys set."""
    out = copy.deepcopy(data)
    for op, field, value in candidate:
        _apply(out, op, field, value, rows)
    if candidate:
        out["version"] = (f"{data['version']}+"
                          + "+".join(f"{op}.{f}={v}" for op, f, v in candidate) + f"@bin{rows}")
    return out


def new_candidates(data: dict[str, Any], grid: Sequence[Candidate], rows: int
                   ) -> list[Candidate]:
    """``grid`` without the candidates whose table at bin ``rows`` is the base's own (every
    value they set already holds there): the base, measured first, stands for them."""
    def same(candidate: Candidate) -> bool:
        table = variant(data, candidate, rows)
        table["version"] = data["version"]
        return table == data

    return [c for c in grid if not c or not same(c)]


def recorded(data: dict[str, Any], results: dict[int, list[Timed]], where: str
             ) -> dict[str, Any]:
    """The table to write: the base with each bin's fastest usable candidate set in it, and
    every candidate's time in the source of the op's rows (``where``: GPU, date, command)."""
    out = copy.deepcopy(data)
    notes = []
    for rows, timed in sorted(results.items()):
        usable = [t for t in timed if t.usable]
        if not usable:
            raise UserError(f"bin {rows}: the table's own step gave NaN logits, so no "
                            "candidate could be checked against it; nothing written")
        best = min(usable, key=lambda t: t.us)
        for op, field, value in best.candidate:
            _apply(out, op, field, value, rows)
        times = "; ".join(f"{t.label} {t.us:.1f}" + _rerouted(t) if t.usable else
                          f"{t.label} refused ({t.check})" for t in timed)
        note = f"bin {rows}: {best.label} kept, {where} (us a step: {times})"
        notes.append(note)
        for op in dict.fromkeys(op for t in timed for op, _, _ in t.candidate):
            sources = ([out[op]] if op in SECTIONS
                       else out["tactics"][out["ops"][op]["table"]]["rows"])
            for entry in sources:
                entry["source"] = f"{entry['source']}; {note}" if entry.get("source") else note
    stamp = datetime.date.today().isoformat()
    out["version"] = f"{data['version']}+tune-step-{stamp}"
    out["description"] = f"{data['description']} Tuned in the step: " + " ".join(notes)
    return out


def tune_step(artifact_path: str | Path, out: str | Path, steps: Sequence[str],
              bins: Sequence[int], table: str | Path | None = None, rounds: int = 3,
              replays: int = 50, context: int = 4096, show_progress: bool = True
              ) -> dict[int, list[Timed]]:
    """Measure the candidates of ``steps`` at each of ``bins`` in the step of the artifact's
    spec and write the table file ``out`` (see the module docstring); returns the timings
    by bin."""
    from stepgraph.artifact import Artifact, load_artifact
    from stepgraph.compiler import compile_document
    from stepgraph.ir.serialize import graph_from_json
    from stepgraph.passes.pipeline import CompileOptions
    from stepgraph.runtime.progress import progress
    from stepgraph.spec import Deployment, Spec
    from stepgraph.tactics import load_tables, table_path, write_table_file

    # every refusal before the GPU is touched
    settings = parse_settings(steps)
    if not bins:
        raise UserError("--step needs --bins: the row counts to tune (e.g. --bins 1)")
    check_section_bins(settings, bins)
    grid = candidates(settings)
    source = load_artifact(artifact_path)
    spec = Spec.model_validate({"model": source.spec, "deployment": source.deployment})
    options = CompileOptions(**source.document["options"])
    base_path = Path(table) if table else table_path(spec.deployment.target)
    data = yaml.safe_load(base_path.read_text())
    for rows in bins:
        check_settings(data, settings, rows)

    from stepgraph.runtime.tune import require_cuda

    device = require_cuda()
    import torch

    from stepgraph.runtime.loader import check_target

    check_target(spec.deployment.target, device, escape=None)

    from stepgraph.bench.ab import compare, load_step, shared_weights

    gpu = torch.cuda.get_device_name(device)
    where = (f"measured on {gpu} {datetime.date.today().isoformat()} by stepgraph tune "
             f"--step in the step of {spec.model.name} (context {context}, {rounds} rounds)")
    results: dict[int, list[Timed]] = {}
    grids = {rows: new_candidates(data, grid, rows) for rows in bins}
    for rows, kept in grids.items():
        for same in (c for c in grid if c not in kept):
            print(f"bin {rows}: {candidate_label(same)} is the table's own there; measured "
                  "once, as the table's own")
    with tempfile.TemporaryDirectory() as folder, \
            progress(sum(map(len, grids.values())), "tune --step", show_progress) as advance:
        for rows in bins:
            grid = grids[rows]
            deployment = Deployment.model_validate(
                {**spec.deployment.model_dump(), "batches": [rows]})
            loaded = []
            weights = None
            for index, candidate in enumerate(grid):
                path = Path(folder) / f"bin{rows}-{index}.yaml"
                write_table_file(variant(data, candidate, rows), path)
                document, _ = compile_document(spec, deployment, options, tables_path=path)
                artifact = Artifact(document, graph_from_json(document["graph"]))
                weights = weights if weights is not None else shared_weights(artifact,
                                                                            device=str(device))
                loaded.append(load_step(artifact, weights, [rows], context, str(device)))
                advance(1, f"bin {rows}: loaded {index + 1} of {len(grid)}")
            compared = compare(loaded, rows, context, rounds, replays)
            results[rows] = [Timed(c, r)
                             for c, r in zip(grid, compared, strict=True)]
            del loaded, weights
            torch.cuda.empty_cache()
    written = recorded(data, results, where)
    out_path = Path(out)
    write_table_file(written, out_path)
    load_tables(spec.deployment.target, path=out_path)  # the file must load as a valid table
    return results


def _rerouted(timed: Timed) -> str:
    """`` (k of n rows rerouted)`` where the check left rows out, else nothing."""
    result = timed.result
    return f" ({result.rerouted} of {result.rows} rows rerouted)" if result.rerouted else ""


def summary(results: dict[int, list[Timed]]) -> str:
    """A text table: bin, candidate, median us and the rounds, the check (the logits'
    distance and the rows rerouted); the kept one marked."""
    lines = [f"{'bin':>4}  {'us':>8}  {'rounds':<26} {'logits':>8} {'rerouted':>8}  candidate"]
    for rows, timed in sorted(results.items()):
        best = min((t for t in timed if t.usable), key=lambda t: t.us, default=None)
        for t in timed:
            rounds = " ".join(f"{v:.1f}" for v in t.result.rounds)
            mark = "  <- kept" if t is best else ("" if t.usable else "  (refused)")
            rerouted = f"{t.result.rerouted}/{t.result.rows}"
            lines.append(f"{rows:>4}  {t.us:>8.1f}  {rounds:<26} {t.error:>8.1e} "
                         f"{rerouted:>8}  {t.label}{mark}")
    every = [t for timed in results.values() for t in timed]
    if any(t.result.rerouted for t in every):
        lines.append(REROUTED_NOTE)
    if any(not t.usable for t in every):
        lines.append(REFUSED_NOTE)
    return "\n".join(lines)
