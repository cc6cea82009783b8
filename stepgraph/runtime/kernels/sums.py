"""Several sums in one reduction: ``tl.reduce`` over a tuple builds one reduction tree for
all its operands, so the cross-warp steps (a shared-memory round trip and barriers each)
are paid once, not once a sum. For the latency-bound one-row kernels, where a reduction
after the PDL wait is a step of the chain."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    """The combine of three sums."""
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def sums3(a, b, c, axis: tl.constexpr):
    """``(tl.sum(a, axis), tl.sum(b, axis), tl.sum(c, axis))`` in one reduction."""
    return tl.reduce((a, b, c), axis, _add3)
