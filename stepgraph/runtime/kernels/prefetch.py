"""L2 prefetch of weight byte ranges in one launch (the pdl pass's prefetch forks).

The launches between two weight-streaming projections (the KDA core, the router, an
RMSNorm) each take a few microseconds and read almost nothing, so HBM idles while they run.
A prefetch launch at the start of such a stretch issues ``prefetch.global.L2`` (or a bulk
prefetch) for the first bytes of the next projection's weights, so that the projection
finds them in L2. The ``l2_prefetch`` provider runs it on a side stream without PDL; with
``pdl=True`` (probes: an in-chain prefetch) it keeps the PDL contract of
:mod:`launch_utils`: it reads only weights and writes nothing, lets its dependent launch at
once, then waits on its predecessor, so that its completion still implies its
predecessor's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from stepgraph.errors import UserError
from stepgraph.runtime.kernels.launch_utils import pdl_allowed

LINE = 128  # bytes of one L2 line a prefetch instruction warms
MAX_RANGES = 4  # byte ranges one launch warms
LINES_PER_STEP = 1024  # lines a program prefetches per loop step (8 a thread at 4 warps)
PROGRAMS = 132  # programs of one launch (one an H200 SM): lines in flight enough for HBM


@triton.jit
def prefetch_lines(base, lines, pid, PROGRAMS: tl.constexpr, STEP: tl.constexpr,
                   LINE: tl.constexpr, MODE: tl.constexpr):
    """Warm ``lines`` chunks of ``LINE`` bytes from byte pointer ``base``, this program's
    share: MODE 0 ``prefetch.global.L2`` a chunk, 1 ``cp.async.bulk.prefetch.L2`` of the
    chunk, 2 an L2-only load of a chunk's first word."""
    offs = tl.arange(0, STEP)
    for start in range(pid * STEP, lines, PROGRAMS * STEP):
        idx = start + offs
        idx = tl.where(idx < lines, idx, lines - 1)  # inline asm takes no mask: repeat a line
        ptrs = base + idx.to(tl.int64) * LINE
        if MODE == 0:
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 1:
            tl.inline_asm_elementwise(
                f"cp.async.bulk.prefetch.L2.global [$1], {LINE}; mov.u32 $0, 0;", "=r,l",
                [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "ld.global.cg.b32 $0, [$1];", "=r,l",
                [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, RANGES: tl.constexpr,
                        PROGRAMS: tl.constexpr, STEP: tl.constexpr, LINE: tl.constexpr,
                        MODE: tl.constexpr, USE_PDL: tl.constexpr):
    """Warm up to four byte ranges ``(p_i, n_i chunks)`` in L2."""
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    prefetch_lines(p0, n0, pid, PROGRAMS, STEP, LINE, MODE)
    if RANGES >= 2:
        prefetch_lines(p1, n1, pid, PROGRAMS, STEP, LINE, MODE)
    if RANGES >= 3:
        prefetch_lines(p2, n2, pid, PROGRAMS, STEP, LINE, MODE)
    if RANGES >= 4:
        prefetch_lines(p3, n3, pid, PROGRAMS, STEP, LINE, MODE)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def byte_range(weight: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The bytes ``[offset, offset + nbytes)`` of a contiguous ``weight`` as a uint8 view."""
    if not weight.is_contiguous():
        raise UserError(f"L2 prefetch: weight of shape {list(weight.shape)} is not contiguous")
    flat = weight.view(-1).view(torch.uint8)
    if offset < 0 or nbytes < 0 or offset + nbytes > flat.numel():
        raise UserError(f"L2 prefetch: bytes [{offset}, {offset + nbytes}) are outside a "
                        f"{flat.numel()}-byte weight")
    return flat[offset: offset + nbytes]


class L2Prefetch:
    """A prepared prefetch of up to :data:`MAX_RANGES` byte ranges (uint8 views, e.g. from
    :func:`byte_range`); calling it enqueues one launch on the current stream. Capturable."""

    def __init__(self, ranges: Sequence[torch.Tensor], pdl: bool = False,
                 programs: int = PROGRAMS, line: int = LINE, mode: int = 0) -> None:
        ranges = [r for r in ranges if r.numel() > 0]
        if len(ranges) > MAX_RANGES:
            raise UserError(f"L2 prefetch: {len(ranges)} byte ranges, at most {MAX_RANGES} "
                            "a launch")
        self.ranges = ranges
        self.line, self.mode = int(line), int(mode)
        # bulk chunks must stay inside the range: whole chunks only (the tail is not warmed)
        self.lines = [r.numel() // line if mode == 1 else triton.cdiv(r.numel(), line)
                      for r in ranges]
        self.pdl = bool(ranges) and pdl_allowed(pdl, ranges[0].device)
        self.programs = max(1, int(programs))

    @property
    def nbytes(self) -> int:
        """The bytes this launch warms."""
        return sum(r.numel() for r in self.ranges)

    def __call__(self) -> None:
        """Enqueue the launch (nothing without ranges)."""
        if not self.ranges:
            return
        args: list[object] = []
        for i in range(MAX_RANGES):
            if i < len(self.ranges):
                args += [self.ranges[i], self.lines[i]]
            else:
                args += [self.ranges[0], 0]
        _l2_prefetch_kernel[(self.programs,)](
            *args, RANGES=len(self.ranges), PROGRAMS=self.programs, STEP=LINES_PER_STEP,
            LINE=self.line, MODE=self.mode, USE_PDL=self.pdl, num_warps=4, launch_pdl=self.pdl)
