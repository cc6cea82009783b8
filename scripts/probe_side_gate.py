"""Probe: does a projection that the attention reads only at its end (KDA's output gate g,
1536 x 7168 of in_proj's 6288 rows) gain by running on the side stream, beside the KDA chain's
latency-bound launches, instead of inside in_proj?

Usage (GPU machine): python3 scripts/probe_side_gate.py [--layers 9] [--smalls 4]
A CUDA graph of ``--layers`` layers shaped as k3-rank-tp8's KDA layers at one row, every
launch PDL, GEMVs with the H200 table's one-row tactics:

    norm -> in_proj -> smalls x N (the KDA chain) -> o_proj -> norm -> front
         (fork: shared gate_up -> small -> shared down) -> small (router) -> experts'
         gate_up (88 MB) -> down (44 MB) -> (join) routed_up

Forms: g inside in_proj (as the step runs today); g on the side stream forked after in_proj
and joined before the chain's last small launch (the KDA output norm, its reader); the same
forked before in_proj; the first form without the shared expert's branch (what the branch
costs); and an L2 prefetch of o_proj's weights (``prefetch.global.L2``, 132 / 32 / 8
programs) forked after in_proj, beside the chain. Prints us a layer (median replay / layers)
for each of ``--rounds`` rounds. docs/perf.md, seventeenth session, has the numbers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stepgraph.runtime.kernels.elementwise import RmsNorm
from stepgraph.runtime.kernels.prefetch import L2Prefetch, byte_range
from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic
from stepgraph.runtime.side_stream import fork, join
from stepgraph.runtime.tune import captured_graph, replay_median_us

HIDDEN = 7168
TACTICS = {  # one-row rows of stepgraph/data/tactics/h200.yaml (the 4752-row in_proj: in_proj's)
    "in_proj": (8, 1, 1, 2, 0, 4), "o_proj": (32, 1, 1, 2, 0, 8), "front": (16, 1, 1, 2, 0, 8),
    "g": (8, 1, 1, 2, 0, 8), "shared_gate_up": (8, 1, 1, 2, 0, 8),
    "shared_down": (32, 1, 1, 2, 0, 8), "experts_gate_up": (16, 1, 1, 2, 0, 8),
    "experts_down": (16, 1, 1, 2, 0, 8), "routed_up": (32, 1, 1, 2, 0, 8),
}


@dataclass(frozen=True)
class Form:
    """Where the output gate's rows are computed."""

    g_side: bool = False  # g on the side stream (else inside in_proj)
    g_fork_before: bool = False  # forked before in_proj (else after it)
    shared_branch: bool = True  # the shared expert forked beside the MoE
    prefetch_o: int = 0  # programs of an L2 prefetch of o_proj's weights forked after in_proj
    prefetch_line: int = 128  # its bytes a prefetch (mode 0: prefetch.global.L2)


FORMS = {
    "g inside in_proj (today)": Form(),
    "g on the side stream after in_proj": Form(g_side=True),
    "g on the side stream before in_proj": Form(g_side=True, g_fork_before=True),
    "g inside, no shared branch": Form(shared_branch=False),
    "o_proj prefetched beside the chain, 132 programs": Form(prefetch_o=132),
    "o_proj prefetched beside the chain, 32 programs": Form(prefetch_o=32),
    "o_proj prefetched beside the chain, 8 programs": Form(prefetch_o=8),
}


class _Buffers:
    """Rows and weights of one layer (weights random BF16, rows small random values)."""

    def __init__(self, dev: torch.device) -> None:
        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)

        self.weights = {"in_proj": w(6288, HIDDEN), "in_proj_no_g": w(4752, HIDDEN),
                        "g": w(1536, HIDDEN), "o_proj": w(HIDDEN, 1536),
                        "front": w(3696, HIDDEN), "shared_gate_up": w(1536, HIDDEN),
                        "shared_down": w(HIDDEN, 768), "experts_gate_up": w(12288, 3584),
                        "experts_down": w(3584, 6144), "routed_up": w(HIDDEN, 3584)}


def _row(dev: torch.device, width: int) -> torch.Tensor:
    return torch.randn(1, width, device=dev).to(torch.bfloat16)


def _layer_launches(dev: torch.device, buf: _Buffers, form: Form, smalls: int
                    ) -> Callable[[], None]:
    """One layer's launches, as a function that enqueues them (forks and joins included)."""
    wt = buf.weights
    x, h = _row(dev, HIDDEN), _row(dev, 6288)
    gate, chain = _row(dev, 1536), [_row(dev, 1536) for _ in range(smalls + 1)]
    y, m, f = _row(dev, HIDDEN), _row(dev, HIDDEN), _row(dev, 3696)
    sgu, sact, sd = _row(dev, 1536), _row(dev, 1536), _row(dev, HIDDEN)
    r, egu, ed, out = _row(dev, 3584), _row(dev, 12288), _row(dev, 3584), _row(dev, HIDDEN)
    ones = {n: torch.ones(n, device=dev, dtype=torch.bfloat16) for n in (HIDDEN, 1536, 3584)}

    def gemv(name: str, xin: torch.Tensor, weight: torch.Tensor, o: torch.Tensor,
             pdl: bool = True) -> SplitKGemm:
        return SplitKGemm(xin, weight, o, SplitKTactic(*TACTICS[name]), pdl=pdl)

    norm_in = RmsNorm(out, ones[HIDDEN], x, 1e-5, pdl=True)
    in_proj = gemv("in_proj", x, wt["in_proj_no_g" if form.g_side else "in_proj"],
                   h[:, :4752] if form.g_side else h)
    g_launch = gemv("g", x, wt["g"], gate)
    prefetch = L2Prefetch([byte_range(wt["o_proj"], 0, wt["o_proj"].numel() * 2)],
                          programs=max(1, form.prefetch_o), line=form.prefetch_line)
    chain_launches = [RmsNorm(chain[i], ones[1536], chain[i + 1], 1e-5, pdl=True)
                      for i in range(smalls)]
    o_proj = gemv("o_proj", chain[-1], wt["o_proj"], y)
    norm_mlp = RmsNorm(y, ones[HIDDEN], m, 1e-5, pdl=True)
    front = gemv("front", m, wt["front"], f)
    shared = [gemv("shared_gate_up", m, wt["shared_gate_up"], sgu),
              RmsNorm(sgu, ones[1536], sact, 1e-5, pdl=True),
              gemv("shared_down", sact[:, :768], wt["shared_down"], sd)]
    router = RmsNorm(f[:, :3584], ones[3584], r, 1e-5, pdl=True)
    experts = [gemv("experts_gate_up", r, wt["experts_gate_up"], egu),
               gemv("experts_down", egu[:, :6144], wt["experts_down"], ed)]
    routed_up = gemv("routed_up", ed, wt["routed_up"], out)

    def run() -> None:
        norm_in()
        if form.g_side and form.g_fork_before:
            fork(dev, g_launch)
        in_proj()
        if form.g_side and not form.g_fork_before:
            fork(dev, g_launch)
        if form.prefetch_o:
            fork(dev, prefetch)
        for i, launch in enumerate(chain_launches):
            if form.g_side and i == smalls - 1:
                join(dev)
            launch()
        o_proj()
        norm_mlp()
        front()
        if form.shared_branch:
            fork(dev, lambda: [launch() for launch in shared])
        router()
        for launch in experts:
            launch()
        join(dev)
        routed_up()

    return run


def main() -> int:
    """Capture and time each form, twice in turn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--smalls", type=int, default=4)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    buffers = [_Buffers(dev) for _ in range(args.layers)]
    graphs = {}
    for name, form in FORMS.items():
        layers = [_layer_launches(dev, buf, form, args.smalls) for buf in buffers]
        graphs[name] = captured_graph(lambda layers=layers: [run() for run in layers], dev)
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            for _ in range(3):
                graph.replay()
            times[name].append(replay_median_us(graph, args.replays) / args.layers)
    print(f"{args.layers} layers, {args.smalls} small launches in the KDA chain; us a layer")
    for name, values in times.items():
        print(f"  {name:<40} " + "  ".join(f"{v:7.2f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
