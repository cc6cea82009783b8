"""Grid-wide hand-offs inside one launch, for the "last program to finish does it" forms
(the split-K GEMM's fused reduction, the MoE down launch's combine, the KDA recurrence's
output norm): a program stores its part, then :func:`arrive` counts it on a counter in
global memory; the program that sees ``count - 1`` knows every other part is stored and
finishes the job, leaving the counter at zero again for the next launch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gpu_fence(anchor):
    """``fence.acq_rel.gpu`` in every thread (``anchor``: any tensor, for the thread layout):
    this thread's earlier stores are ordered before its later atomics, GPU-wide."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [anchor],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def arrive(counter_ptr, anchor, FENCE: tl.constexpr):
    """Count this program in at ``counter_ptr`` once all its threads' stores are done (a GPU
    fence when ``FENCE``, off under the interpreter, which runs programs one at a time; then
    a barrier); returns the count before this arrival (acq_rel: the last to arrive sees the
    others' stores)."""
    if FENCE:
        gpu_fence(anchor)
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def reset(counter_ptr):
    """Leave the counter at zero for the next launch (called by the last to arrive)."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


# Hand-offs between launches of two streams without a graph edge (the streams pass's
# signalled branches): the branch's last launch is followed on its stream by
# :func:`signal_kernel`, and the reader's programs spin in :func:`await_signal` before they
# read the branch's outputs or let their own dependents launch. Deadlock-free as long as
# the waiting launch is small (a program a row): the branch's launches always find an SM.


@triton.jit
def signal_kernel(flag_ptr):
    """Set the flag (release: everything the stream ran before this launch is visible to a
    program that reads the flag with acquire)."""
    tl.atomic_xchg(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def await_signal(flag_ptr, programs):
    """Spin until the flag at ``flag_ptr`` is set (acquire); the last of the launch's
    ``programs`` programs to get past it clears the flag and its arrival counter at
    ``flag_ptr + 1`` for the next step (every other program is past the spin by then)."""
    while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") == 0:
        pass
    if tl.atomic_add(flag_ptr + 1, 1, sem="relaxed", scope="gpu") == programs - 1:
        tl.atomic_xchg(flag_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr + 1, 0, sem="relaxed", scope="gpu")
