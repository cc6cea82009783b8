"""Probe: a one-row GEMV whose weight chunks arrive by TMA (bulk tensor copies into a
multi-stage shared-memory ring, Triton's loop pipeline over a tensor descriptor) against the
runtime's register GEMV, at the one-row projection shapes of k3-rank-tp8.

Usage (GPU machine): python3 scripts/probe_gemv_tma.py [--layers 12] [--replays 30] [--chain]
For each shape, a CUDA graph of ``--layers`` PDL launches, each on its own weight (so no
launch finds its weights in L2), is replayed back to back; us a launch (median over
replays) and the weight bytes' rate. Every form is checked against ``x @ w.T`` first.
``--chain``: o_proj where the step has it instead, after short launches: layers of
in_proj (the table's GEMV) -> 3 RMSNorm launches -> o_proj in the form measured; us a layer.
Its forms also run the short launches as the probe's own RMSNorm that lets its dependents
launch at its start, so o_proj is resident (its pre-wait chunks requested) from the first
short launch on (docs/perf.md, seventeenth session).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from stepgraph.runtime.kernels.splitk_gemm import SplitKGemm, SplitKTactic
from stepgraph.runtime.tune import time_launches

SHAPES = {  # name: (N, K, the H200 table's bin-1 tactic)
    "o_proj": (7168, 1536, (32, 1, 1, 2, 0, 8)),
    "routed_up": (7168, 3584, (32, 1, 1, 2, 0, 8)),
    "front": (3696, 7168, (16, 1, 1, 2, 0, 8)),
    "in_proj": (6288, 7168, (8, 1, 1, 2, 0, 4)),
    "shared_gate_up": (1536, 7168, (8, 1, 1, 2, 0, 8)),
}


@triton.jit
def _gemv_tma_kernel(x_ptr, w_desc, out_ptr, N, K,
                     BLOCK_W: tl.constexpr, CHUNK_K: tl.constexpr, STAGES: tl.constexpr,
                     PRE: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[0, n] = x[0] @ w[n].T`` for one tile of ``BLOCK_W`` weight rows: chunks
    ``[BLOCK_W, CHUNK_K]`` by TMA through a ``STAGES``-deep shared-memory ring, the row's
    chunks one ahead in registers. ``PRE``: the PDL wait sits in the loop's first iteration,
    so the pipeline's prologue (the first ``STAGES - 1`` TMA copies, weights only) is issued
    before it; else the wait precedes the loop."""
    pid = tl.program_id(0)
    r0 = pid * BLOCK_W
    offs_k = tl.arange(0, CHUNK_K)
    acc = tl.zeros([BLOCK_W, CHUNK_K], dtype=tl.float32)
    if PRE:
        x_cur = tl.zeros([CHUNK_K], dtype=x_ptr.dtype.element_ty)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x_cur = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    for k in tl.range(0, K, CHUNK_K, num_stages=STAGES):
        if PRE:  # noqa: SIM102 (a constexpr test apart: Triton folds it at compile time)
            if k == 0:
                if USE_PDL:
                    tl.extra.cuda.gdc_wait()
                    tl.extra.cuda.gdc_launch_dependents()
                x_cur = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
        kn = k + CHUNK_K + offs_k
        x_nxt = tl.load(x_ptr + kn, mask=kn < K, other=0.0)
        w = w_desc.load([r0, k])
        acc += w.to(tl.float32) * x_cur.to(tl.float32)[None, :]
        x_cur = x_nxt
    rows = r0 + tl.arange(0, BLOCK_W)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)


class TmaGemv:
    """A prepared one-row ``out = x @ w.T`` by :func:`_gemv_tma_kernel`."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_w: int,
                 chunk_k: int, stages: int, warps: int, pre: bool, pdl: bool = True) -> None:
        self.x, self.w, self.out = x, w, out
        self.desc = TensorDescriptor.from_tensor(w, [block_w, chunk_k])
        self.block_w, self.chunk_k, self.stages, self.warps = block_w, chunk_k, stages, warps
        self.pre, self.pdl = pre, pdl
        self.grid = (triton.cdiv(w.shape[0], block_w),)

    def __call__(self) -> None:
        """Enqueue the launch."""
        _gemv_tma_kernel[self.grid](self.x, self.desc, self.out, self.w.shape[0],
                                    self.w.shape[1], BLOCK_W=self.block_w,
                                    CHUNK_K=self.chunk_k, STAGES=self.stages, PRE=self.pre,
                                    USE_PDL=self.pdl, num_warps=self.warps,
                                    launch_pdl=self.pdl)


def forms(tactic: tuple[int, ...]) -> dict[str, dict]:
    """The forms measured at one shape: the table's register GEMV and TMA variants."""
    out: dict[str, dict] = {"register (table)": {"kind": "reg", "tactic": tactic}}
    variants = [(32, 256, 4, 8, False)]
    variants += [(bw, ck, st, wp, True) for bw, ck in ((32, 256), (64, 128), (16, 256),
                                                       (64, 256))
                 for st in (3, 4, 6) for wp in (4, 8) if bw * ck * 2 * (st - 1) <= 180_000]
    for block_w, chunk_k, stages, warps, pre in variants:
        name = f"tma {block_w}x{chunk_k} s{stages} w{warps}{' pre' if pre else ''}"
        out[name] = {"kind": "tma", "block_w": block_w, "chunk_k": chunk_k,
                     "stages": stages, "warps": warps, "pre": pre}
    return out


def build(form: dict, xs: list[torch.Tensor], ws: list[torch.Tensor],
          outs: list[torch.Tensor]) -> list:
    """One prepared launch a layer."""
    if form["kind"] == "reg":
        return [SplitKGemm(x, w, o, SplitKTactic(*form["tactic"]), pdl=True)
                for x, w, o in zip(xs, ws, outs, strict=True)]
    return [TmaGemv(x, w, o, form["block_w"], form["chunk_k"], form["stages"],
                    form["warps"], form["pre"]) for x, w, o in zip(xs, ws, outs, strict=True)]


CHAIN_FORMS = {  # o_proj forms of --chain: (early, (block_w, chunk_k, stages, warps));
    # form None: the register GEMV. early None: the runtime's RMSNorm launches, else the
    # probe's; early True: the short launches let their dependents launch at their start,
    # so o_proj is resident (its pre-wait loads in flight) from the first short launch on.
    "register (table)": (None, None),
    "tma 32x256 s7 w8 pre (all 6 chunks before the wait)": (None, (32, 256, 7, 8)),
    "probe's short launches, not early, register": (False, None),
    "early short launches, register": (True, None),
    "early short launches, tma 32x256 s7 w8 pre": (True, (32, 256, 7, 8)),
    "early short launches, tma 32x256 s7 w4 pre": (True, (32, 256, 7, 4)),
    "early short launches, tma 16x256 s7 w8 pre": (True, (16, 256, 7, 8)),
    "early short launches, tma 16x256 s7 w4 pre": (True, (16, 256, 7, 4)),
    "early short launches, tma 64x128 s13 w8 pre": (True, (64, 128, 13, 8)),
}


@triton.jit
def _short_kernel(x_ptr, g_ptr, out_ptr, H, eps, BLOCK: tl.constexpr, EARLY: tl.constexpr):
    """RMSNorm of one row, a short launch of the chain: with ``EARLY`` its dependents may
    launch at its start (before its wait), else right after the wait (as the runtime)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(out_ptr + offs, (x * scale * g).to(out_ptr.dtype.element_ty), mask=mask)


class ShortLaunch:
    """A prepared :func:`_short_kernel` launch (PDL)."""

    def __init__(self, x: torch.Tensor, g: torch.Tensor, out: torch.Tensor,
                 early: bool) -> None:
        self.x, self.g, self.out, self.early = x, g, out, early

    def __call__(self) -> None:
        """Enqueue the launch."""
        h = self.out.shape[-1]
        _short_kernel[(1,)](self.x, self.g, self.out, h, 1e-5,
                            BLOCK=triton.next_power_of_2(h), EARLY=self.early, num_warps=4,
                            launch_pdl=True)


def chain(layers: int, replays: int) -> None:
    """o_proj after short launches, as in a KDA layer (see the module docstring)."""
    from stepgraph.runtime.kernels.elementwise import RmsNorm

    dev = torch.device("cuda")
    n_in, k_in, t_in = SHAPES["in_proj"]
    n_o, k_o, t_o = SHAPES["o_proj"]
    w_in = [torch.randn(n_in, k_in, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    w_o = [torch.randn(n_o, k_o, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    x = torch.randn(1, k_in, device=dev, dtype=torch.bfloat16)
    h = torch.empty(1, n_in, device=dev, dtype=torch.bfloat16)
    n1 = torch.empty(1, k_o, device=dev, dtype=torch.bfloat16)
    n2 = torch.empty(1, k_o, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, n_o, device=dev, dtype=torch.bfloat16)
    g = torch.rand(k_o, device=dev, dtype=torch.bfloat16) + 0.5
    print(f"\nchain of {layers} layers: in_proj -> 3 RMSNorms -> o_proj (CUDA graph, PDL)")
    base = None
    for label, (early, form) in CHAIN_FORMS.items():
        launches: list = []
        for wi, wo in zip(w_in, w_o, strict=True):
            launches.append(SplitKGemm(x, wi, h, SplitKTactic(*t_in), pdl=True))
            if early is not None:
                launches += [ShortLaunch(h[:, :k_o], g, n1, early),
                             ShortLaunch(n1, g, n2, early), ShortLaunch(n2, g, n1, early)]
            else:
                launches += [RmsNorm(h[:, :k_o], g, n1, 1e-5, pdl=True),
                             RmsNorm(n1, g, n2, 1e-5, pdl=True),
                             RmsNorm(n2, g, n1, 1e-5, pdl=True)]
            if form is None:
                launches.append(SplitKGemm(n1, wo, y, SplitKTactic(*t_o), pdl=True))
            else:
                launches.append(TmaGemv(n1, wo, y, *form, pre=True))
        try:
            us = time_launches(launches, repeats=1, replays=replays) * len(launches) / layers
        except Exception as exc:  # a probe reports a form that fails and goes on
            print(f"  {label:<52} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        ref = n1.float() @ w_o[-1].float().T
        err = float((y.float() - ref).norm() / ref.norm())
        base = base or us
        print(f"  {label:<52} {us:7.2f} us a layer ({us - base:+5.2f})  err {err:.1e}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    """Measure every form at every shape; print a table a shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--quick", action="store_true", help="only the 4-stage 8-warp forms")
    parser.add_argument("--chain", action="store_true", help="o_proj after short launches")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.chain:
        chain(min(args.layers, 8), args.replays)
        return 0
    for name in args.shapes:
        n, k, tactic = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
        xs = [torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
        refs = [(x.float() @ w.float().T) for x, w in zip(xs, ws, strict=True)]
        mb = n * k * 2 / 1e6
        print(f"\n{name} {n}x{k} ({mb:.1f} MB a launch, {args.layers} launches a graph)")
        base = None
        for label, form in forms(tactic).items():
            if args.quick and form["kind"] == "tma" and (form["stages"] != 4
                                                          or form["warps"] != 8):
                continue
            outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in xs]
            try:
                us = time_launches(build(form, xs, ws, outs), repeats=1, replays=args.replays)
            except Exception as exc:  # a probe reports a form that fails and goes on
                print(f"  {label:<30} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            err = max(float((o.float() - r).norm() / r.norm()) for o, r in
                      zip(outs, refs, strict=True))
            base = base or us
            print(f"  {label:<30} {us:7.2f} us  {mb / us:5.2f} TB/s  x{base / us:4.2f}  "
                  f"err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
