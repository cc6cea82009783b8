"""Probe: where a captured CUDA graph's forked side branches cost, and which form costs least.

docs/perf.md (eleventh session): a chain of 40 PDL launches replays ~12-15 us slower with one
forked branch, each further fork ~2-3 us more; k3-rank-tp8 forks the shared expert 12 times a
step. This probe captures a chain of ``--chain`` small PDL launches (RMSNorms of one
7168-wide row) with ``--forks`` branches of ``--branch`` launches (Adds, so the profile tells
them apart) forked every ``chain / forks`` launches and joined ``--join-after`` launches
later, in several forms, and prints per form the replay time (each replay synchronized;
"ahead": replays enqueued back to back, as a serving loop runs) and where the main chain's time
between its launches goes (the gap before launch 1, at the launches right after a fork, at
the launches carrying a join, everywhere else; CUDA profiler timestamps, summed a replay,
median over replays). The twentieth session's forms hand branches over by flags instead of
graph edges: joins only (as the runtime does), forks too with the side stream forked once at
the graph's root, and the branches as a second graph without hand-offs (a timing bound: the
chain's graph with no branch at all). A second graph *with* flag hand-offs hung in this
probe's warm-up (likely: a spin waiting on a launch not yet enqueued while that kernel's
first load waited for the GPU), so it is not a form here; the runtime's form of it, which
enqueues a waiter only after its signaller, ran (docs/perf.md, twentieth session).

Usage (GPU machine): python3 scripts/probe_forks.py [--chain 120] [--forks 12] [--replays 20]
[--forms NAME ...]
(It replaces scripts/probe_graph_start.py, the eleventh session's probe of one fork's place:
``--chain 40`` and the forms with one fork, ``at=(k,)``.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from stepgraph.runtime.kernels.elementwise import Add, RmsNorm
from stepgraph.runtime.kernels.sync import await_signal, signal_kernel
from stepgraph.runtime.side_stream import fork, join, side_stream
from stepgraph.runtime.tune import captured_graph, replay_median_us

WIDTH = 7168


@triton.jit
def _flag_rmsnorm_kernel(x_ptr, w_ptr, out_ptr, fork_ptr, join_ptr, H, eps,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr, SIGNAL: tl.constexpr,
                         WAIT: tl.constexpr):
    """The chain's RMSNorm of one row, with flag hand-offs: ``WAIT`` spins on a branch's
    flag at ``join_ptr`` before the PDL wait (as the runtime's AttnRes step does);
    ``SIGNAL`` sets a fork flag at ``fork_ptr`` after it (every earlier chain launch has
    completed then: the branch may read their outputs)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WAIT:
        await_signal(join_ptr, 1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SIGNAL:
        tl.atomic_xchg(fork_ptr, 1, sem="release", scope="gpu")
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(out_ptr + offs, (x * scale * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _await_kernel(flag_ptr):
    """A flag-forked branch's first launch: spin until the chain set the fork flag (then
    clear it)."""
    await_signal(flag_ptr, 1)


class _FlagNorm:
    """One launch of :func:`_flag_rmsnorm_kernel` (a one-row chain RMSNorm)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool,
                 fork_flag: torch.Tensor | None, join_flag: torch.Tensor | None) -> None:
        self.x, self.w, self.out, self.pdl = x, w, out, pdl
        self.fork_flag, self.join_flag = fork_flag, join_flag

    def __call__(self) -> None:
        flag = self.out  # unused pointer where a flag is off
        _flag_rmsnorm_kernel[(1,)](
            self.x, self.w, self.out, flag if self.fork_flag is None else self.fork_flag,
            flag if self.join_flag is None else self.join_flag, WIDTH, 1e-5,
            BLOCK=triton.next_power_of_2(WIDTH), USE_PDL=self.pdl,
            SIGNAL=self.fork_flag is not None, WAIT=self.join_flag is not None,
            num_warps=8, launch_pdl=self.pdl)


@dataclass(frozen=True)
class Form:
    """One graph form: how the branches are launched and joined."""

    side_pdl: bool = True  # the branch's launches after its first use PDL
    first_side_pdl: bool = False  # the branch's first launch too (its edge is a full one)
    join_at_end: bool = False  # every branch joined once, after the chain
    root_branch: bool = False  # one more branch forked before launch 0, joined at the end
    pdl_after_join: bool = True  # the launch carrying a join is a PDL launch
    at: tuple[int, ...] | None = None  # the fork points (None: every chain / forks launches)
    branch: int | None = None  # launches a branch (None: --branch)
    flag_joins: bool = False  # joins by flags the reader spins on (the runtime's signal)
    side_graph: bool = False  # the branches in a second graph on the side stream, without
    # forks or joins (timing only: the chain's graph as if it had no branches)
    flag_forks: bool = False  # one graph, the side stream forked once at its root: each
    # branch waits on a flag the chain's launch after its fork point sets after its wait


FORMS = {
    "one chain": Form(at=()),
    "one fork": Form(first_side_pdl=True, at=(0,)),
    "one fork after kernel 20": Form(first_side_pdl=True, at=(20,)),
    "forks (as the runtime)": Form(first_side_pdl=True),
    "forks, branch's first launch no PDL": Form(),
    "forks, branch without PDL": Form(side_pdl=False),
    "forks, joined at the end": Form(first_side_pdl=True, join_at_end=True),
    "forks + a branch at the root": Form(first_side_pdl=True, root_branch=True),
    "forks, no PDL on the join launch": Form(first_side_pdl=True, pdl_after_join=False),
    "2 forks (0, 60)": Form(first_side_pdl=True, at=(0, 60)),
    "2 forks (0, 10)": Form(first_side_pdl=True, at=(0, 10)),
    "2 forks (10, 20)": Form(first_side_pdl=True, at=(10, 20)),
    "2 forks (30, 40)": Form(first_side_pdl=True, at=(30, 40)),
    "4 forks (0, 10, 20, 30)": Form(first_side_pdl=True, at=(0, 10, 20, 30)),
    "11 forks from 10": Form(first_side_pdl=True, at=tuple(range(10, 120, 10))),
    "forks, branches of 1 launch": Form(first_side_pdl=True, branch=1),
    "forks, flag joins (as the runtime now)": Form(first_side_pdl=True, flag_joins=True),
    "root fork only, flag forks and joins": Form(first_side_pdl=True, flag_forks=True),
    "second graph, no hand-offs (timing)": Form(first_side_pdl=True, side_graph=True),
}


@dataclass
class Run:
    """A form's launches: ``main`` captured on the current stream; ``side`` (a second graph
    on the side stream, or None); the chain positions right after a fork and those that
    carry a join."""

    main: Callable[[], None]
    side: Callable[[], None] | None
    after_fork: set[int]
    joins: set[int]


def _graph_run(dev: torch.device, length: int, forks: int, branch: int, join_after: int,
               form: Form) -> Run:
    """The launches of one form."""
    rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16) for _ in range(length + 1)]
    weight = torch.ones(WIDTH, device=dev, dtype=torch.bfloat16)
    every = max(1, length // max(1, forks))
    at = list(range(0, length, every)) if form.at is None else list(form.at)
    branch = form.branch or branch
    join_of = {i: i + join_after for i in at
               if i + join_after < length and not form.join_at_end}
    joins = set(join_of.values())
    flags = form.flag_joins or form.flag_forks
    fork_flags = {i: torch.zeros(2, device=dev, dtype=torch.int32) for i in at}
    join_flags = {j: torch.zeros(2, device=dev, dtype=torch.int32) for j in joins}
    main = []
    for i in range(length):
        pdl = i > 0 and (form.pdl_after_join or i not in joins)
        signals = form.flag_forks and i - 1 in at
        if flags:
            main.append(_FlagNorm(rows[i], weight, rows[i + 1], pdl,
                                  fork_flags[i - 1] if signals else None,
                                  join_flags.get(i) if i in joins else None))
        else:
            main.append(RmsNorm(rows[i], weight, rows[i + 1], 1e-5, pdl=pdl))
    side_rows = [torch.randn(1, WIDTH, device=dev, dtype=torch.bfloat16)
                 for _ in range(branch + 1)]
    side = [Add([side_rows[i], side_rows[i]], side_rows[i + 1],
                pdl=form.side_pdl and (i > 0 or form.first_side_pdl)) for i in range(branch)]
    root = Add([side_rows[0], side_rows[0]], side_rows[1], pdl=False)

    def branch_launches(i: int, wait: bool) -> None:
        """Branch ``i``'s launches: the fork flag awaited first (``wait``), the join flag
        set after (flag joins)."""
        if wait:
            _await_kernel[(1,)](fork_flags[i])
        for launch in side:
            launch()
        if flags and i in join_of:
            signal_kernel[(1,)](join_flags[join_of[i]])

    after_fork = {i + 1 for i in at}
    if form.side_graph:
        def side_run() -> None:
            for i in at:
                branch_launches(i, wait=False)

        return Run(lambda: [launch() for launch in main], side_run, after_fork, joins)

    def flag_run() -> None:
        current, side_s = torch.cuda.current_stream(dev), side_stream(dev)
        capturing = torch.cuda.is_current_stream_capturing()
        side_s.wait_stream(current)  # the root fork
        for i, launch in enumerate(main):
            launch()
            if i - 1 in at:  # after the launch that sets the fork flag
                if not capturing:  # eager: never spin on a launch not yet enqueued
                    side_s.wait_stream(current)
                with torch.cuda.stream(side_s):
                    branch_launches(i - 1, wait=True)
        current.wait_stream(side_s)

    if form.flag_forks:
        return Run(flag_run, None, after_fork, joins)

    def run() -> None:
        if form.root_branch:
            side_stream(dev).wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side_stream(dev)):
                root()
        for i, launch in enumerate(main):
            if i in joins and not form.flag_joins:
                join(dev)
            launch()
            if i in at:
                fork(dev, lambda i=i: branch_launches(i, wait=False))
        if form.root_branch:
            torch.cuda.current_stream(dev).wait_stream(side_stream(dev))
        join(dev)

    return Run(run, None, after_fork, joins)


class TwoGraphs:
    """The chain's graph replayed on the current stream and the branches' graph on the side
    stream after an event recorded before it (so a replay's side graph starts once the
    previous replay's chain has ended)."""

    def __init__(self, main: torch.cuda.CUDAGraph, side: torch.cuda.CUDAGraph,
                 dev: torch.device) -> None:
        self.main, self.side, self.dev = main, side, dev
        self.stream = side_stream(dev)

    def replay(self) -> None:
        """Enqueue one replay of both."""
        current = torch.cuda.current_stream(self.dev)
        self.stream.wait_stream(current)
        self.main.replay()
        with torch.cuda.stream(self.stream):
            self.side.replay()

    def finish(self) -> None:
        """Make the current stream wait for the side graph's last replay."""
        torch.cuda.current_stream(self.dev).wait_stream(self.stream)


def _captured(run: Run, dev: torch.device) -> torch.cuda.CUDAGraph | TwoGraphs:
    if run.side is None:
        return captured_graph(run.main, dev)
    side = side_stream(dev)
    for _ in range(2):  # compile and warm: both streams enqueued before either is waited on
        side.wait_stream(torch.cuda.current_stream(dev))
        run.main()
        with torch.cuda.stream(side):
            run.side()
        torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    main_graph, side_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(main_graph):
        run.main()
    capture = torch.cuda.Stream(device=dev)
    with torch.cuda.graph(side_graph, stream=capture):
        run.side()
    return TwoGraphs(main_graph, side_graph, dev)


def _replay_sync(graph: torch.cuda.CUDAGraph | TwoGraphs) -> None:
    graph.replay()
    if isinstance(graph, TwoGraphs):
        graph.finish()


@dataclass
class _Joined:
    """A replay of ``graph`` that ends on the current stream (a second graph joined)."""

    graph: torch.cuda.CUDAGraph | TwoGraphs

    def replay(self) -> None:
        _replay_sync(self.graph)


def _measure(graph: torch.cuda.CUDAGraph | TwoGraphs, replays: int, after_fork: set[int],
             joins: set[int]) -> dict[str, float]:
    """Median replay us and the main chain's gaps a replay, by where they sit."""
    replay = replay_median_us(_Joined(graph), replays)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    if isinstance(graph, TwoGraphs):
        graph.finish()
    end.record()
    end.synchronize()
    ahead = start.elapsed_time(end) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            _replay_sync(graph)
            torch.cuda.synchronize()
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
    main = [(s, e) for s, e, name in events if "rmsnorm" in name]
    per = len(main) // replays
    parts: dict[str, list[float]] = {"first": [], "after fork": [], "join": [], "other": []}
    for r in range(replays):
        one = main[r * per:(r + 1) * per]
        sums = dict.fromkeys(parts, 0.0)
        for i in range(1, len(one)):
            gap = one[i][0] - one[i - 1][1]
            key = ("first" if i == 1 else "join" if i in joins
                   else "after fork" if i in after_fork else "other")
            sums[key] += gap
        for key, value in sums.items():
            parts[key].append(value)
    out = {key: statistics.median(values) for key, values in parts.items()}
    out["replay"] = replay
    out["ahead"] = ahead
    out["span"] = statistics.median(main[r * per + per - 1][1] - main[r * per][0]
                                    for r in range(replays))
    return out


def main() -> int:
    """Capture and time each graph form."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=120)
    parser.add_argument("--forks", type=int, default=12)
    parser.add_argument("--branch", type=int, default=3)
    parser.add_argument("--join-after", type=int, default=6)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--forms", nargs="*", default=None,
                        help="only the forms whose name contains one of these strings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"chain {args.chain}, forks {args.forks}, branch {args.branch}, "
          f"joined {args.join_after} later; us a replay (gaps: main chain, summed)")
    print(f"{'graph':<40} {'replay':>8} {'ahead':>8} {'span':>8} {'first':>7} {'@fork':>7} "
          f"{'@join':>7} {'other':>7}")
    for name, form in FORMS.items():
        if args.forms is not None and not any(part in name for part in args.forms):
            continue
        run = _graph_run(dev, args.chain, args.forks, args.branch, args.join_after, form)
        m = _measure(_captured(run, dev), args.replays, run.after_fork, run.joins)
        print(f"{name:<40} {m['replay']:>8.1f} {m['ahead']:>8.1f} {m['span']:>8.1f} "
              f"{m['first']:>7.2f} {m['after fork']:>7.2f} {m['join']:>7.2f} "
              f"{m['other']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
