"""One-call check of the GPU machine: versions, the two ceilings (device-to-device copy
bandwidth, a BF16 GEMV at K3 size through cuBLAS), and the reference executor on CUDA.

Usage (on the GPU machine): python3 scripts/gpu_env.py
"""

from __future__ import annotations

import subprocess
import sys

import torch


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes read + written per second of a large device-to-device copy (median)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[3:])
    return 2 * n / times[len(times) // 2]


def gemv_bandwidth(n: int = 49376, k: int = 7168, rows: int = 1) -> float:
    """Weight bytes per second of x[rows, k] @ W[n, k].T (cuBLAS, BF16), rotating weights."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(40):
        w = weights[i % 4]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(x, w.t())
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[8:])
    return 2 * n * k / times[len(times) // 2]


def main() -> int:
    """Print versions and ceilings; run the reference on CUDA."""
    import triton

    print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__}")
    print(f"gpu {torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
    print(f"copy bandwidth (read+write) {copy_bandwidth() / 1e12:.2f} TB/s")
    print(f"cuBLAS GEMV 49376x7168 B=1: {gemv_bandwidth() / 1e12:.2f} TB/s of weights")
    result = subprocess.run(
        [sys.executable, "-m", "stepgraph", "run", "models/tiny_k3.yaml", "--weights", "random",
         "--tokens", "1,2,3", "--tokens", "4,5", "--logits-out", "/tmp/l.npy", "--device",
         "cuda", "--dtype", "bfloat16"], capture_output=True, text=True)
    print("stepgraph run on cuda:", result.returncode, result.stdout.strip(),
          result.stderr.strip()[-400:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
