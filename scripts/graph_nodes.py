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

NODE = re.compile(r'"(?P<id>\w+)"\[[^\]]*?label="\{(?P<kind>\w+)\s*\n\| \{ID \| \d+ '
                  r'\(topoId: \d+\) \| (?P<what>[^\\}]*)')
EDGE = re.compile(r'"(?P<a>\w+)"\s*->\s*"(?P<b>\w+)"')


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps what the debug dump needs."""

    def __init__(self) -> None:
        super().__init__(keep_graph=True)
        self.enable_debug_mode()


def summarize(text: str) -> str:
    """Node counts by type of a CUDA graph's DOT dump, then a line for each node that is not
    a kernel, naming the nodes before and after it."""
    kinds = {m["id"]: (m["kind"], m["what"][:40]) for m in NODE.finditer(text)}
    succ: dict[str, list[str]] = {}
    pred: dict[str, list[str]] = {}
    for edge in EDGE.finditer(text):
        succ.setdefault(edge["a"], []).append(edge["b"])
        pred.setdefault(edge["b"], []).append(edge["a"])

    def named(ids: list[str]) -> list[str]:
        return [kinds[i][1] or kinds[i][0] if i in kinds else "?" for i in ids]

    lines = [f"{len(kinds)} nodes: " + ", ".join(
        f"{kind} {count}" for kind, count in Counter(k for k, _ in kinds.values()).most_common())]
    lines += [f"  {node_id:<24} {kind:<14} after {named(pred.get(node_id, []))} before "
              f"{named(succ.get(node_id, []))}"
              for node_id, (kind, _) in kinds.items() if kind != "KERNEL"]
    return "\n".join(lines)


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
    print(f"bin {step.bin_for(args.rows)}: " + summarize(dot.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
