"""Launch helpers shared by the dense and MoE Triton kernels: interpreter detection, whether
a launch may use programmatic dependent launch (PDL), and stream-ordered scratch buffers.

**PDL contract** (every kernel here follows it): a kernel launched with ``launch_pdl=True``
may start while its predecessor still runs, so it reads only weights before
``gdc_wait()`` and writes nothing before it (its output may alias memory the predecessor
still reads: the arena is reused). Once ``gdc_wait()`` returns every earlier kernel of the
stream has completed (each PDL kernel waits before it completes), which is also what makes
the shared scratch buffers below safe: two launches on one stream never use a scratch
buffer at the same time. Launches on a side stream take their own buffers
(:func:`scratch_namespace`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_f32(weight_dtype: torch.dtype) -> bool:
    """Whether kernels feed ``tl.dot`` float32 operands: under the interpreter (its dot
    multiplies BF16 bit patterns as integers, Triton 3.6) and for float32 weights."""
    return interpreting() or weight_dtype == torch.float32


def pdl_allowed(wanted: bool, device: torch.device) -> bool:
    """Whether a launch on ``device`` uses PDL: the plan allows it (``wanted``), the kernel
    runs on a CUDA device of compute capability 9.0 or newer, and not in the interpreter."""
    if not wanted or interpreting() or device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9


GEMV_GROUP_ROWS = 4  # the most batch rows one program of the projections' GEMV forms takes
TILE_BYTES = 16384  # a weight tile (MMA form) or chunk (GEMV form) when a tactic sets no k_tile


def tile_width(m_tile: int) -> int:
    """The K extent of a :data:`TILE_BYTES` BF16 weight tile of ``m_tile`` rows (the split-K
    kernels' default, and the tuner's unit for "at least two tiles a split")."""
    return TILE_BYTES // (2 * m_tile)


def next_pow2(value: int) -> int:
    """The smallest power of two >= ``value`` (1 for values below 2)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


_SCRATCH: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}
_NAMESPACE: ContextVar[str] = ContextVar("scratch_namespace", default="")


@contextmanager
def scratch_namespace(stream: str) -> Iterator[None]:
    """Launches prepared inside get the scratch buffers of ``stream`` (a name): launches on
    a side stream run beside the main stream's and must not share its buffers."""
    token = _NAMESPACE.set(stream)
    try:
        yield
    finally:
        _NAMESPACE.reset(token)


def scratch(device: torch.device, name: str, numel: int, dtype: torch.dtype,
            zeroed: bool = False) -> torch.Tensor:
    """A flat scratch tensor of at least ``numel`` elements, shared by every launch of
    ``device`` that asks for ``name``. Call it when preparing a launch (never while
    capturing); a larger request allocates a larger buffer, and launches prepared earlier
    keep (and stay valid with) the buffer they were given. Only stream-ordered launches that
    follow the PDL contract of this module may share one. ``zeroed``: a new buffer starts at
    zero (counters, which their users leave at zero again)."""
    namespace = _NAMESPACE.get()
    key = (str(device), f"{namespace}/{name}" if namespace else name, dtype)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < numel:
        make = torch.zeros if zeroed else torch.empty
        buffer = make(max(int(numel), 1), dtype=dtype, device=device)
        _SCRATCH[key] = buffer
    return buffer[: max(int(numel), 1)]
