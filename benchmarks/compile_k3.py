"""Benchmark compile-k3 and plan-k3 (shared/BENCHMARKS.md, CPU): whole-process wall time of
`stepgraph compile` (python start included, median of 5) per deployment, and the memory plan
of each artifact (arena, lower bound, naive, ratios) per bin. Prints Markdown tables.

Usage: python benchmarks/compile_k3.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = {
    "K3 TP8": ["models/kimi_k3.yaml", "--tp", "8"],
    "K3 TP16": ["models/kimi_k3.yaml", "--tp", "16"],
    "K3 DCP8 (TP8)": ["models/kimi_k3.yaml", "--tp", "8", "--dcp", "8"],
    "K3 DEP16": ["models/kimi_k3.yaml", "--dep", "16"],
    "K3.1 TP8": ["models/kimi_k3_1.yaml", "--tp", "8"],
}


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


def main() -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    timing_rows, plan_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        for label, flags in DEPLOYMENTS.items():
            out = Path(folder) / "a.sgart"
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "stepgraph", "compile", *flags, "-o",
                                str(out)], check=True, cwd=ROOT, capture_output=True)
                times.append(time.perf_counter() - start)
            timing_rows.append((label, statistics.median(times), min(times), max(times)))
            summary = subprocess.run(
                [sys.executable, "-m", "stepgraph", "inspect", str(out), "--format", "json",
                 "--summary"], check=True, cwd=ROOT, capture_output=True, text=True)
            for entry in json.loads(summary.stdout)["bins"]:
                m = entry["memory"]
                plan_rows.append((label, entry["rows"], m["arena_bytes"], m["lower_bound_bytes"],
                                  m["naive_bytes"]))
    print("| deployment | median s | min s | max s |")
    print("| --- | --- | --- | --- |")
    for label, median, low, high in timing_rows:
        print(f"| {label} | {median:.3f} | {low:.3f} | {high:.3f} |")
    print()
    print("| deployment | rows | arena MiB | lower bound MiB | naive MiB | arena / lower bound "
          "| naive / arena |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, rows, arena, bound, naive in plan_rows:
        print(f"| {label} | {rows} | {_mib(arena)} | {_mib(bound)} | {_mib(naive)} | "
              f"{arena / bound:.3f} | {naive / arena:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
