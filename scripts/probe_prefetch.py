"""Probe: how much an L2 prefetch of a projection's first weight bytes shortens it.

Usage (GPU machine): python3 scripts/probe_prefetch.py
Part 1: one split-K GEMM at one row, L2 flushed (cold), L2 hot, and after a prefetch of its
first bytes by each prefetch form (median of 30). Part 2: a CUDA graph of 8 "layers", each
in_proj (86 MiB) -> 3 RMSNorms (a stretch of small launches) -> o_proj (21 MiB), all PDL,
with and without a prefetch launch of o_proj's weights after in_proj.
"""

from __future__ import annotations

import statistics

import torch

from stepgraph.runtime.kernels.elementwise import RmsNorm
from stepgraph.runtime.kernels.prefetch import L2Prefetch, byte_range
from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic

MIB = 2**20
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

    for name, (n, k), tactic in (("o_proj", (7168, 1536), (64, 8, 1, 4)),
                                 ("front", (3696, 7168), (64, 8, 4, 4))):
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
            for programs in (66, 132, 264):
                pf = L2Prefetch([byte_range(w, 0, nbytes)], programs=programs, **kw)
                t_pf = timed(cold, pf)
                t = timed(lambda pf=pf: (cold(), pf(), torch.cuda._sleep(20000)), gemm)
                print(f"  {form:<8} programs {programs:>3}: prefetch {nbytes / MIB:4.1f} MiB "
                      f"launch {t_pf:5.2f} us; GEMM after it {t:6.2f} us (saves "
                      f"{t_cold - t:5.2f} us; the bytes at 4 TB/s: {nbytes / 4e6:4.2f} us)")


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
            launches.append(SplitKGemm(x, w_in, h, SplitKTactic(64, 8, 2, 4), pdl=True))
            if form is not None:
                launches.append(L2Prefetch([byte_range(w_o, 0, w_o.numel() * 2)], pdl=True,
                                           programs=programs, **FORMS[form]))
            src = h[:, :1536]
            for i in range(smalls):
                dst = n1 if i % 2 == 0 else n2
                launches.append(RmsNorm(src, norm_w, dst, 1e-5, pdl=True))
                src = dst
            launches.append(SplitKGemm(src, w_o, y, SplitKTactic(64, 8, 1, 4), pdl=True))
        return launches

    print("\nchain of 8 layers: in_proj -> N small launches -> o_proj (CUDA graph, PDL)")
    for smalls in (1, 3, 6):
        base = None
        for form, programs in ((None, 0), ("line128", 132), ("sector32", 132),
                               ("bulk4k", 132), ("bulk16k", 66), ("ldcg32", 132),
                               ("ldcg128", 132)):
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
            print(f"  smalls {smalls} prefetch {form or 'none':<8} programs {programs:>3}: "
                  f"{t:6.2f} us a layer ({t - base:+5.2f})")


def main() -> None:
    dev = torch.device("cuda")
    flush = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
    part1(dev, flush)
    del flush
    part2(dev)


if __name__ == "__main__":
    main()
