"""Start one process a rank and run a function in each: the launcher behind ``--nproc``.

``launch(fn, nproc, *args)`` spawns ``nproc`` processes (the ``spawn`` start method, as CUDA
wants), initializes ``torch.distributed`` in each (NCCL with one GPU a rank where CUDA is
available, else Gloo on the CPU), calls ``fn(comm, *args)`` with the rank's
:class:`~stepgraph.runtime.comm.Communicator` and returns every rank's result in rank order.

A rank that fails stops the run: the others are terminated (they would wait forever in
their next collective) and the failure is raised here, a :class:`UserError` as one line, any
other error with the failing rank's traceback.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

from stepgraph.errors import UserError

RUN_TIMEOUT_S = 600.0  # the longest a rank may run before it reports (a whole benchmark)
GRACE_S = 10.0  # how long the other ranks get to finish after one failed


def free_port() -> int:
    """A TCP port free on this host now (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_backend(nproc: int, device: str) -> str:
    """``nccl`` for ``device`` cuda (one GPU a rank: needs ``nproc`` GPUs), ``gloo`` for
    cpu; a one-line error when there are too few GPUs."""
    import torch

    if device == "cpu":
        return "gloo"
    if device != "cuda":
        raise UserError(f"--device {device!r}: choose cuda or cpu")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < nproc:
        raise UserError(f"--nproc {nproc} needs {nproc} GPUs; this machine has {found} "
                        f"(use --device cpu for a slow CPU run over Gloo)")
    return "nccl"


def _rank_main(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any],
               args: tuple[Any, ...], results: Any) -> None:
    import torch
    import torch.distributed as dist

    from stepgraph.runtime.comm import Communicator

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        init: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            init["device_id"] = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, **init)
        comm = Communicator(rank, world, backend)
        result = fn(comm, *args)
        comm.barrier()
        results.put((rank, "ok", result))
    except UserError as error:
        results.put((rank, "user", str(error)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], nproc: int, *args: Any, device: str = "cuda",
           timeout_s: float = RUN_TIMEOUT_S) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``nproc`` ranks (``fn`` must be importable by name: a
    module-level function); returns the ranks' results in rank order."""
    import torch.multiprocessing as mp

    if nproc < 1:
        raise UserError(f"--nproc {nproc}: must be at least 1")
    backend = pick_backend(nproc, device)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main,
                                 args=(rank, nproc, port, backend, fn, args, results),
                                 daemon=False)
                 for rank in range(nproc)]
    for process in processes:
        process.start()
    gathered: dict[int, Any] = {}
    failure: tuple[int, str, str] | None = None
    try:
        while len(gathered) < nproc and failure is None:
            try:
                rank, status, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                raise UserError(f"the ranks did not finish within {timeout_s:.0f} s") from None
            if status == "ok":
                gathered[rank] = payload
            else:
                failure = (rank, status, payload)
    finally:
        for process in processes:
            process.join(timeout=GRACE_S if failure is None else 1.0)
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
    if failure is not None:
        rank, status, payload = failure
        if status == "user":
            raise UserError(f"rank {rank}: {payload}")
        raise RuntimeError(f"rank {rank} failed:\n{payload}")
    dead = [p.exitcode for p in processes if p.exitcode not in (0, None)]
    if len(gathered) < nproc:
        raise RuntimeError(f"only {len(gathered)} of {nproc} ranks reported (exit codes {dead})")
    return [gathered[rank] for rank in range(nproc)]
