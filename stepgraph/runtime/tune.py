"""Measure the projection tactic table on the GPU: for every distinct projection shape of an
artifact (the per-rank ``(N, K)`` of its projection / o_proj weights and of its gated MLPs'
gate_up weights, by which those are looked up) and every bin, time cuBLAS and a small grid of
split-K tactics, and write a tactic table file (the format of
``stepgraph/data/tactics/<target>.yaml``) whose projection rows hold the fastest choice per
bin, each row's ``source`` saying where and when it was measured. cuBLAS is picked only where
it is faster alone by more than a margin: a cuBLAS launch breaks the step's PDL chain on both
of its sides, which an isolated timing does not see (the margin defaults to the target
table's ``pdl.cublas_break_us``; infinite for steps run as one PDL chain throughout).

Timing: each candidate runs as a CUDA graph of back-to-back launches (split-K with PDL, as
the runtime launches it) over rotating copies of the weight and activations (more bytes than
twice the L2, so the L2 never holds the next launch's weight), warmed first; the median over
replays, per launch, is reported (CUDA events). cuBLAS is timed as ``torch.matmul`` into a
BF16 output (the weight stream it reads is the same for a float32 output).
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.runtime.kernels.launch_utils import GEMV_GROUP_ROWS, next_pow2, tile_width
from stepgraph.tactics import row_matches, write_table_file

PROJECTION_OPS = ("projection", "o_proj", "lm_head")
GATED_MLP_OPS = ("shared_expert", "dense_mlp")
ROTATE_BYTES = 128 << 20  # rotating inputs: at least this many weight bytes (> 2x a 50 MB L2)
MAX_COPIES = 64


@dataclass(frozen=True)
class ProjShape:
    """A projection's per-rank weight shape ``n x k`` and output dtype (IR name)."""

    n: int
    k: int
    out_dtype: str


@dataclass
class Measurement:
    """Times (microseconds a launch) of cuBLAS and of each split-K tactic on one shape and
    row count, and the winner."""

    shape: ProjShape
    rows: int
    cublas_us: float
    splitk_us: dict[tuple[int, ...], float] = field(default_factory=dict)

    def best_splitk(self) -> tuple[tuple[int, ...], float] | None:
        """The fastest split-K tactic and its time (the smallest tactic of a tie); None where
        none was measured."""
        return min(sorted(self.splitk_us.items()), key=lambda item: item[1], default=None)

    def choice(self, cublas_margin_us: float = 0.0
               ) -> tuple[str, tuple[int, ...] | None, float]:
        """``("splitk", tactic, us)`` for the fastest split-K tactic, or ``("cublas", None,
        us)`` where cuBLAS is faster than it by more than ``cublas_margin_us`` (or no split-K
        tactic was measured); ``math.inf`` keeps every bin on split-K."""
        best = self.best_splitk()
        if best is None or self.cublas_us + cublas_margin_us < best[1]:
            return ("cublas", None, self.cublas_us)
        return ("splitk", *best)


def projection_shapes(graph: Graph) -> list[ProjShape]:
    """The distinct per-rank projection shapes of a compiled graph, in graph order: the
    projections' weights and the gated MLPs' gate_up weights (the table row a gated MLP is
    looked up by)."""
    shapes: dict[tuple[int, int], ProjShape] = {}
    for node in graph:
        if node.op not in PROJECTION_OPS and node.op not in GATED_MLP_OPS:
            continue
        n, k = graph.values[node.inputs[1]].type.shape
        out = (graph.values[node.inputs[0]].type.dtype if node.op in GATED_MLP_OPS
               else graph.values[node.outputs[0]].type.dtype)
        if isinstance(n, int) and isinstance(k, int):
            shapes.setdefault((n, k), ProjShape(n, k, out))
    return list(shapes.values())


def select_shapes(shapes: Sequence[ProjShape], wanted: Sequence[tuple[int, int]] | None,
                  artifact: str) -> list[ProjShape]:
    """The ``shapes`` whose ``(n, k)`` is in ``wanted`` (all of them for None), in graph order;
    a one-line error naming the artifact's shapes where one wanted is not among them."""
    if wanted is None:
        return list(shapes)
    have = {(s.n, s.k) for s in shapes}
    missing = [f"{n}x{k}" for n, k in wanted if (n, k) not in have]
    if missing:
        known = ", ".join(f"{s.n}x{s.k}" for s in shapes)
        raise UserError(f"--shapes: {', '.join(missing)} is not a projection weight shape of "
                        f"{artifact}; its shapes: {known}")
    chosen = set(wanted)
    return [s for s in shapes if (s.n, s.k) in chosen]


def candidate_tactics(rows: int, k: int, quick: bool = False) -> list[tuple[int, ...]]:
    """The split-K grid tried at ``rows``: m_tile 32 / 64 / 128 (64 / 128 when ``quick``),
    split 1..8 (while each split keeps at least two K tiles), stages 4 / 6 (4 only when
    ``quick``); n_tile = the rows (8..64). Up to :data:`~stepgraph.runtime.kernels.
    launch_utils.GEMV_GROUP_ROWS` rows also a GEMV form (one row a program at one row, all of them
    at 2..4; 16 KB chunks): m_tile 4 / 8 / 16 / 32 (8 / 16 when ``quick``), split 1 / 2 / 4, 2
    or 3 chunks in flight (2 when ``quick``), 4 or 8 warps (8 when ``quick``), as
    ``[m_tile, n_tile, split, chunks, 0, warps]``. Launches timed alone back to back favour 3
    chunks; inside the step 2 measured faster (docs/perf.md): check a table in the step."""
    n_tile = max(8, min(64, next_pow2(rows)))
    out: list[tuple[int, ...]] = []
    for m_tile in ((64, 128) if quick else (32, 64, 128)):
        for split in ((1, 2, 4) if quick else (1, 2, 4, 8)):
            if split > 1 and k // split < 2 * tile_width(m_tile):
                continue
            for stages in ((4,) if quick else (4, 6)):
                out.append((m_tile, n_tile, split, stages))
    if rows <= GEMV_GROUP_ROWS:
        gemv_rows = next_pow2(rows)  # the kernels' row groups: 1, 2, 4
        for m_tile in ((8, 16) if quick else (4, 8, 16, 32)):
            for split in (1, 2, 4):
                if split > 1 and k // split < 2 * tile_width(m_tile):
                    continue
                for depth in ((2,) if quick else (2, 3)):
                    for warps in ((8,) if quick else (4, 8)):
                        out.append((m_tile, gemv_rows, split, depth, 0, warps))
    return out


def _copies(weight_bytes: int) -> int:
    return max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(weight_bytes, 1))))


def captured_graph(run: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """``run`` (launches that may fork onto side streams and join back) once on a fresh
    stream, to compile and warm its kernels, then captured into a CUDA graph."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def time_launches(launches: Sequence[Callable[[], None]], repeats: int = 3,
                  replays: int = 15) -> float:
    """Median microseconds per launch of ``launches`` (run ``repeats`` times in order) as
    one captured CUDA graph, over ``replays`` timed replays after warm-up."""
    for launch in launches:  # compile and warm outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for launch in launches:
                launch()
    for _ in range(3):
        graph.replay()
    us = replay_median_us(graph, replays) / (repeats * len(launches))
    del graph
    return us


def replay_median_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median microseconds of one replay of ``graph`` over ``replays`` replays, each timed
    by CUDA events and synchronized."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


def measure(shape: ProjShape, rows: int, tactics: Iterable[tuple[int, ...]],
            device: torch.device, seed: int = 0) -> Measurement:
    """Time cuBLAS and each split-K tactic on ``shape`` at ``rows`` rows."""
    from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic

    gen = torch.Generator(device=device).manual_seed(seed)
    copies = _copies(shape.n * shape.k * 2)
    ws = [(torch.randn(shape.n, shape.k, device=device, generator=gen) / shape.k ** 0.5)
          .to(torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(rows, shape.k, device=device, generator=gen).to(torch.bfloat16)
          for _ in range(copies)]
    out_dtype = torch.float32 if shape.out_dtype == "float32" else torch.bfloat16
    outs = [torch.empty(rows, shape.n, device=device, dtype=out_dtype) for _ in range(copies)]
    bf16_outs = [torch.empty(rows, shape.n, device=device, dtype=torch.bfloat16)
                 for _ in range(copies)]

    def cublas(i: int) -> Callable[[], None]:
        return lambda: torch.matmul(xs[i], ws[i].t(), out=bf16_outs[i])

    result = Measurement(shape, rows, time_launches([cublas(i) for i in range(copies)]))
    for tactic in tactics:
        launches = [SplitKGemm(xs[i], ws[i], outs[i], SplitKTactic(*tactic), pdl=True)
                    for i in range(copies)]
        result.splitk_us[tactic] = time_launches(launches)
    return result


def table_rows(results: Sequence[Measurement], q: int, source: str,
               cublas_margin_us: float = 0.0) -> list[dict[str, Any]]:
    """Projection table rows (the tactic file's format) from measurements: one row per
    shape, each bin's choice (:meth:`Measurement.choice` with ``cublas_margin_us``). A row
    names no TP degree: a GEMM's speed depends on its per-rank shape, so it serves that shape
    at any degree."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for m in results:
        key = (m.shape.n, m.shape.k)
        if key not in rows:
            match: dict[str, int] = {"n": m.shape.n, "k": m.shape.k}
            if q > 1:
                match["q"] = q
            rows[key] = {"match": match, "source": source, "bins": {}}
        provider, tactic, _ = m.choice(cublas_margin_us)
        rows[key]["bins"][m.rows] = list(tactic) if tactic is not None else provider
    for row in rows.values():
        row["bins"] = dict(sorted(row["bins"].items()))
    return list(rows.values())


def _facts(match: dict[str, Any]) -> dict[str, Any]:
    """The lookup facts of a measured row's shape (what ``TacticTables.choose`` compares)."""
    facts = {"q": 1, **match}
    facts["verify"] = facts["q"] > 1
    return facts


def _bins_text(bins: Iterable[int]) -> str:
    return ", ".join(str(b) for b in sorted(bins))


def merge_rows(base_rows: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]],
               base_name: str) -> list[dict[str, Any]]:
    """The projection rows of a tuned table: each measured row first (the first match wins),
    holding the bins the base file gave that shape and were not measured (a ``--bins 8,64``
    run keeps the base's one-row GEMV forms); base rows of the same match are dropped, every
    other base row is kept after them."""
    merged = []
    for row in measured:
        facts = _facts(row["match"])
        base = next((r for r in base_rows if row_matches(r["match"], facts)), None)
        kept = {b: v for b, v in (base or {}).get("bins", {}).items() if b not in row["bins"]}
        if not kept:
            merged.append(row)
            continue
        source = (f"{row['source']} at bins {_bins_text(row['bins'])}; bins "
                  f"{_bins_text(kept)} as in {base_name}: {' '.join(base['source'].split())}")
        merged.append({**row, "source": source, "bins": dict(sorted({**kept, **row["bins"]}
                                                                   .items()))})
    done = [row["match"] for row in measured]
    return merged + [r for r in base_rows if r["match"] not in done]


def write_table(base_path: Path, measured: list[dict[str, Any]], out: Path, label: str,
                date: str) -> None:
    """Write ``base_path``'s table with the ``measured`` projection rows merged in
    (:func:`merge_rows`)."""
    data = yaml.safe_load(base_path.read_text(encoding="utf-8"))
    table = data["tactics"]["projection"]
    table["rows"] = merge_rows(table.get("rows", []), measured, base_path.name)
    base_version = data["version"]
    data["version"] = f"{base_version}+tune-{date}"
    data["description"] = (f"Projection rows of {len(measured)} shapes {label}; everything "
                           f"else from {base_path.name} ({base_version}): "
                           f"{' '.join(str(data['description']).split())}")
    header = (f"# Tactic tables written by `stepgraph tune` {date} from {base_path.name}\n"
              f"# (projection rows {label}; everything else as in {base_path.name}).\n")
    write_table_file(data, out, header)


def require_cuda() -> torch.device:
    """The CUDA device to tune on; a UserError where there is none (or no triton)."""
    if not torch.cuda.is_available():
        raise UserError("stepgraph tune measures on a CUDA GPU and none is available here; "
                        "run it on the GPU machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("stepgraph tune needs triton (the split-K kernels) installed") from None
    return torch.device("cuda")


@dataclass(frozen=True)
class TuneRun:
    """What one projection tuning measured, and the cuBLAS margin its picks used."""

    measurements: list[Measurement]
    cublas_margin_us: float


def margin_text(cublas_margin_us: float) -> str:
    """How a table's picks treated cuBLAS, for its rows' source and the summary."""
    if math.isinf(cublas_margin_us):
        return "split-K only, for PDL chains"
    return f"cuBLAS where faster alone by more than {cublas_margin_us:g} us"


def tune(artifact_path: str | Path, out: str | Path, bins: Sequence[int] | None = None,
         quick: bool = False, show_progress: bool = True,
         cublas_margin_us: float | None = None,
         shapes: Sequence[tuple[int, int]] | None = None) -> TuneRun:
    """Measure the projection shapes of an artifact (or the ``(n, k)`` of ``shapes`` among
    them) at ``bins`` (default: its specialized bins) and write the table file ``out``.
    ``cublas_margin_us``: how much faster alone a cuBLAS launch must be to be picked (one
    breaks a PDL chain on both of its sides; default the target table's
    ``pdl.cublas_break_us``, ``math.inf`` for split-K only)."""
    if cublas_margin_us is not None and not cublas_margin_us >= 0:
        raise UserError(f"--cublas-margin-us {cublas_margin_us:g}: give a margin of 0 or more "
                        "microseconds")
    device = require_cuda()
    from stepgraph.artifact import load_artifact
    from stepgraph.runtime.loader import artifact_target, check_target
    from stepgraph.runtime.progress import progress
    from stepgraph.tactics import load_tables, table_path

    artifact = load_artifact(artifact_path)
    graph = artifact.graph
    deployment = artifact.deployment
    target = artifact_target(graph)
    check_target(target, device, escape=None)  # rows measured here belong to this card's table
    if cublas_margin_us is None:  # the table's value, which its schema keeps >= 0
        cublas_margin_us = load_tables(target).data.pdl.cublas_break_us
    planned = [b["rows"] for b in graph.meta.get("bins", []) if b.get("path") != "stock"]
    rows_list = sorted(set(bins or planned or deployment.get("batches", [])))
    if not rows_list or min(rows_list) < 1:
        raise UserError(f"--bins {rows_list}: give positive row counts")
    all_shapes = projection_shapes(graph)
    if not all_shapes:
        raise UserError(f"{artifact_path}: the plan has no projection to tune")
    chosen = select_shapes(all_shapes, shapes, str(artifact_path))
    q = int(deployment.get("q", 1))
    gpu = torch.cuda.get_device_name(device)
    date = datetime.date.today().isoformat()
    jobs = [(shape, rows) for shape in chosen for rows in rows_list]
    results = []
    with torch.inference_mode(), progress(len(jobs), "tune", show_progress) as advance:
        for index, (shape, rows) in enumerate(jobs):
            tactics = candidate_tactics(rows, shape.k, quick)
            results.append(measure(shape, rows, tactics, device, seed=index))
            kind, tactic, us = results[-1].choice(cublas_margin_us)
            advance(1, f"{shape.n}x{shape.k} rows {rows}: {kind} {tactic or ''} {us:.1f} us")
    label = f"measured on {gpu} {date} by stepgraph tune ({margin_text(cublas_margin_us)})"
    rows_out = table_rows(results, q, label, cublas_margin_us)
    out_path = Path(out)
    write_table(table_path(target), rows_out, out_path, label, date)
    load_tables(target, path=out_path)  # the file must load as a valid table
    return TuneRun(results, cublas_margin_us)


def summary(run: TuneRun) -> str:
    """A text table: shape, rows, cuBLAS time, best split-K time and tactic, the choice, and
    the margin the choices used."""
    lines = [f"{'shape':>16} {'rows':>4} {'cublas us':>9} {'splitk us':>9}  best tactic"]
    for m in run.measurements:
        tactic, us = m.best_splitk() or (None, math.nan)
        kind = m.choice(run.cublas_margin_us)[0]
        lines.append(f"{m.shape.n:>7}x{m.shape.k:<8} {m.rows:>4} {m.cublas_us:>9.2f} "
                     f"{us:>9.2f}  {list(tactic) if tactic else '-'} -> {kind}")
    lines.append(f"choices: {margin_text(run.cublas_margin_us)}")
    return "\n".join(lines)
