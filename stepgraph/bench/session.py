"""One benchmark run of one artifact on one GPU, in one process (shared/BENCHMARKS.md):

0. refused before anything is allocated where the artifact was compiled for another GPU (if
   a mode runs it) or its weights and caches cannot fit the GPU's free memory;
1. the copy bandwidth (a large device-to-device copy, bytes read + written);
2. random weights on the GPU, shared by every mode; the compiled step loaded from the
   artifact (one CUDA graph per bin) and its caches filled with random values;
3. per bin, in this order: the numerical check (the compiled step's logits against the
   reference executor in float32 on the same weights, inputs and caches, over
   ``check_steps`` consecutive steps, arena and logits poisoned with NaN first); the routed
   experts each input set touches (the bf16 reference's routing of the same inputs) and the
   floor; eager (the reference executor on the GPU in bf16); ``torch.compile(mode=
   "reduce-overhead")`` of the same eager step; the compiled step's replays; a second check
   after those replays; the decode loop (the compiled step's replays, each one's tokens the
   argmax of the last one's logits, so that no step starts before the one before ends, as
   in a serving loop with its sampler on the GPU);
4. the artifact's spec and deployment recompiled with the PDL/prefetch pass off, loaded on
   the same weights, checked and timed per bin.

Each timing is the median of ``replays`` calls (CUDA events) rotating over ``sets`` input
sets. A failing mode records its error and the run goes on; a failed check replaces that
mode's times in the table.
"""

from __future__ import annotations

import gc
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from stepgraph.artifact import Artifact
from stepgraph.bench.floor import step_bytes
from stepgraph.bench.options import BenchOptions
from stepgraph.bench.protocol import (
    Feed,
    Routing,
    bench_device,
    build_feeds,
    clone_caches,
    compile_stats,
    compiled_step,
    copy_bandwidth,
    decode_loop_call,
    device_feed,
    fill_caches,
    fp32_reference,
    launched_step,
    next_feed,
    relative_error,
    serving_call,
    synchronize,
    time_calls,
    touched_experts,
)
from stepgraph.bench.table import ARTIFACT_MODES, BenchReport, BinResult, Check, Timing
from stepgraph.bench.weights import device_random_weights, weight_bytes
from stepgraph.bench.workloads import ROOT, title_of
from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.lower.caches import allocate_caches
from stepgraph.lower.reference import ReferenceExecutor
from stepgraph.memory.arena import bin_rows
from stepgraph.runtime.loader import BLOCK_SIZE, artifact_target, check_target
from stepgraph.runtime.memory_check import CacheExtent, cache_extent, check_fits, step_memory

CHECK_HEADROOM = 64  # tokens of cache beyond the context, for the check's later steps


@dataclass
class Layout:
    """The caches the eager and compiled steps of a phase run on, and their geometry."""

    caches: dict[str, torch.Tensor]
    block_size: int
    width: int
    vocab: int


def git_commit() -> str:
    """The repository's short commit (``-dirty`` with local changes), or ``unknown``."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here)"
    return head + ("-dirty" if dirty.strip() else "")


def recompile_graph(artifact: Artifact, pdl: bool) -> Graph:
    """The artifact's spec and deployment compiled again with the PDL/prefetch pass on or off
    (the other compile options and the tactic table file as recorded)."""
    from stepgraph.compiler import compile_graph
    from stepgraph.passes.pipeline import CompileOptions
    from stepgraph.spec import Spec

    document = artifact.document
    spec = Spec.model_validate({"model": document["spec"], "deployment": document["deployment"]})
    recorded = dict(document.get("options", {}))
    options = CompileOptions(**{**recorded, "pdl": pdl})
    tables = artifact.graph.meta.get("tactics", {}).get("path")
    graph, _ = compile_graph(spec, spec.deployment, options, tables_path=tables)
    return graph


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:300]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Session:
    """The state of one run: device, weights, options and the report being filled."""

    def __init__(self, artifact: Artifact, path: str, options: BenchOptions,
                 on_update: Callable[[BenchReport], None] | None = None) -> None:
        self.started = time.perf_counter()
        self.on_update = on_update
        self.device = bench_device(options.device)
        self.artifact = artifact
        self.graph = artifact.graph
        self.options = options
        deployment = self.graph.meta.get("deployment", {})
        self.q = int(deployment.get("q", 1))
        bins = bin_rows(self.graph)
        self.bins = list(options.batches or bins)
        missing = sorted(set(self.bins) - set(bins))
        if missing:
            raise UserError(f"--batches {missing} are not bins of this artifact (its bins: "
                            f"{', '.join(map(str, bins))})")
        if self.device.type == "cuda":
            self.check_device(artifact_target(self.graph))
        self.results = {rows: BinResult(rows=rows, floor_bytes=0.0, floor_us=0.0)
                        for rows in self.bins}
        self.report = BenchReport(
            title=title_of(str(self.graph.meta.get("model", self.graph.name))),
            artifact=path, artifact_hash=artifact.document.get("hash", ""),
            gpu=(torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                 else "CPU (dry run: times mean nothing)"),
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            commit=options.commit or git_commit(),
            command=options.command or shlex.join(["stepgraph", *sys.argv[1:]]),
            bandwidth=0.0, context=options.context, replays=options.replays,
            input_sets=options.sets,
        )
        self.weights: dict[str, torch.Tensor] = {}

    def check_device(self, target: str) -> None:
        """Refuse, before any weight is drawn, an artifact compiled for another GPU (when a
        mode runs it) and a run whose weights and caches cannot fit the GPU's free memory."""

        if {*ARTIFACT_MODES, "stepgraph_nopdl"} & set(self.options.modes):
            check_target(target, self.device, escape=None)
        check_fits(step_memory(self.graph, torch.bfloat16, self.extent()), self.device,
                   "bench fewer or smaller --batches, fewer --sets or a shorter --context, or "
                   "a step that holds less a GPU (compile with a higher --tp or --dep)")

    # ------------------------------------------------------------------ the run

    def run(self) -> BenchReport:
        """Every phase (see the module docstring); returns the filled report."""
        opts = self.options
        with torch.no_grad():
            size = (2 << 30) if self.device.type == "cuda" else (64 << 20)
            self.report.bandwidth = copy_bandwidth(self.device, size)
            started = time.perf_counter()
            self.weights = device_random_weights(self.graph, opts.seed, torch.bfloat16,
                                                 self.device)
            self.note(f"random weights: {weight_bytes(self.weights) / 1e9:.2f} GB drawn on the "
                      f"GPU in {time.perf_counter() - started:.1f} s (seed {opts.seed})")
            wanted = {"eager", "torch_compile", *ARTIFACT_MODES} & set(opts.modes)
            if wanted:
                self.phase_main()
            if "stepgraph_nopdl" in opts.modes:
                self.phase_nopdl()
        self.update()
        return self.report

    def update(self) -> None:
        """Publish the results so far (the caller may write them out after every bin)."""
        self.report.bins = [self.results[rows] for rows in self.bins]
        if self.on_update is not None:
            self.on_update(self.report)

    def out_of_time(self) -> bool:
        """Whether the time budget is spent (no new measurement starts then)."""
        budget = self.options.budget_s
        return budget is not None and time.perf_counter() - self.started > budget

    def skipped(self) -> Timing:
        """The timing of a mode the budget left out."""
        return Timing(error=f"skipped: the --budget-s {self.options.budget_s:g} s was spent")

    def note(self, text: str) -> None:
        """Add a line to the report's notes (and say it on stderr)."""
        self.report.notes.append(text)
        print(f"bench: {text}", file=sys.stderr, flush=True)

    def load(self, graph: Graph | Artifact) -> Any:
        """The compiled step of ``graph`` on the shared weights, caches filled at random; None
        (the error noted, its traceback on stderr) when it does not load."""
        from stepgraph.runtime import load

        opts = self.options
        started = time.perf_counter()
        what = "the artifact's" if isinstance(graph, Artifact) else "the recompiled"
        try:
            compiled = load(graph, weights=self.weights, device=self.device,
                            dtype="bfloat16", seed=opts.seed, max_requests=self.requests,
                            max_context=opts.context + CHECK_HEADROOM, block_size=BLOCK_SIZE,
                            progress=opts.progress,
                            allow_target_mismatch=self.device.type == "cpu")
        except Exception as error:
            traceback.print_exc()
            self.note(f"{what} compiled step did not load: {_error_text(error)}")
            _free()
            return None
        fill_caches(compiled.caches, opts.seed)
        lines = compiled.report().splitlines()
        self.note(f"loaded {what} step in {time.perf_counter() - started:.1f} s: {lines[0]}")
        for line in lines[1:]:
            print(f"bench: {line}", file=sys.stderr)
        return compiled

    @property
    def requests(self) -> int:
        """Requests the caches hold: every input set of the largest bin."""
        return self.options.sets * max(self.bins) // self.q

    def extent(self) -> CacheExtent:
        """The caches' geometry: :attr:`requests` requests, the context and the check's
        later steps each, the runtime's block size."""
        return cache_extent(self.requests, self.q, self.options.context + CHECK_HEADROOM,
                            BLOCK_SIZE)

    def layout(self, compiled: Any) -> Layout:
        """Where the inputs point: the compiled step's caches, or (it did not load) caches
        sized the way the runtime sizes them, for the eager modes."""
        if compiled is not None:
            lim = compiled.limits
            return Layout(compiled.caches, lim.block_size, lim.width, lim.vocab)
        extent = self.extent()
        caches = allocate_caches(self.graph, extent.held_slots, extent.held_blocks, BLOCK_SIZE,
                                 self.device, torch.bfloat16)
        fill_caches(caches, self.options.seed)
        vocab = int(self.graph.values["embed_tokens"].type.shape[0])
        return Layout(caches, BLOCK_SIZE, extent.width, vocab)

    def feeds(self, layout: Layout, rows: int) -> list[Feed]:
        """The input sets of bin ``rows`` for caches laid out as ``layout``."""
        return build_feeds(rows, self.q, self.options.sets, self.options.context,
                           layout.block_size, layout.width, layout.vocab,
                           self.options.seed + rows)

    def phase_main(self) -> None:
        """The artifact as compiled: checks, floor, eager, torch.compile, replays."""
        opts = self.options
        steps = [mode for mode in ARTIFACT_MODES if mode in opts.modes]
        compiled = self.load(self.artifact) if steps else None
        failed = Timing(error="the compiled step did not load (see the notes)")
        layout = self.layout(compiled)
        eager = ReferenceExecutor(self.graph, self.weights, layout.caches, self.device,
                                  torch.bfloat16)
        calls: dict[str, Callable[[Any], Any]] = {}
        if "eager" in opts.modes:
            calls["eager"] = _logits_of(eager)
        if "torch_compile" in opts.modes:
            calls["torch_compile"] = compiled_step(eager)
        from stepgraph.runtime.progress import progress

        with progress(len(self.bins) * 4, "bench", opts.progress) as advance:
            for rows in self.bins:
                result = self.results[rows]
                feeds = self.feeds(layout, rows)
                dev_feeds = [device_feed(self.graph, f, self.device) for f in feeds]
                if compiled is not None and not self.out_of_time():
                    advance(0, f"B={rows}: check")
                    result.checks.setdefault("stepgraph", []).append(
                        self.check(compiled, self.graph, feeds[0], opts.check_steps,
                                   "first steps"))
                advance(1, f"B={rows}: floor")
                self.floor(result, eager, dev_feeds, rows)
                for mode in ("eager", "torch_compile"):
                    if mode in calls:
                        result.timings[mode] = (self.skipped() if self.out_of_time()
                                                else self.time(calls[mode], dev_feeds))
                    advance(1, f"B={rows}: {mode} done")
                warm = result.timings.get("torch_compile")
                if warm is not None and warm.warmup_s is not None:
                    self.note(f"B={rows}: torch.compile's {opts.warmup} warm-up calls (its "
                              f"compilation) took {warm.warmup_s:.1f} s; so far "
                              f"{compile_stats()}")
                for mode in steps:
                    if compiled is None:
                        result.timings[mode] = failed
                    elif self.out_of_time():
                        result.timings[mode] = self.skipped()
                    elif mode == "stepgraph":
                        self.time_compiled(compiled, result, mode, feeds)
                    else:
                        result.timings[mode] = self.time_decode_loop(compiled, feeds[0])
                advance(1, f"B={rows}: done")
                self.update()
        calls.clear()
        del eager, compiled, layout
        torch._dynamo.reset()
        _free()

    def phase_nopdl(self) -> None:
        """The spec recompiled with the PDL/prefetch pass off: a check and replays per bin."""
        opts = self.options
        if self.out_of_time():
            for rows in self.bins:
                self.results[rows].timings["stepgraph_nopdl"] = self.skipped()
            return
        if not self.artifact.document.get("options", {}).get("pdl", True):
            self.note("the artifact was compiled with the PDL pass off already: the no-PDL "
                      "row measures the same plan")
        graph = recompile_graph(self.artifact, pdl=False)
        self.note("PDL/prefetch off: the artifact's spec and deployment recompiled with "
                  "CompileOptions(pdl=False), loaded on the same weights")
        compiled = self.load(graph)
        if compiled is None:
            for rows in self.bins:
                self.results[rows].timings["stepgraph_nopdl"] = Timing(
                    error="the recompiled step did not load (see the notes)")
            return
        layout = self.layout(compiled)
        from stepgraph.runtime.progress import progress

        with progress(len(self.bins), "bench (PDL off)", opts.progress) as advance:
            for rows in self.bins:
                result = self.results[rows]
                if self.out_of_time():
                    result.timings["stepgraph_nopdl"] = self.skipped()
                    continue
                feeds = self.feeds(layout, rows)
                result.checks.setdefault("stepgraph_nopdl", []).append(
                    self.check(compiled, graph, feeds[0], 1, "first step"))
                self.time_compiled(compiled, result, "stepgraph_nopdl", feeds)
                advance(1, f"B={rows}")
                self.update()
        del compiled, layout
        _free()

    # ------------------------------------------------------------------ pieces

    def time(self, call: Callable[[Any], Any], args: list[Any]) -> Timing:
        """The timing of ``call`` over the rotating ``args`` (an error recorded, not raised)."""
        opts = self.options
        try:
            started = time.perf_counter()
            for i in range(opts.warmup):
                call(args[i % len(args)])
            synchronize(self.device)
            warmup_s = time.perf_counter() - started
            timing = Timing.of(time_calls(call, args, opts.replays, 0, self.device))
            timing.warmup_s = warmup_s
            return timing
        except Exception as error:  # a mode that fails is reported, the others still run
            _free()
            return Timing(error=_error_text(error))

    def time_compiled(self, compiled: Any, result: BinResult, mode: str, feeds: list[Feed]
                      ) -> None:
        """Replays of the compiled step as a serving loop calls it (the inputs' copy and
        the replay; the logits left in the step's output buffer, no copy of them); a second
        check after them (main mode only)."""
        from stepgraph.runtime import StepInputs

        inputs = [StepInputs.from_feed(f) for f in feeds]
        result.timings[mode] = self.time(serving_call(compiled), inputs)
        if mode == "stepgraph":
            result.checks.setdefault(mode, []).append(
                self.check(compiled, compiled.graph, feeds[0], 1,
                           f"after {self.options.replays + self.options.warmup} replays"))

    def time_decode_loop(self, compiled: Any, feed: Feed) -> Timing:
        """Replays of the compiled step as a decode loop with its sampler on the GPU runs
        them (:func:`~stepgraph.bench.protocol.decode_loop_call`)."""
        from stepgraph.runtime import StepInputs

        try:
            call = decode_loop_call(compiled, StepInputs.from_feed(feed))
        except Exception as error:
            return Timing(error=_error_text(error))
        return self.time(call, [None])

    def floor(self, result: BinResult, eager: ReferenceExecutor,
              dev_feeds: list[dict[str, torch.Tensor]], rows: int) -> None:
        """The bin's floor: the bytes of each input set with the experts its routing touches
        (the bf16 reference's routing of the same inputs), averaged over the sets."""
        counts: list[dict[str, int]] = []
        try:
            for feed in dev_feeds:
                eager.step(feed, keep_values=True)
                counts.append(touched_experts(self.graph, eager.last_values, rows))
                eager.last_values = {}
        except Exception as error:
            self.note(f"B={rows}: routing not measured ({_error_text(error)}); the floor uses "
                      f"the upper bound of touched experts")
            counts = [{}]
        finally:
            eager.last_values = {}
        sets = [step_bytes(self.graph, rows, self.options.context, c) for c in counts]
        result.floor_bytes = float(np.mean([s.total for s in sets]))
        result.floor_us = result.floor_bytes / self.report.bandwidth * 1e6
        categories = [s.by_category() for s in sets]
        result.bytes_by_category = {k: float(np.mean([c[k] for c in categories]))
                                    for k in categories[0]}
        result.exact_experts = all(s.exact_experts for s in sets)
        if result.exact_experts:
            result.touched_experts = float(np.mean([sum(c.values()) for c in counts]))

    def check(self, compiled: Any, graph: Graph, feed: Feed, steps: int, when: str) -> Check:
        """The compiled step against the float32 reference (see :class:`Check`) over ``steps``
        consecutive steps from the same caches; arena and logits poisoned with NaN first.
        Each step runs the bin's launches one by one first (reading the compiled step's expert
        choices), restores the caches, then replays the graph."""
        check = Check(steps=steps, when=when)
        copies: list[dict[str, torch.Tensor]] = []
        try:
            initial = clone_caches(compiled.caches)
            copies = [initial, clone_caches(initial), clone_caches(initial)]
            matched = fp32_reference(graph, self.weights, copies[0], self.device)
            strict = fp32_reference(graph, self.weights, copies[1], self.device)
            bf16 = ReferenceExecutor(graph, self.weights, copies[2], self.device,
                                     torch.bfloat16)
            del initial
            worst = {"matched": 0.0, "strict": 0.0, "bf16": 0.0, "replay": 0.0}
            for i in range(steps):
                routing, out, launched = self.compiled_outputs(compiled, feed)
                feed_dev = device_feed(graph, feed, self.device)
                ref_strict = strict.step(feed_dev)["logits"].float()
                with routing.forced(matched):
                    ref = matched.step(feed_dev)["logits"].float()
                check.flips += routing.flips
                check.decisions += routing.decisions
                with Routing(routing.ids).forced(bf16):
                    low = bf16.step(feed_dev)["logits"].float()
                check.nan = check.nan or bool(torch.isnan(out).any())
                for key, (a, b) in {"matched": (out, ref), "strict": (out, ref_strict),
                                    "bf16": (low, ref), "replay": (out, launched)}.items():
                    worst[key] = max(worst[key], relative_error(a, b))
                feed = next_feed(feed, self.q, compiled.limits.block_size,
                                 self.options.seed + 17 * i + 1)
            check.rel_err, check.strict_rel_err = worst["matched"], worst["strict"]
            check.eager_rel_err, check.replay_rel_err = worst["bf16"], worst["replay"]
            if not check.passed:
                print(f"bench: B={feed['tokens'].shape[0]} {check.describe()}", file=sys.stderr)
        except Exception as error:
            check.error = _error_text(error)
            print(f"bench: check ({when}) raised: {error!r}", file=sys.stderr)
        finally:
            copies.clear()
            _free()
        return check

    def compiled_outputs(self, compiled: Any, feed: Feed
                         ) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        """One step of ``compiled`` on ``feed``: its expert choices and logits from its
        launches run one by one, then (caches restored) the logits of its graph replay."""
        from stepgraph.runtime import StepInputs

        inputs = StepInputs.from_feed(feed)
        before = clone_caches(compiled.caches)
        ids, launched = launched_step(compiled, inputs)
        for name, tensor in compiled.caches.items():
            tensor.copy_(before[name])
        del before
        compiled.poison_arena()
        compiled.bindings.outputs[compiled.output_name].fill_(float("nan"))
        out = compiled.step(inputs).float().clone()
        return Routing(ids), out, launched


def _logits_of(executor: ReferenceExecutor) -> Callable[[Any], torch.Tensor]:
    """feed -> the logits of ``executor``'s step."""

    def call(feed: Any) -> torch.Tensor:
        return executor.step(feed)["logits"]

    return call


def run_bench(artifact: Artifact, path: str, options: BenchOptions,
              on_update: Callable[[BenchReport], None] | None = None) -> BenchReport:
    """Benchmark ``artifact`` (read from ``path``) as ``options`` say (CUDA, or the CPU for
    a dry run); ``on_update(report)`` runs after every bin of every phase."""
    return Session(artifact, path, options, on_update).run()
