"""Forked launches on a side stream: work that runs beside the step's launch chain (the
streams pass's side nodes, joined before their first reader; the pdl pass's L2 prefetch
forks), joined back at the latest before the step ends.

:func:`fork` makes the device's side stream wait for what the current stream has enqueued so
far, enqueues the launch there, and remembers that the side stream has work; :func:`join`
makes the current stream wait for it. Under CUDA graph capture the same calls fork and join
branches of the graph (capture requires every forked stream to be joined before it ends:
:class:`~stepgraph.runtime.capture.BinPlan` joins after its last launch). The main chain's
launches keep their PDL edges: a fork adds an edge out of the launch before it, none into
the launches after it. :func:`fork_empty` forks a launch that does nothing (the streams
pass's root fork: the side stream's first launch at the graph's root instead of in the
chain).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

_SIDE: dict[int, torch.cuda.Stream] = {}
_PENDING: set[int] = set()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (created on first use)."""
    index = torch.device(device).index or 0
    stream = _SIDE.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _SIDE[index] = stream
    return stream


def fork(device: torch.device, launch: Callable[[], None]) -> None:
    """Enqueue ``launch`` on the side stream of ``device``, after everything the current
    stream has enqueued so far."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        launch()
    _PENDING.add(side.device.index or 0)


@triton.jit
def _empty_kernel():
    """Does nothing: a launch that puts a graph node on the side stream."""
    pass


def fork_empty(device: torch.device) -> None:
    """Fork one empty launch onto the side stream of ``device``."""
    fork(device, lambda: _empty_kernel[(1,)]())


def join(device: torch.device) -> None:
    """Make the current stream of ``device`` wait for the side stream's forked work (nothing
    when none is pending)."""
    if device.type != "cuda":
        return
    side = side_stream(device)
    index = side.device.index or 0
    if index in _PENDING:
        torch.cuda.current_stream(device).wait_stream(side)
        _PENDING.discard(index)
