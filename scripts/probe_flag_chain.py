"""Probe: what one launch boundary of a PDL chain costs, against the same chain handed over
by counters in global memory instead of ``griddepcontrol.wait``.

Every launch of the step's chain waits on its predecessor's whole grid with the PDL wait
(``gdc_wait``: the predecessor complete and its memory flushed). The alternative measured
here: each launch still starts early under PDL (launched when its predecessor's programs have
triggered), but instead of the wait its programs spin on a counter the predecessor's programs
add to after their last store (release; the spin's load is acquire), and the last of them to
get past leaves the counter at zero for the next replay. Every form runs the same work, a
chain of ``--links`` launches, as one captured CUDA graph:

- ``row``: one program a launch (the AttnRes step's shape): a 7168-wide row, its RMS norm;
- ``gemv``: a K x K bfloat16 matrix a launch (each its own, so the chain streams from HBM)
  times the last launch's output, ``rows`` matrix rows a program, the first chunk of the
  program's weights loaded before the wait (as the step's GEMVs do).

The flag forms differ in how they poll and signal (``FORMS``, ``_hand_over``); ``no-wait``
runs the links with no hand-over at all, the bound of what any hand-over can save. Prints the
replay time of each form and what one boundary costs (replay / links), and checks that each
form computed the same output as the PDL form.

Usage (GPU machine): python3 scripts/probe_flag_chain.py [--links 120] [--replays 30]
[--cases 0,1] [--forms pdl,flag-t0,...]; ``--case N`` runs one case in this process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import triton
import triton.language as tl

from stepgraph.runtime.kernels.sync import arrive
from stepgraph.runtime.tune import captured_graph, replay_median_us


@triton.jit
def _load_acquire(ptr):
    """``ld.acquire.gpu`` of one int32 (a plain load, not an atomic read-modify-write)."""
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_thread0(ptr, target):
    """Thread 0 alone polls ``ptr`` with ``ld.acquire.gpu`` until it holds ``target`` or more
    (giving up after 2**20 polls); the caller's barrier then holds the other threads."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 v, n, t;
        mov.u32 n, 0;
        mov.u32 t, %tid.x;
        setp.ne.u32 p, t, 0;
        @p bra DONE;
        WAIT:
        ld.global.acquire.gpu.b32 v, [$1];
        add.u32 n, n, 1;
        setp.ge.u32 p, n, 1048576;
        @p bra DONE;
        setp.lt.s32 p, v, $2;
        @p bra WAIT;
        DONE:
        mov.u32 $0, 0;
        }""", "=r,l,r", [ptr, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _release_thread0(ptr, anchor):
    """Thread 0 adds 1 at ``ptr`` with ``red.release.gpu`` (after the caller's barrier: the
    release covers every thread's stores, as CUTLASS's semaphore does)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p red.release.gpu.global.add.s32 [$1], 1;
        mov.u32 $0, 0;
        }""", "=r,l,r", [ptr, anchor], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _count_past(wait_ptr):
    """Count this program past the spin; the last of the launch's programs zeroes the
    counter and the count for the next replay."""
    if tl.atomic_add(wait_ptr + 1, 1, sem="relaxed", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(wait_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(wait_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _hand_over(wait_ptr, PRODUCERS: tl.constexpr, FLAG: tl.constexpr):
    """The wait of a link: the PDL wait (``FLAG`` 0), or the spin on the predecessor's
    counter, polled in every thread by an atomic (1) or an ``ld.acquire`` (2), or by thread 0
    alone then a barrier (3); the last program past it zeroes the counter and its own
    arrival count. The spin gives up after 2**20 polls, so a missing signal shows as a wrong
    output, not a hung GPU."""
    if FLAG == 3:
        _spin_thread0(wait_ptr, tl.full([], PRODUCERS, tl.int32))
        tl.debug_barrier()
    if FLAG == 1:
        polls = 0
        while (tl.atomic_add(wait_ptr, 0, sem="acquire", scope="gpu") < PRODUCERS) & (
                polls < 1048576):
            polls += 1
    if FLAG == 2:
        polls = 0
        while (_load_acquire(wait_ptr) < PRODUCERS) & (polls < 1048576):
            polls += 1
    if (FLAG != 0) & (FLAG != 4):
        _count_past(wait_ptr)
    if FLAG == 0:
        tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _signal(sig_ptr, anchor, FLAG: tl.constexpr):
    """A link's program counts itself in on its successor's counter after its last store:
    a fence in every thread, a barrier and an acq_rel atomic (``FLAG`` 1), or a barrier and
    thread 0's release reduction (2)."""
    if FLAG == 1:
        arrive(sig_ptr, anchor, True)
    if FLAG == 2:
        tl.debug_barrier()
        _release_thread0(sig_ptr, tl.full([], 0, tl.int32))


@triton.jit
def _row_link(x_ptr, y_ptr, wait_ptr, sig_ptr, H, PRODUCERS: tl.constexpr,
              BLOCK: tl.constexpr, FLAG: tl.constexpr, SIGNAL: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    _hand_over(wait_ptr, PRODUCERS, FLAG)
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / H + 1e-5) + 0.01
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    _signal(sig_ptr, y, SIGNAL)


@triton.jit
def _gemv_link(x_ptr, w_ptr, y_ptr, wait_ptr, sig_ptr, K, PRODUCERS: tl.constexpr,
               ROWS: tl.constexpr, CHUNK: tl.constexpr, FLAG: tl.constexpr,
               SIGNAL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    w_rows = w_ptr + rows[:, None] * K + cols[None, :]
    w0 = tl.load(w_rows)
    _hand_over(wait_ptr, PRODUCERS, FLAG)
    acc = w0.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :]
    for start in tl.range(CHUNK, K, CHUNK, num_stages=2):
        w = tl.load(w_rows + start)
        acc += w.to(tl.float32) * tl.load(x_ptr + start + cols).to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    _signal(sig_ptr, y, SIGNAL)


def _chain(kind: str, links: int, flag: int, k: int, rows: int, device: torch.device,
           seed: int) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """The chain's graph and its buffers (the last one is the output)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = 7168 if kind == "row" else k
    bufs = [torch.randn(width, device=device, generator=gen).to(torch.bfloat16)
            for _ in range(links + 1)]
    counters = torch.zeros(links + 1, 2, dtype=torch.int32, device=device)
    weights = ([(torch.randn(k, k, device=device, generator=gen) / k ** 0.5)
                .to(torch.bfloat16) for _ in range(links)] if kind == "gemv" else [])
    programs = 1 if kind == "row" else k // rows

    def run() -> None:
        for i in range(links):
            # link 0 waits the PDL way in both forms (nothing signals before it); in the
            # flag form every link signals, link 0 too
            use_flag = flag if i > 0 else 0
            producers = 1 if i == 0 else programs
            if kind == "row":
                _row_link[(1,)](bufs[i], bufs[i + 1], counters[i], counters[i + 1], width,
                                PRODUCERS=producers, BLOCK=triton.next_power_of_2(width),
                                FLAG=use_flag, SIGNAL=SIGNALS[flag], num_warps=8,
                                launch_pdl=True)
            else:
                _gemv_link[(programs,)](bufs[i], weights[i], bufs[i + 1], counters[i],
                                        counters[i + 1], k, PRODUCERS=producers, ROWS=rows,
                                        CHUNK=min(1024, k), FLAG=use_flag,
                                        SIGNAL=SIGNALS[flag], num_warps=4, launch_pdl=True)
        counters[links].zero_()  # the last link's signal has no reader (both forms alike)

    return captured_graph(run, device), bufs


# "no-wait" is not a hand-over (its links race, its output is not checked): the bound of
# what any hand-over can save, the chain's launches and work with no wait at all
FORMS = {"pdl": 0, "flag": 1, "flag-ld": 2, "flag-t0": 3, "no-wait": 4}
SIGNALS = {0: 0, 1: 1, 2: 1, 3: 2, 4: 0}  # the signal form each wait form pairs with
CASES = [("row", 0, 0), ("gemv", 1024, 8), ("gemv", 2048, 8), ("gemv", 4096, 8)]


def _run_case(case: int, links: int, replays: int, rounds: int, forms: list[str]) -> None:
    """Time and check the given forms of one case (a row of the table each)."""
    device = torch.device("cuda")
    kind, k, rows = CASES[case]
    name = "row 7168" if kind == "row" else f"gemv {k}x{k} ({k // rows} programs)"
    graphs = {}
    for form in forms:
        flag = FORMS[form]
        try:
            graphs[form] = _chain(kind, links, flag, k, rows, device, seed=1)
        except Exception as exc:  # a form that does not compile here is reported, not fatal
            print(f"{name:<30} {form:<7} failed: {str(exc).splitlines()[0][:80]}", flush=True)
    times: dict[str, list[float]] = {form: [] for form in graphs}
    for _ in range(rounds):
        for form, (graph, _) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            times[form].append(replay_median_us(graph, replays))
    ref = graphs["pdl"][1][-1].float() if "pdl" in graphs else None
    for form, (_, bufs) in graphs.items():
        err = float("nan") if ref is None else ((bufs[-1].float() - ref).norm() / ref.norm()).item()
        spread = ", ".join(f"{t:.1f}" for t in times[form])
        print(f"{name:<30} {form:<7} {spread:<34} {min(times[form]) / links:>9.2f}  {err:.1e}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=120)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", type=int, default=None, choices=range(len(CASES)),
                        help="run only this case (an index into CASES) in this process")
    parser.add_argument("--cases", default="0,1",
                        help="cases run by default, indices into CASES (the 2048 and 4096 "
                             "GEMVs, 2 and 3, fault or hang with all forms in one process: "
                             "docs/perf.md, twenty-sixth session)")
    parser.add_argument("--forms", default=",".join(FORMS),
                        help=f"comma-separated forms to run, of {', '.join(FORMS)}")
    args = parser.parse_args(argv)
    forms = [form for form in args.forms.split(",") if form]
    unknown = [form for form in forms if form not in FORMS]
    if unknown:
        print(f"probe_flag_chain: unknown form {unknown[0]!r}; choose from {', '.join(FORMS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("probe_flag_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = [index for index in args.cases.split(",") if index]
    if any(not index.isdigit() or int(index) >= len(CASES) for index in cases):
        print(f"probe_flag_chain: --cases takes indices 0..{len(CASES) - 1}", file=sys.stderr)
        return 2
    if args.case is not None:
        _run_case(args.case, args.links, args.replays, args.rounds, forms)
        return 0
    print(f"{'case':<30} {'form':<7} {'replay us (rounds)':<34} {'us a link':>9}  out vs pdl",
          flush=True)
    failed = 0
    for case in map(int, cases):
        # each case in its own process: a fault in one form's chain poisons the CUDA context
        done = subprocess.run([sys.executable, __file__, "--case", str(case), "--links",
                               str(args.links), "--replays", str(args.replays), "--rounds",
                               str(args.rounds), "--forms", ",".join(forms)], check=False)
        if done.returncode != 0:
            print(f"case {CASES[case]}: exit {done.returncode}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
