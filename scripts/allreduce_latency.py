"""Decode-sized all-reduce latency inside CUDA graphs: NCCL against torch symmetric memory.

Two ranks (one per GPU) all-reduce (sum) a random bf16 [B, width] tensor with three methods:

- ``nccl``: ``dist.all_reduce`` in place;
- ``symm_one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce_out`` from a symmetric buffer
  (``symm_mem.empty`` + ``symm_mem.rendezvous``) into an ordinary output tensor;
- ``symm_two_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_`` in place on a symmetric buffer.

Each method is first checked eagerly against the float32 sum of both ranks' inputs (gathered with
``all_gather_into_tensor``). Then ``repeat`` back-to-back calls are captured in one CUDA graph and
the graph is replayed ``replays`` times under CUDA events; the table gives rank 0's median
microseconds per call (replay time / repeat) and the eager per-call time for reference. After the
timing, each graph is replayed once more on fresh inputs and its result is checked too (in-place
methods compound: ``repeat`` calls give the sum times 2**(repeat-1), exact in bf16).
``--copy-in`` adds the copy of the input into the symmetric buffer to every symmetric-memory call,
which is what a caller whose input sits in ordinary memory would pay.

Usage (2-GPU machine):
    python3 scripts/allreduce_latency.py [--sizes 1,4,16,64] [--width 7168] [--repeat 20]
        [--replays 50] [--copy-in] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stepgraph.runtime.launch import free_port

WORLD = 2
METHODS = ("nccl", "symm_one_shot", "symm_two_shot")
SHORT = {"nccl": "nccl", "symm_one_shot": "1s", "symm_two_shot": "2s"}


@dataclass
class Case:
    """One method bound to its buffers: ``call`` runs one all-reduce, ``reset`` restores the input,
    ``result`` returns the reduced tensor, ``in_place`` says repeated calls compound."""

    call: Callable[[], object]
    reset: Callable[[], object]
    result: Callable[[], torch.Tensor]
    in_place: bool


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ||got - ref|| / ||ref||, computed in float32."""
    return ((got.float() - ref).norm() / ref.norm()).item()


def make_case(name: str, x: torch.Tensor, group_name: str, copy_in: bool) -> Case:
    """Allocate the buffers of method ``name`` for input ``x`` and bind its one-call closure."""
    if name == "nccl":
        t = x.clone()
        return Case(lambda: dist.all_reduce(t), lambda: t.copy_(x), lambda: t, True)
    import torch.distributed._symmetric_memory as symm_mem

    ops = torch.ops.symm_mem
    if name == "symm_two_shot" and not hasattr(ops, "two_shot_all_reduce_"):
        raise RuntimeError("torch.ops.symm_mem.two_shot_all_reduce_ does not exist")
    buf = symm_mem.empty(*x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group_name)
    buf.copy_(x)

    def pre() -> None:
        if copy_in:
            buf.copy_(x)

    if name == "symm_two_shot":

        def two_shot() -> None:
            pre()
            ops.two_shot_all_reduce_(buf, "sum", group_name)

        return Case(two_shot, lambda: buf.copy_(x), lambda: buf, not copy_in)
    if hasattr(ops, "one_shot_all_reduce_out"):
        out = torch.empty_like(x)

        def one_shot_out() -> None:
            pre()
            ops.one_shot_all_reduce_out(buf, "sum", group_name, out)

        return Case(one_shot_out, lambda: buf.copy_(x), lambda: out, False)
    held: list[torch.Tensor] = []

    def one_shot() -> None:
        pre()
        held[:] = [ops.one_shot_all_reduce(buf, "sum", group_name)]

    return Case(one_shot, lambda: buf.copy_(x), lambda: held[0], False)


def median_us(run: Callable[[], object], replays: int, calls: int) -> float:
    """Median over ``replays`` CUDA-event-timed runs of ``run``, in microseconds per call."""
    dist.barrier()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(replays)
    ]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def measure(case: Case, ref: torch.Tensor, repeat: int, replays: int, row: dict) -> None:
    """Check, time eagerly, capture, time the graph, re-check; fills ``row`` as it goes."""
    case.reset()
    case.call()
    torch.cuda.synchronize()
    row["err"] = rel_err(case.result(), ref)

    def eager() -> None:
        for _ in range(repeat):
            case.call()

    eager()
    row["eager_us"] = median_us(eager, replays, repeat)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            case.call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(repeat):
            case.call()
    graph.replay()
    row["graph_us"] = median_us(graph.replay, replays, repeat)
    if case.in_place and repeat > 64:  # 2**(repeat-1) times the sum would overflow bf16
        return
    case.reset()
    dist.barrier()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    row["graph_err"] = rel_err(case.result(), ref * (2.0 ** (repeat - 1) if case.in_place else 1))


def report(rows: list[dict], notes: list[str], args: argparse.Namespace) -> None:
    """Print the Markdown table and notes (rank 0); write them as JSON to ``--json``."""

    def us(res: dict) -> str:
        return f"{res['graph_us']:.1f}" if "graph_us" in res else "n/a"

    lines = [
        "| B | bytes | nccl graph us | one-shot graph us | two-shot graph us | nccl eager us "
        "| errors |",
        "|---|---|---|---|---|---|---|",
    ]
    failed: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        errs = []
        for name in METHODS:
            res = row[name]
            e, g = res.get("err"), res.get("graph_err")
            errs.append(
                f"{SHORT[name]} "
                + ("n/a" if e is None else f"{e:.1e}")
                + ("" if g is None else f"/{g:.1e}")
            )
            if "failed" in res:
                failed.setdefault((name, res["failed"]), []).append(row["B"])
        eager = row["nccl"].get("eager_us")
        lines.append(
            f"| {row['B']} | {row['bytes']} | {us(row['nccl'])} | {us(row['symm_one_shot'])} "
            f"| {us(row['symm_two_shot'])} | {'n/a' if eager is None else f'{eager:.1f}'} "
            f"| {'; '.join(errs)} |"
        )
    notes = notes + [f"{name} failed at B={bs}: {why}" for (name, why), bs in failed.items()]
    notes.append("errors: relative error eager/after graph replay; times are rank 0's medians")
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"args": vars(args), "rows": rows, "notes": notes, "table": text}, fh, indent=2
            )


def setup_notes(group_name: str, copy_in: bool) -> list[str]:
    """Enable symmetric memory for the group where that call exists; versions and mode notes."""
    notes = [f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, copy_in={copy_in}"]
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # deprecated no-op need in new torch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group_name)
        if hasattr(symm_mem, "get_backend"):
            notes.append(f"symm_mem backend: {symm_mem.get_backend(torch.cuda.current_device())}")
    except Exception as exc:
        notes.append(f"symmetric memory setup: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return notes


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    """One rank: init NCCL on GPU ``rank``, measure every size and method, rank 0 reports."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, device_id=device
    )
    try:
        group_name = dist.group.WORLD.group_name
        notes = setup_notes(group_name, args.copy_in)
        rows: list[dict[str, Any]] = []
        for b in args.sizes:
            torch.manual_seed(1000 * b + rank)
            x = torch.randn(b, args.width, dtype=torch.bfloat16, device=device)
            gathered = torch.empty(WORLD * b, args.width, dtype=x.dtype, device=device)
            dist.all_gather_into_tensor(gathered, x)
            ref = gathered.view(WORLD, b, args.width).float().sum(0)
            row: dict[str, Any] = {"B": b, "bytes": x.numel() * x.element_size()}
            for name in METHODS:
                res = row[name] = {}
                try:
                    case = make_case(name, x, group_name, args.copy_in)
                    measure(case, ref, args.repeat, args.replays, res)
                except Exception as exc:
                    lines = str(exc).strip().splitlines() or [""]
                    res["failed"] = f"{type(exc).__name__}: {lines[0][:200]}"
                print(f"[rank {rank}] B={b} {name}: {res}", flush=True)
            rows.append(row)
        if rank == 0:
            report(rows, notes, args)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--width", type=int, default=7168)
    p.add_argument("--repeat", type=int, default=20, help="calls captured per graph")
    p.add_argument("--replays", type=int, default=50, help="timed graph replays")
    p.add_argument("--copy-in", action="store_true", help="copy input into symm buffer per call")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Spawn the two ranks; non-zero when a rank failed."""
    args = parse_args(argv)
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    try:
        mp.spawn(worker, args=(free_port(), args), nprocs=WORLD, join=True)
    except Exception as exc:
        print(f"a rank failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
