"""Probe: the one-row MLA core (cache write, split-KV partial attention, LSE merge) of
k3-rank-tp8 (12 heads, 4096 cached tokens, latent 512 + 64) under split-KV tactics.

Usage (GPU machine): python3 scripts/probe_mla.py [--layers 24] [--context 4096]
A CUDA graph of ``--layers`` PDL-chained MLA cores, each over its own cache (so that the
caches do not stay in L2), is replayed back to back; us a layer (median of the replays),
and each tactic's output against the default tactic's.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from stepgraph.runtime.providers.triton_mla import mla_core_launch
from stepgraph.runtime.tune import time_launches

HEADS, LORA, ROPE, BLOCK = 12, 512, 64, 64


def main(argv: list[str] | None = None) -> int:
    """Measure the MLA core per tactic; print one line a tactic."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = -(-(args.context + 1) // BLOCK)
    attrs = {"kv_lora_rank": LORA, "eps": 1e-5, "softmax_scale": (LORA + ROPE) ** -0.5}
    layers = []
    for _ in range(args.layers):
        cache = torch.randn(blocks, BLOCK, LORA + ROPE, device=dev, dtype=torch.bfloat16)
        layers.append(dict(
            q=torch.randn(1, HEADS, LORA + ROPE, device=dev, dtype=torch.bfloat16),
            kv_a=torch.randn(1, LORA + ROPE, device=dev, dtype=torch.bfloat16),
            norm=torch.rand(LORA, device=dev, dtype=torch.bfloat16) + 0.5,
            cache=cache,
            table=torch.randperm(blocks, device=dev, dtype=torch.int32)[None, :],
        ))
    seq = torch.tensor([args.context + 1], device=dev, dtype=torch.int32)
    forms: list[dict] = [{}]
    for split, block_n, warps, stages in itertools.product((32, 64, 128, 256), (32, 64),
                                                           (4, 8), (1, 2, 3)):
        forms.append({"split": split, "block_n": block_n, "num_warps": warps,
                      "stages": stages})
    ref = None
    base = None
    for tactic in forms:
        outs = [torch.empty(1, HEADS, LORA, device=dev, dtype=torch.bfloat16)
                for _ in layers]
        launches = []
        for layer, out in zip(layers, outs, strict=True):
            table = layer["table"]
            slot = (table[0, args.context // BLOCK].long() * BLOCK
                    + args.context % BLOCK).to(torch.int32).view(1)
            ins = [layer["q"], layer["kv_a"], layer["norm"], layer["cache"], table, seq, slot]
            launches.append(mla_core_launch(attrs, ins, [out], dev, True, dict(tactic)))
        try:
            us = time_launches(launches, repeats=1, replays=args.replays)
        except Exception as exc:  # a probe reports a form that fails and goes on
            print(f"  {tactic} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        got = torch.cat([o.float() for o in outs])
        ref = got if ref is None else ref
        err = float((got - ref).norm() / ref.norm())
        base = base or us
        print(f"  {tactic or 'provider default'!s:<64} {us:6.2f} us a layer  x{base / us:4.2f}"
              f"  err vs default {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
