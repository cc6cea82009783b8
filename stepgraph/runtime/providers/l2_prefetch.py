"""The ``l2_prefetch`` provider of ``prefetch`` (the pdl pass's fork nodes): one L2 prefetch
launch of the node's weight byte ranges, forked onto the device's side stream so that it runs
beside the launch chain (:mod:`stepgraph.runtime.side_stream`). Declined off CUDA and under
the Triton interpreter, where the ``torch`` no-op takes the node."""

from __future__ import annotations

from stepgraph.runtime.kernels.launch_utils import interpreting
from stepgraph.runtime.kernels.prefetch import L2Prefetch, byte_range
from stepgraph.runtime.providers.registry import Launch, PrepareContext, register
from stepgraph.runtime.side_stream import fork


@register("prefetch", "l2_prefetch", note="prefetch.global.L2 launch on a forked side stream")
def l2_prefetch(ctx: PrepareContext) -> Launch:
    """Fork one prefetch launch of the node's ``weight_offsets`` / ``weight_bytes``."""
    if ctx.device.type != "cuda" or interpreting():
        raise NotImplementedError("an L2 prefetch needs a CUDA device")
    attrs = ctx.node.attrs
    ranges = [byte_range(weight, int(offset), int(size)) for weight, offset, size in
              zip(ctx.inputs(), attrs["weight_offsets"], attrs["weight_bytes"], strict=True)]
    prefetch = L2Prefetch(ranges)
    device = ctx.device
    return lambda: fork(device, prefetch)
