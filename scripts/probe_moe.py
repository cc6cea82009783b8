"""Probe: routed-expert block sizes of k3-rank-tp8's MoE (112 experts, top-2) and of
k3-slice-tp1's (64 experts, top-16), width 3584, expert width 3072, per row count, in CUDA
graphs of 12 launches on random routings (PDL).

Usage (GPU machine): python3 scripts/probe_moe.py [--one-row]
(``--one-row``: one row only, the MMA form against the one-row GEMV form's tiles)
"""

from __future__ import annotations

import statistics
import sys

import torch

from stepgraph.runtime.kernels.moe import MoeTactic, RoutedExperts

W, INTER = 3584, 3072
TACTICS = {  # block_m, bn_gate_up, bn_down, block_k, stages, warps
    "default": MoeTactic(),
    "st4": MoeTactic(stages=4),
    "n32": MoeTactic(block_n_gate_up=32, block_n_down=32, stages=4),
    "n32k256": MoeTactic(block_n_gate_up=32, block_n_down=32, block_k=256, stages=3),
    "n16": MoeTactic(block_n_gate_up=16, block_n_down=16, stages=4),
    "n16k256": MoeTactic(block_n_gate_up=16, block_n_down=16, block_k=256, stages=4),
    "n16k512": MoeTactic(block_n_gate_up=16, block_n_down=16, block_k=512, stages=3),
    "gu32dn16": MoeTactic(block_n_gate_up=32, block_n_down=16, block_k=256, stages=4),
    "n32w8": MoeTactic(block_n_gate_up=32, block_n_down=32, block_k=256, stages=4, warps=8),
}
ONE_ROW = {  # the H200 table's one-row MMA tactic against the one-row GEMV form
    "mma": MoeTactic(stages=4, pre=1),
    "gemv8": MoeTactic(pre=1, gemv=8),
    "gemv16": MoeTactic(pre=1, gemv=16),
    "gemv32": MoeTactic(pre=1, gemv=32),
    "g8w4": MoeTactic(pre=1, gemv=8, gemv_warps=4),
    "g16w4": MoeTactic(pre=1, gemv=16, gemv_warps=4),
    "g32w4": MoeTactic(pre=1, gemv=32, gemv_warps=4),
    "g64w8": MoeTactic(pre=1, gemv=64),
}


def main() -> None:
    if "--one-row" in sys.argv:
        probe(112, 2, ONE_ROW, (1,))
        probe(64, 16, ONE_ROW, (1,))
        return
    for experts, top_k, tactics, row_counts in (
            (112, 2, TACTICS, (1, 2, 4, 8, 16, 32, 64)),
            (64, 16, {n: TACTICS[n] for n in ("default", "st4")}, (1, 4, 16, 64))):
        probe(experts, top_k, tactics, row_counts)


def probe(E: int, TOPK: int, tactics: dict[str, MoeTactic], row_counts: tuple[int, ...]
          ) -> None:
    """One MoE configuration: a line per row count, a column per tactic."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gate_up = (torch.randn(E, 2 * INTER, W, device=dev, dtype=torch.bfloat16) * 0.02)
    down = (torch.randn(E, W, INTER, device=dev, dtype=torch.bfloat16) * 0.02)
    print(f"\n{E} experts, top-{TOPK}")
    print(f"{'rows':>4} " + " ".join(f"{n:>9}" for n in tactics) + "   (us a launch; bytes"
          " at 4.25 TB/s)")
    for rows in row_counts:
        sets = []
        for _ in range(12):
            x = torch.randn(rows, W, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(rows)]
                              ).to(torch.int32)
            wts = torch.rand(rows, TOPK, device=dev)
            sets.append((x, ids, wts, torch.empty(rows, W, device=dev, dtype=torch.bfloat16)))
        touched = sum(len(set(s[1].flatten().tolist())) for s in sets) / len(sets)
        floor = touched * 3 * INTER * W * 2 / 4.25e6
        results = []
        ref = None
        for tactic in tactics.values():
            launches = [RoutedExperts(x, ids, wts, gate_up, down, out, activation="situ",
                                      beta=4.0, beta_linear=25.0, tactic=tactic, pdl=True)
                        for x, ids, wts, out in sets]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for launch in launches:
                    launch()
                torch.cuda.synchronize()
                got = sets[0][3].float().clone()
                if ref is None:
                    ref = got
                err = float((got - ref).norm() / ref.norm())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for launch in launches:
                        launch()
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / len(launches))
            results.append((statistics.median(times), err))
        print(f"{rows:>4} " + " ".join(f"{t:9.2f}" for t, _ in results)
              + f"   floor {floor:.2f} us; max diff vs default {max(e for _, e in results):.1e}")


if __name__ == "__main__":
    main()
