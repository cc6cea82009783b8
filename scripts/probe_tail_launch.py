"""Probe: does a step graph started from the device (a tail launch from a one-kernel host
graph) skip the start gap a host-launched graph with branches shows after its first kernel,
without the cost a device-launchable graph launched from the host showed (eighteenth
session)? One loaded step (one input block), its bin re-captured with the graph kept; the
same graph timed as: the runtime's torch replay, our own host instantiation, the
device-launchable instantiation launched from the host, and the tail launch. Logits of one
launch of each form from the same caches are compared with the runtime's (bit for bit).

Needs nvcc (CUDA C++ with the device runtime: scripts/probe_tail_launch.cu).
Usage (GPU machine): python3 scripts/probe_tail_launch.py ARTIFACT [--rows 1] [--rounds 3]
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from stepgraph.artifact import load_artifact
from stepgraph.bench.ab import INPUT_SETS, probe_arguments, shared_weights
from stepgraph.bench.protocol import build_feeds, fill_caches, time_calls
from stepgraph.runtime import StepInputs, load

DEVICE_LAUNCH = 4  # cudaGraphInstantiateFlagDeviceLaunch
SOURCE = Path(__file__).with_name("probe_tail_launch.cu")


def build_library() -> ctypes.CDLL:
    """Compile the helpers with nvcc (relocatable device code, the device runtime)."""
    out = Path(tempfile.mkdtemp()) / "libprobe_tail.so"
    subprocess.run(["nvcc", "-O2", "-arch=sm_90a", "-rdc=true", "-shared", "-Xcompiler",
                    "-fPIC", str(SOURCE), "-lcudadevrt", "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.sg_error.restype = ctypes.c_char_p
    for name in ("sg_instantiate", "sg_upload", "sg_launch", "sg_tail_host_graph"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def checked(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """Raise with CUDA's message when ``rc`` is an error."""
    if rc:
        raise RuntimeError(f"{what}: {lib.sg_error(rc).decode()} ({rc})")


def time_form(launch: Callable[[], None], replays: int) -> float:
    """Median us of ``replays`` back-to-back launches (host running ahead, CUDA events: the
    bench's :func:`~stepgraph.bench.protocol.time_calls`)."""
    return statistics.median(time_calls(lambda _: launch(), [None], replays, 10,
                                        torch.device("cuda")))


def idle_us(launch: Callable[[], None], rounds: int = 5) -> tuple[float, float, int]:
    """From the profiler: us a launch with no kernel running (between launches included),
    the gap after the first kernel of the last launch, and kernels seen a launch."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            launch()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return float("nan"), float("nan"), 0
    idle, latest = 0.0, spans[0][0]
    for start, end in spans:
        idle += max(0.0, start - latest)
        latest = max(latest, end)
    per = len(spans) // rounds
    last = spans[-per:] if per else spans
    gap = last[1][0] - last[0][1] if len(last) > 1 else float("nan")
    return idle / rounds, gap, per


def main() -> int:
    """Load, re-capture, instantiate every form, check logits, time interleaved rounds."""
    args = probe_arguments(__doc__.splitlines()[0]).parse_args()
    lib = build_library()
    artifact = load_artifact(args.artifact)
    weights = shared_weights(artifact)
    step = load(artifact, weights=weights, device="cuda", max_requests=64,
                max_context=args.context + 64, progress=False, input_blocks=1)
    lim = step.limits
    feeds = build_feeds(args.rows, 1, INPUT_SETS, args.context, lim.block_size, lim.width,
                        lim.vocab, args.rows)
    size = step.bin_for(args.rows)
    step.filler.fill(StepInputs.from_feed(feeds[0]), size)
    plan = step.plan(size)
    kept = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), torch.cuda.graph(kept, pool=torch.cuda.graph_pool_handle()):
        plan.run_eager()
    raw = ctypes.c_void_p(kept.raw_cuda_graph())
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    host_exec, device_exec, tail_exec = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    checked(lib, lib.sg_instantiate(raw, ctypes.c_ulonglong(0), ctypes.byref(host_exec)),
            "instantiate (host)")
    checked(lib, lib.sg_instantiate(raw, ctypes.c_ulonglong(DEVICE_LAUNCH),
                                    ctypes.byref(device_exec)), "instantiate (device launch)")
    checked(lib, lib.sg_upload(device_exec, stream), "upload")
    checked(lib, lib.sg_tail_host_graph(device_exec, ctypes.byref(tail_exec)),
            "the tail-launching host graph")
    torch.cuda.synchronize()

    def ours(exec_: ctypes.c_void_p) -> Callable[[], None]:
        return lambda: checked(lib, lib.sg_launch(exec_, stream), "launch")

    forms: dict[str, Callable[[], None]] = {
        "runtime (torch replay)": lambda: step.replay(size),
        "same graph, our host instantiation": ours(host_exec),
        "device-launchable, launched from the host": ours(device_exec),
        "tail launch from a one-kernel host graph": ours(tail_exec),
    }
    out = step.bindings.outputs[step.output_name]
    reference = None
    with torch.no_grad():
        for name, launch in forms.items():
            fill_caches(step.caches, 0)
            torch.cuda.synchronize()
            launch()
            torch.cuda.synchronize()
            got = out[:args.rows].float().clone()
            if reference is None:
                reference = got
            same = torch.equal(got, reference)
            diff = (got - reference).norm() / reference.norm()
            print(f"logits {name:<44} bit-equal {same} (rel {diff:.2e})", flush=True)
        table: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, launch in forms.items():
                table[name].append(time_form(launch, args.replays))
        print(f"us a launch, {args.rounds} rounds of {args.replays}:")
        for name, rounds in table.items():
            print(f"  {name:<44} " + " ".join(f"{v:8.1f}" for v in rounds), flush=True)
        for name, launch in forms.items():
            try:
                idle, gap, kernels = idle_us(launch)
                print(f"profile {name:<44} idle {idle:6.1f} us a launch, first gap "
                      f"{gap:6.2f} us, {kernels} kernels a launch", flush=True)
            except Exception as error:  # a probe: report and go on
                print(f"profile {name}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
