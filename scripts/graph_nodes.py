"""What one bin's captured CUDA graph holds: its nodes counted by type (kernels, memcpy,
memset, event records and waits, ...) and every node that is not a kernel, with the kernels
before and after it: a copy or memset between two launches breaks their PDL overlap.

Usage (GPU machine): python3 scripts/graph_nodes.py ARTIFACT [--rows 1] [--dot FILE]
(``--dot``: also keep CUDA's DOT dump of the graph).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.weights import device_random_weights
from stepgraph.runtime import load

NODE = re.compile(r'^"?(?P<id>[\w]+)"?\s*\[(?P<attrs>.*)\]\s*;?\s*$')
EDGE = re.compile(r'^"?(?P<a>[\w]+)"?\s*->\s*"?(?P<b>[\w]+)"?')


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps what the debug dump needs."""

    def __init__(self) -> None:
        super().__init__(keep_graph=True)
        self.enable_debug_mode()


def _node_kind(attrs: str) -> tuple[str, str]:
    """(type, kernel name or '') from a DOT node's attributes."""
    label = attrs.split("label=", 1)[-1]
    kind = re.search(r"[A-Z][A-Z_]{2,}", label)
    name = re.search(r"(_\w+_kernel|void [\w:<>]+|\w+_kernel\w*)", label)
    return (kind.group(0) if kind else "?", name.group(0)[:40] if name else "")


def main() -> int:
    """Capture the bin with CUDA's debug mode on and summarize the graph's nodes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dot", help="also write CUDA's DOT dump of the graph here")
    args = parser.parse_args()
    torch.cuda.CUDAGraph = _DebugGraph  # type: ignore[misc]
    artifact = load_artifact(args.artifact)
    step = load(artifact, weights=device_random_weights(artifact.graph, 0), device="cuda",
                max_requests=64, progress=False)
    dot = Path(args.dot) if args.dot else Path(tempfile.mkdtemp()) / "graph.dot"
    step.plans[step.bin_for(args.rows)].graph.debug_dump(str(dot))
    kinds: dict[str, tuple[str, str]] = {}
    succ: dict[str, list[str]] = {}
    pred: dict[str, list[str]] = {}
    for line in dot.read_text().splitlines():
        line = line.strip()
        edge = EDGE.match(line)
        if edge:
            succ.setdefault(edge["a"], []).append(edge["b"])
            pred.setdefault(edge["b"], []).append(edge["a"])
            continue
        node = NODE.match(line)
        if node and "label" in node["attrs"]:
            kinds[node["id"]] = _node_kind(node["attrs"])
    print(f"bin {step.bin_for(args.rows)}: {len(kinds)} nodes: "
          + ", ".join(f"{k} {n}" for k, n in Counter(k for k, _ in kinds.values()).most_common()))
    for node_id, (kind, _) in kinds.items():
        if kind != "KERNEL":
            before = [kinds.get(p, ("?", ""))[1] or kinds.get(p, ("?", ""))[0]
                      for p in pred.get(node_id, [])]
            after = [kinds.get(s, ("?", ""))[1] or kinds.get(s, ("?", ""))[0]
                     for s in succ.get(node_id, [])]
            print(f"  {node_id:<24} {kind:<14} after {before} before {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
