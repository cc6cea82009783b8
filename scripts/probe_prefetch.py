"""Probe: how much an L2 prefetch of a projection's first weight bytes shortens it.

Usage (GPU machine): python3 scripts/probe_prefetch.py
Part 1: one split-K GEMM at one row, L2 flushed (cold), L2 hot, and after a prefetch of its
first bytes by each prefetch form (median of 30). Part 2: a CUDA graph of 8 "layers", each
in_proj (86 MiB) -> 3 RMSNorms (a stretch of small launches) -> o_proj (21 MiB), all PDL,
with and without a prefetch launch of o_proj's weights after in_proj.
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl

from stepgraph.runtime.kernels.elementwise import RmsNorm
from stepgraph.runtime.kernels.prefetch import L2Prefetch, byte_range, prefetch_lines
from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic

MIB = 2**20
GEMV_IN = (8, 1, 1, 2, 0, 4)  # the H200 table's one-row in_proj (6288 x 7168)
GEMV_O = (32, 1, 1, 2, 0, 8)  # and o_proj (7168 x 1536)
FORMS = {"line128": dict(mode=0, line=128), "sector32": dict(mode=0, line=32),
         "bulk4k": dict(mode=1, line=4096), "bulk16k": dict(mode=1, line=16384),
         "ldcg32": dict(mode=2, line=32), "ldcg128": dict(mode=2, line=128)}


def timed(before, run, trials: int = 30) -> float:
    times = []
    for _ in range(trials):
        before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def part1(dev: torch.device, flush: torch.Tensor) -> None:
    def cold() -> None:
        flush.add_(1)

    for name, (n, k), tactic in (("o_proj", (7168, 1536), GEMV_O),
                                 ("front", (3696, 7168), (16, 1, 1, 2, 0, 8))):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        gemm = SplitKGemm(x, w, out, SplitKTactic(*tactic))
        size = w.numel() * 2
        t_cold = timed(cold, gemm)
        t_hot = timed(lambda g=gemm: (cold(), g()), gemm) if size < 40 * MIB else float("nan")
        print(f"\n{name} {n}x{k} ({size / MIB:.1f} MiB): cold {t_cold:.2f} us, hot {t_hot:.2f}"
              " us")
        nbytes = min(size, 16 * MIB)
        for form, kw in FORMS.items():
            if form not in ("line128", "bulk16k"):
                continue
            for programs in (132,):
                pf = L2Prefetch([byte_range(w, 0, nbytes)], programs=programs, **kw)
                t_pf = timed(cold, pf)
                t = timed(lambda pf=pf: (cold(), pf(), torch.cuda._sleep(20000)), gemm)
                print(f"  {form:<8} programs {programs:>3}: prefetch {nbytes / MIB:4.1f} MiB "
                      f"launch {t_pf:5.2f} us; GEMM after it {t:6.2f} us (saves "
                      f"{t_cold - t:5.2f} us; the bytes at 4 TB/s: {nbytes / 4e6:4.2f} us)")


@triton.jit
def _norm_prefetch_kernel(x_ptr, w_ptr, out_ptr, H, eps, pf_ptr, pf_chunks,
                          PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, LINE: tl.constexpr,
                          MODE: tl.constexpr, AFTER: tl.constexpr):
    """An RMSNorm of one row (program 0) whose programs also issue L2 prefetches of
    ``LINE``-byte pieces of ``pf_ptr`` (a later launch's weight; ``MODE`` as
    :func:`prefetch_lines`), before its PDL wait or (``AFTER``) after it: what a short launch
    of the step would do with a prefetch folded in (no launch of its own)."""
    pid = tl.program_id(0)
    if not AFTER:
        prefetch_lines(pf_ptr, pf_chunks, pid, PROGRAMS, 1024, LINE, MODE)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    if AFTER:
        prefetch_lines(pf_ptr, pf_chunks, pid, PROGRAMS, 1024, LINE, MODE)
    if pid == 0:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        tl.store(out_ptr + offs, (x * scale * w).to(out_ptr.dtype.element_ty), mask=mask)


class NormPrefetch:
    """A prepared :func:`_norm_prefetch_kernel` launch."""

    def __init__(self, x, weight, out, target, programs: int, line: int, mode: int,
                 after: bool) -> None:
        self.x, self.weight, self.out, self.programs = x, weight, out, programs
        self.line, self.mode, self.after = line, mode, after
        self.target = target.view(-1).view(torch.uint8)
        self.chunks = self.target.numel() // line

    def __call__(self) -> None:
        _norm_prefetch_kernel[(self.programs,)](
            self.x, self.weight, self.out, self.out.shape[1], 1e-5, self.target, self.chunks,
            PROGRAMS=self.programs, BLOCK=triton.next_power_of_2(self.out.shape[1]),
            LINE=self.line, MODE=self.mode, AFTER=self.after, num_warps=4, launch_pdl=True)


def part2(dev: torch.device) -> None:
    layers = []
    for _ in range(8):
        w_in = torch.randn(6288, 7168, device=dev, dtype=torch.bfloat16)
        w_o = torch.randn(7168, 1536, device=dev, dtype=torch.bfloat16)
        layers.append((w_in, w_o))
    x = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
    h = torch.empty(1, 6288, device=dev, dtype=torch.bfloat16)
    n1 = torch.empty(1, 1536, device=dev, dtype=torch.bfloat16)
    n2 = torch.empty(1, 1536, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, 7168, device=dev, dtype=torch.bfloat16)
    norm_w = torch.randn(1536, device=dev, dtype=torch.bfloat16)

    def build(form: str | None, programs: int, smalls: int) -> list:
        launches = []
        for w_in, w_o in layers:
            launches.append(SplitKGemm(x, w_in, h, SplitKTactic(*GEMV_IN), pdl=True))
            folded = form is not None and form.startswith("fold")
            at = int(form[-1]) if folded else -1  # fold<where><line|bulk><before|after><i>
            if form is not None and not folded:
                launches.append(L2Prefetch([byte_range(w_o, 0, w_o.numel() * 2)], pdl=True,
                                           programs=programs, **FORMS[form]))
            src = h[:, :1536]
            for i in range(smalls):
                dst = n1 if i % 2 == 0 else n2
                if folded and i == at:
                    line, mode = (128, 0) if "line" in form else (4096, 1)
                    launches.append(NormPrefetch(src, norm_w, dst, w_o, programs, line, mode,
                                                 "after" in form))
                else:
                    launches.append(RmsNorm(src, norm_w, dst, 1e-5, pdl=True))
                src = dst
            launches.append(SplitKGemm(src, w_o, y, SplitKTactic(*GEMV_O), pdl=True))
        return launches

    print("\nchain of 8 layers: in_proj -> N small launches -> o_proj (CUDA graph, PDL)")
    for smalls in (3,):
        base = None
        for form, programs in ((None, 0), ("line128", 132), ("fold-line-before-0", 132),
                               ("fold-line-after-0", 132), ("fold-line-after-1", 132),
                               ("fold-line-after-2", 132), ("fold-line-after-0", 48),
                               ("fold-bulk-after-0", 132), ("fold-line-before-2", 132)):
            launches = build(form, programs, smalls)
            for launch in launches:
                launch()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for launch in launches:
                    launch()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    for launch in launches:
                        launch()
            graph.replay()
            torch.cuda.synchronize()
            t = timed(lambda: None, graph.replay, trials=50) / len(layers)
            base = t if base is None else base
            print(f"  smalls {smalls} prefetch {form or 'none':<18} programs {programs:>3}: "
                  f"{t:6.2f} us a layer ({t - base:+5.2f})")


def main() -> None:
    dev = torch.device("cuda")
    flush = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
    if "--chain-only" not in sys.argv:
        part1(dev, flush)
    del flush
    part2(dev)


if __name__ == "__main__":
    main()
