"""Probe: what one launch boundary of a PDL chain costs, against the same chain handed over
by counters in global memory instead of ``griddepcontrol.wait``.

Every launch of the step's chain waits on its predecessor's whole grid with the PDL wait
(``gdc_wait``: the predecessor complete and its memory flushed). The alternative measured
here: each launch still starts early under PDL (launched when its predecessor's programs have
triggered), but instead of the wait its programs spin on a counter the predecessor's programs
add to after their last store (release; the spin's load is acquire), and the last of them to
get past leaves the counter at zero for the next replay. Both forms run the same work, a
chain of ``--links`` launches, as one captured CUDA graph:

- ``row``: one program a launch (the AttnRes step's shape): a 7168-wide row, its RMS norm;
- ``gemv``: a K x K bfloat16 matrix a launch (each its own, so the chain streams from HBM)
  times the last launch's output, ``rows`` matrix rows a program, the first chunk of the
  program's weights loaded before the wait (as the step's GEMVs do).

Prints the replay time of each form and what one boundary costs (replay / links), and
checks that both forms computed the same output.

Usage (GPU machine): python3 scripts/probe_flag_chain.py [--links 120] [--replays 30]
"""

from __future__ import annotations

import argparse
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
def _hand_over(wait_ptr, PRODUCERS: tl.constexpr, FLAG: tl.constexpr):
    """The wait of a link: the PDL wait (``FLAG`` 0), or the spin on the predecessor's
    counter, polled by an atomic (1) or an ``ld.acquire`` (2); the last program past it
    zeroes the counter and its own arrival count. The spin gives up after 2**20 polls, so a
    missing signal shows as a wrong output, not a hung GPU."""
    if FLAG == 1:
        polls = 0
        while (tl.atomic_add(wait_ptr, 0, sem="acquire", scope="gpu") < PRODUCERS) & (
                polls < 1048576):
            polls += 1
    if FLAG == 2:
        polls = 0
        while (_load_acquire(wait_ptr) < PRODUCERS) & (polls < 1048576):
            polls += 1
    if FLAG != 0:
        if tl.atomic_add(wait_ptr + 1, 1, sem="relaxed", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(wait_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(wait_ptr + 1, 0, sem="relaxed", scope="gpu")
    else:
        tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _signal(sig_ptr, anchor, FLAG: tl.constexpr):
    """A link's program counts itself in on its successor's counter after its last store."""
    if FLAG:
        arrive(sig_ptr, anchor, True)


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
                                FLAG=use_flag, SIGNAL=flag > 0, num_warps=8,
                                launch_pdl=True)
            else:
                _gemv_link[(programs,)](bufs[i], weights[i], bufs[i + 1], counters[i],
                                        counters[i + 1], k, PRODUCERS=producers, ROWS=rows,
                                        CHUNK=min(1024, k), FLAG=use_flag, SIGNAL=flag > 0,
                                        num_warps=4, launch_pdl=True)
        counters[links].zero_()  # the last link's signal has no reader (both forms alike)

    return captured_graph(run, device), bufs


FORMS = {"pdl": 0, "flag": 1, "flag-ld": 2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=120)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_flag_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cases = [("row", 0, 0), ("gemv", 1024, 8), ("gemv", 2048, 8), ("gemv", 4096, 8)]
    print(f"{'case':<22} {'form':<7} {'replay us (rounds)':<34} {'us a link':>9}  out vs pdl")
    for kind, k, rows in cases:
        name = "row 7168" if kind == "row" else f"gemv {k}x{k} ({k // rows} programs)"
        graphs = {}
        for form, flag in FORMS.items():
            try:
                graphs[form] = _chain(kind, args.links, flag, k, rows, device, seed=1)
            except Exception as exc:  # a form that does not compile here is reported, not fatal
                print(f"{name:<22} {form:<7} failed: {str(exc).splitlines()[0][:80]}")
        times: dict[str, list[float]] = {form: [] for form in graphs}
        for _ in range(args.rounds):
            for form, (graph, _) in graphs.items():
                graph.replay()
                torch.cuda.synchronize()
                times[form].append(replay_median_us(graph, args.replays))
        ref = graphs["pdl"][1][-1].float()
        for form, (_, bufs) in graphs.items():
            err = ((bufs[-1].float() - ref).norm() / ref.norm()).item()
            spread = ", ".join(f"{t:.1f}" for t in times[form])
            print(f"{name:<22} {form:<7} {spread:<34} {min(times[form]) / args.links:>9.2f}"
                  f"  {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
