"""The dense Triton providers (``splitk`` projections, ``triton`` rmsnorm / add /
attn_res_mix) against the reference executor's op functions on fresh random inputs.

CPU, interpreter: this file run as a script in a subprocess with ``TRITON_INTERPRET=1``
(small shapes: split > 1, K not a multiple of the K tile, several row tiles, strided inputs
and outputs, float32 output, the registered provider factories).
CPU, sm_90 compiles: every launch at K3 per-rank shapes and the H200 table's tactics
compiles for sm_90 without spills, inside the shared-memory limit, with a pipelined main
loop, ``griddepcontrol.wait`` and weight loads issued before it.
GPU (``-m gpu``): K3 per-rank shapes, rows 1..64, BF16 against the float32 reference
(||out - ref|| / ||ref|| < 1e-2, no NaN, outputs poisoned with NaN first), eager and
inside a captured CUDA graph with PDL, replayed on fresh inputs.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from triton_check import (  # noqa: E402
    Replayer,
    context,
    explain,
    has_triton,
    node_of,
    patch_interpreter,
    ref_op,
    rel_err,
    run_script,
    sm90_compiles,
)

HERE = Path(__file__).resolve()
TOL_BF16 = 1e-2
TOL_F32 = 5e-4  # float32 outputs (the MoE front): far under a BF16 rounding (~2e-3)
ROWS = (1, 2, 4, 8, 16, 32, 64)
# (n, k, out dtype, tactics [m_tile, n_tile, split, stages(, k_tile, warps)]: the H200
# table's rows of that shape, where it has them, and a few more; n_tile 1 is the GEMV form)
K3_PROJECTIONS = (
    (6288, 7168, "bfloat16", ((128, 8, 2, 6), (128, 16, 2, 6), (128, 32, 2, 5), (64, 64, 1, 6),
                              (8, 1, 1, 2, 0, 8), (8, 1, 1, 2, 0, 4), (8, 2, 1, 2, 0, 4))),
    (3648, 7168, "bfloat16", ((64, 8, 4, 8), (64, 16, 2, 10), (64, 32, 2, 8), (64, 64, 2, 5),
                              (16, 1, 1, 2, 0, 8), (16, 1, 1, 3, 0, 8), (16, 1, 2, 4, 0, 4),
                              (16, 2, 1, 2, 0, 8), (16, 4, 1, 2, 0, 8))),
    (560, 7168, "float32", ((64, 8, 4, 8), (32, 16, 8, 6), (64, 64, 2, 5), (8, 1, 4, 2, 0, 8),
                            (8, 2, 4, 2, 0, 8))),
    (7168, 1536, "bfloat16", ((128, 16, 1, 4), (64, 16, 2, 6), (64, 64, 1, 4),
                              (32, 1, 1, 2, 0, 8), (32, 2, 1, 3, 0, 8))),
)
GEMV_KERNELS = ("_gemv_kernel", "gemv_rows_kernel")

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")


def _dtype(name: str) -> Any:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _tactic(t: tuple[int, ...]) -> dict[str, int]:
    names = ("m_tile", "n_tile", "split", "stages", "k_tile", "warps")
    assert 4 <= len(t) <= len(names), t
    return dict(zip(names, t, strict=False))


# ----------------------------------------------------------------------------- checks
# Each check builds fresh random inputs on ``device``, runs the provider and compares with
# the reference op in float32; it raises AssertionError with the shapes on a mismatch.


def check_projection(rows: int, n: int, k: int, tactic: dict[str, int], out_dtype: Any,
                     device: str, pdl: bool = False, strided: bool = True,
                     seed: int = 0, norm: bool = False) -> float:
    """The splitk provider: x (a column view when ``strided``) @ W.T into a column view of
    a NaN-poisoned wider buffer (``norm``: of the rows' RMSNorm, the fuse pass's input
    norm; x then of scale 3, so that the norm matters); returns the relative error."""
    from stepgraph.runtime.providers.triton_dense import _projection

    gen = torch.Generator().manual_seed(seed)
    pad = 5 if strided else 0
    xs = (torch.randn(rows, k + 2 * pad, generator=gen) * (3.0 if norm else 1.0)
          ).to(torch.bfloat16).to(device)
    x = xs[:, pad:pad + k]
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
    base = torch.full((rows, n + 2 * pad), float("nan"), dtype=out_dtype, device=device)
    out = base[:, pad:pad + n]
    attrs = {"input_norm_eps": 1e-5, "input_norm_dtype": "bfloat16"} if norm else {}
    ins = [x, w]
    if norm:
        ins.append((1.0 + 0.5 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(device))
    node = node_of("projection", len(ins), 1, **attrs)
    launch = _projection(context(node, [*ins, out], pdl=pdl, tactic=tactic))
    launch()
    ref = ref_op("projection", [t.float() for t in ins], attrs, [torch.float32])[0]
    err = rel_err(out, ref)
    where = (f"projection rows={rows} n={n} k={k} tactic={tactic} out={out_dtype} "
             f"strided={strided} pdl={pdl} norm={norm}")
    tol = TOL_F32 if out_dtype == torch.float32 else TOL_BF16
    assert not torch.isnan(out).any(), f"{where}: NaN (unwritten) in the output"
    assert err < tol, f"{where}: relative error {err:.3e} >= {tol}"
    if pad:
        assert torch.isnan(base[:, :pad]).all() and torch.isnan(base[:, pad + n:]).all(), \
            f"{where}: wrote outside the output view"
    return err


def check_combined_projection(rows: int, n: int, k: int, top_k: int, tactic: dict[str, int],
                              device: str, norm: bool = True, seed: int = 0) -> float:
    """The splitk provider with the fuse pass's input combine: x is routed-expert slots
    [rows, top_k, k] (float32), summed inside the GEMV or by an add launch first. Its
    output must equal, bit for bit, the same provider's on the rows the routed experts' own
    combine launch writes from those slots (the unfused plan's), and the reference within
    BF16 error; returns the relative error."""
    import triton

    from stepgraph.runtime.kernels import moe
    from stepgraph.runtime.providers.triton_dense import _projection

    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randn(rows, top_k, k, generator=gen) * 3.0).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
    g = (1.0 + 0.5 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(device)
    norm_attrs = {"input_norm_eps": 1e-5, "input_norm_dtype": "bfloat16"} if norm else {}
    attrs = {**norm_attrs, "input_combine_top_k": top_k, "input_combine_dtype": "bfloat16"}
    extra = [g] if norm else []
    out = _poisoned(rows, n, torch.bfloat16, device)
    node = node_of("projection", 2 + len(extra), 1, **attrs)
    _projection(context(node, [slots, w, *extra, out], tactic=tactic))()
    summed = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
    y = slots.view(rows * top_k, k)  # every slot's expert held here: ids 0 .. top_k - 1
    ids = torch.arange(top_k, dtype=torch.int32, device=device).repeat(rows, 1)
    moe._moe_combine_kernel[(rows, triton.cdiv(k, moe.COMBINE_BLOCK))](
        y, ids, summed, k, top_k, 0, top_k, y.stride(0), ids.stride(0), ids.stride(1),
        summed.stride(0), summed.stride(1), BLOCK=moe.COMBINE_BLOCK,
        K_PAD=max(2, triton.next_power_of_2(top_k)), USE_PDL=False)
    apart = _poisoned(rows, n, torch.bfloat16, device)
    node = node_of("projection", 2 + len(extra), 1, **norm_attrs)
    _projection(context(node, [summed, w, *extra, apart], tactic=tactic))()
    where = f"combined projection rows={rows} n={n} k={k} top_k={top_k} tactic={tactic}"
    assert not torch.isnan(out).any(), f"{where}: NaN (unwritten) in the output"
    assert torch.equal(out, apart), (f"{where}: differs from the slots summed apart by "
                                     f"{rel_err(out, apart.float()):.2e}")
    ref = ref_op("projection", [slots, w.float(), *[t.float() for t in extra]], attrs,
                 [torch.float32])[0]
    err = rel_err(out, ref)
    assert err < TOL_BF16, f"{where}: relative error {err:.3e} >= {TOL_BF16}"
    return err


def _poisoned(rows: int, width: int, dtype: Any, device: str, pad: int = 0) -> Any:
    base = torch.full((rows, width + 2 * pad), float("nan"), dtype=dtype, device=device)
    return base[:, pad:pad + width]


def check_small_ops(rows: int, width: int, device: str, pdl: bool = False,
                    seed: int = 0) -> dict[str, float]:
    """embed (a strided table; the gathered rows equal), rmsnorm (bf16 and float32 inputs,
    strided), add (2 and 3 operands), attn_res_mix
    (1, 3 and 6 sources of different scales) and attn_res_norm (1 to 9 sources, 0 to 2
    deltas; both outputs) through the triton providers."""
    from stepgraph.runtime.providers import triton_dense as td

    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0, dtype: Any = torch.bfloat16) -> Any:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    errors: dict[str, float] = {}
    vocab = 50  # the embedding's draws from a generator of their own: the other ops' stay
    embed_gen = torch.Generator().manual_seed(seed + 1000)
    table = (torch.randn(vocab, width + 2, generator=embed_gen).to(torch.bfloat16)
             .to(device)[:, 1:1 + width])  # rows strided, as a view of a wider table
    tokens = torch.randint(0, vocab, (rows,), generator=embed_gen, dtype=torch.int32).to(device)
    out = _poisoned(rows, width, torch.bfloat16, device, pad=1)
    td.embed(context(node_of("embed", 2, 1), [tokens, table, out], pdl=pdl))()
    ref = ref_op("embed", [tokens, table], {}, [torch.bfloat16])[0]
    assert torch.equal(out, ref), f"embed rows={rows} width={width}: rows differ from table[tokens]"
    weight = rnd(width, scale=0.5)
    for dtype in (torch.bfloat16, torch.float32):
        x = rnd(rows, width + 3, scale=3.0, dtype=dtype)[:, 1:1 + width]
        out = _poisoned(rows, width, torch.bfloat16, device, pad=2)
        node = node_of("rmsnorm", 2, 1, eps=1e-5)
        td.rmsnorm(context(node, [x, weight, out], pdl=pdl))()
        ref = ref_op("rmsnorm", [x.float(), weight.float()], {"eps": 1e-5}, [torch.float32])[0]
        errors[f"rmsnorm[{dtype}]"] = rel_err(out, ref)
    for count in (2, 3):
        srcs = [rnd(rows, width + 4, scale=i + 1.0)[:, 2:2 + width] for i in range(count)]
        out = _poisoned(rows, width, torch.bfloat16, device)
        td.add(context(node_of("add", count, 1), [*srcs, out], pdl=pdl))()
        ref = ref_op("add", [s.float() for s in srcs], {}, [torch.float32])[0]
        errors[f"add[{count}]"] = rel_err(out, ref)
    query, norm = rnd(width), rnd(width, scale=0.3)
    for count in (1, 3, 6):
        srcs = [rnd(rows, width, scale=0.5 + i) for i in range(count)]
        attrs = {"sources": count, "eps": 1e-6}
        out = _poisoned(rows, width, torch.bfloat16, device)
        node = node_of("attn_res_mix", count + 2, 1, **attrs)
        td.attn_res_mix(context(node, [*srcs, query, norm, out], pdl=pdl))()
        ref = ref_op("attn_res_mix", [s.float() for s in srcs] + [query.float(), norm.float()],
                     attrs, [torch.float32])[0]
        errors[f"attn_res_mix[{count}]"] = rel_err(out, ref)
    weight_n = rnd(width, scale=0.5) + 1.0
    for count, deltas in ((1, 0), (2, 1), (4, 2), (9, 2)):
        srcs = [rnd(rows, width + 4, scale=0.5 + i)[:, 1:1 + width] for i in range(count)]
        extra = [rnd(rows, width, scale=2.0 + i) for i in range(deltas)]
        attrs = {"sources": count, "deltas": deltas, "eps": 1e-6, "norm_eps": 1e-5}
        outs = [_poisoned(rows, width, torch.bfloat16, device, pad=1)]
        if deltas:
            outs.append(_poisoned(rows, width, torch.bfloat16, device, pad=3))
        node = node_of("attn_res_norm", count + deltas + 3, len(outs), **attrs)
        launch = td.attn_res_norm(context(node, [*srcs, *extra, query, norm, weight_n, *outs],
                                          pdl=pdl))
        ref = ref_op("attn_res_norm", [t.float() for t in (*srcs, *extra)]
                     + [query.float(), norm.float(), weight_n.float()], attrs,
                     [torch.float32] * len(outs))
        paths = ["tile", "sweeps"] if launch.one_tile else ["sweeps"]
        if launch.one_tile and count >= 2:
            paths.append("gram")  # the earlier sources mixed before the wait
        for path in paths:  # the row held in registers where it fits, and the sweeps
            launch.one_tile = path in ("tile", "gram")
            launch.pre_sources = launch.gram = path == "gram"
            for t in outs:
                t.fill_(float("nan"))
            launch()
            for which, (got, want) in enumerate(zip(outs, ref, strict=True)):
                errors[f"attn_res_norm[{count}+{deltas}].{path}.{which}"] = rel_err(got, want)
            if deltas:  # a delta from a signalled side-stream branch: wait on its flag
                from stepgraph.runtime.kernels.sync import signal_kernel

                flag = torch.zeros(2, dtype=torch.int32, device=device)
                launch.awaits = flag
                signal_kernel[(1,)](flag)
                for t in outs:
                    t.fill_(float("nan"))
                launch()
                launch.awaits = None
                for which, (got, want) in enumerate(zip(outs, ref, strict=True)):
                    errors[f"attn_res_norm[{count}+{deltas}].{path}.wait.{which}"] = rel_err(
                        got, want)
                # the last of the rows' programs left the flag and its counter at zero
                assert flag.tolist() == [0, 0], f"the flag after the wait: {flag.tolist()}"
    errors.update(check_mix_cancelling(rows, width, device, rnd, weight_n, pdl))
    bad = {name: e for name, e in errors.items() if not e < TOL_BF16}
    assert not bad, f"small ops rows={rows} width={width} pdl={pdl}: errors {bad} (NaN: unwritten)"
    return errors


def check_mix_cancelling(rows: int, width: int, device: str, rnd: Any, weight: Any,
                         pdl: bool) -> dict[str, float]:
    """attn_res_norm where the mix nearly cancels: sources ``v`` and ``bf16(-v + 1e-3 r)``
    (mostly ``-v`` exactly) weighted alike (a zero query), so the mix is only their rounding
    residue and the Gram form's mean square from dot products of size ``|v|^2`` keeps no
    digit of it: it must recompute it from the mix. No deltas, so no BF16 prefix store
    rounds the residue away; every path against the float32 reference on the same inputs."""
    from stepgraph.runtime.providers import triton_dense as td

    base = rnd(rows, width)
    srcs = [base, (-base.float() + 1e-3 * rnd(rows, width).float()).to(torch.bfloat16)]
    query, norm = torch.zeros_like(weight), rnd(width, scale=0.3)
    attrs = {"sources": 2, "deltas": 0, "eps": 1e-6, "norm_eps": 1e-5}
    out = _poisoned(rows, width, torch.bfloat16, device, pad=1)
    node = node_of("attn_res_norm", 5, 1, **attrs)
    launch = td.attn_res_norm(context(node, [*srcs, query, norm, weight, out], pdl=pdl))
    (want,) = ref_op("attn_res_norm", [t.float() for t in (*srcs, query, norm, weight)],
                     attrs, [torch.float32])
    errors = {}
    for path in ("tile", "gram") if launch.one_tile else ("sweeps",):
        launch.pre_sources = launch.gram = path == "gram"
        out.fill_(float("nan"))
        launch()
        errors[f"attn_res_norm[cancelling].{path}"] = rel_err(out, want)
    return errors


# ----------------------------------------------------------------------------- interpreter


def interpreter_projection() -> None:
    """Small projections in the interpreter."""
    cases = [
        (1, 70, 96, (32, 16, 1, 2), torch.bfloat16, True),
        (3, 50, 200, (16, 16, 3, 2), torch.bfloat16, True),   # K % k_tile != 0, 3 splits
        (17, 40, 64, (32, 16, 2, 2), torch.float32, True),    # 2 row tiles, float32 out
        (5, 33, 256, (64, 8, 4, 3), torch.bfloat16, False),   # even K, 4 splits
        (64, 48, 128, (16, 64, 2, 2), torch.bfloat16, True),
        (2, 24, 48, (16, 16, 8, 2), torch.bfloat16, True),    # more splits than K tiles
        # the GEMV form (n_tile 1): one row, several rows, ragged N and K, 3 splits, f32 out
        (1, 70, 96, (8, 1, 1, 2), torch.bfloat16, True),
        (3, 37, 200, (16, 1, 3, 3), torch.bfloat16, True),
        (1, 40, 256, (4, 1, 2, 4), torch.float32, False),
        (2, 24, 48, (32, 1, 8, 4), torch.bfloat16, True),
        # the GEMV form over 2 / 4 rows a program (n_tile 2, 4): whole and ragged row
        # groups, ragged N and K, 3 splits, f32 out, 2..4 chunks in flight
        (2, 70, 96, (8, 2, 1, 2), torch.bfloat16, True),
        (3, 37, 200, (16, 2, 3, 3), torch.bfloat16, True),
        (4, 40, 256, (4, 4, 2, 4), torch.float32, False),
        (7, 33, 200, (8, 4, 1, 2), torch.bfloat16, True),
    ]
    for seed, (rows, n, k, t, dtype, strided) in enumerate(cases):
        tactic = _tactic(t)
        tactic["k_tile"] = 32 if k >= 64 else 16
        err = check_projection(rows, n, k, tactic, dtype, "cpu", strided=strided, seed=seed)
        print(f"projection rows={rows} n={n} k={k} {t} {dtype}: {err:.2e}")
    err = check_projection(4, 40, 64, {}, torch.bfloat16, "cpu", seed=9)  # empty tactic
    print(f"projection default tactic: {err:.2e}")
    for t in ((32, 16, 3, 2), (16, 2, 3, 2)):  # a reduction launch (MMA, two-row GEMV)
        tactic = {**_tactic(t), "k_tile": 32, "fused": 0}
        err = check_projection(3, 50, 200, tactic, torch.bfloat16, "cpu", seed=10)
        print(f"projection {t} with a reduction launch: {err:.2e}")
    # with an input norm: inside the GEMV (one split; 1 and 3 rows, ragged K, 2 and 3
    # chunks), and through an RMSNorm launch first (GEMV with 2 splits, the MMA form)
    for seed, (rows, n, k, t) in enumerate(((1, 70, 200, (8, 1, 1, 2)),
                                            (3, 37, 96, (16, 1, 1, 3)),
                                            (2, 40, 256, (8, 1, 2, 2)),
                                            (5, 33, 200, (32, 16, 2, 2)),
                                            (2, 70, 200, (8, 2, 1, 2)),
                                            (3, 37, 96, (16, 4, 1, 3)))):
        tactic = {**_tactic(t), "k_tile": 32}
        err = check_projection(rows, n, k, tactic, torch.bfloat16, "cpu", seed=20 + seed,
                               norm=True)
        print(f"projection with an input norm rows={rows} {t}: {err:.2e}")
    # with the experts' combine: inside the GEMV (with and without a norm, 2 and 3 slots,
    # ragged K), through a sum launch first (the GEMV with 2 splits, the MMA form)
    for seed, (rows, n, k, top_k, t, norm) in enumerate(((1, 70, 200, 2, (8, 1, 1, 2), True),
                                                         (1, 37, 96, 3, (16, 1, 1, 3), False),
                                                         (1, 40, 256, 2, (8, 1, 2, 2), True),
                                                         (3, 33, 200, 2, (32, 16, 2, 2), True),
                                                         (3, 70, 200, 2, (8, 2, 1, 2), True),
                                                         (2, 37, 96, 3, (16, 4, 1, 2), False))):
        tactic = {**_tactic(t), "k_tile": 32}
        err = check_combined_projection(rows, n, k, top_k, tactic, "cpu", norm, seed=40 + seed)
        print(f"projection with an input combine rows={rows} {t}: {err:.2e}")



def interpreter_small_ops() -> None:
    """embed / rmsnorm / add / attn_res_mix in the interpreter, and a chain of them with GEMMs."""
    # 7168: K3's width (the nearly cancelling mix needs the Gram form's recompute from 2500)
    for rows, width in ((3, 64), (5, 100), (2, 2500), (1, 7168)):
        print(rows, width, check_small_ops(rows, width, "cpu", seed=rows))
    for rows in (1, 3):
        check_chain(rows, "cpu", hidden=192, n1=160, n2=192, inner=96, replays=2)
        print(f"chain rows={rows}: ok")
    for rows, tactic in ((1, (32, 16, 2, 2)), (3, (16, 16, 4, 2))):  # split gate_up and down
        err = check_gated_mlp(rows, 96, 80, tactic, replays=2, device="cpu", k_tile=16,
                              tol=3e-2)
        print(f"gated mlp rows={rows} {tactic}: {err:.2e}")


def interpreter_runtime() -> None:
    """tiny_k3 through the runtime on CPU with these providers (registered for the CPU here;
    ``splitk`` standing in for every cuBLAS projection) against the reference executor over
    a few decode steps with padded rows."""
    import numpy as np
    from conftest import MODELS

    from stepgraph.compiler import compile_graph
    from stepgraph.lower.decode import DecodeRunner, run_prompts
    from stepgraph.lower.weights import random_weights
    from stepgraph.runtime import load
    from stepgraph.runtime.decode import CompiledDecodeRunner
    from stepgraph.runtime.providers import REGISTRY, load_providers
    from stepgraph.runtime.providers import triton_dense as td
    from stepgraph.runtime.providers import triton_moe as tm
    from stepgraph.runtime.providers.registry import ProviderEntry
    from stepgraph.spec_loader import load_spec, override_deployment

    load_providers()
    for op, provider, factory in (
            ("projection", "cublas", td._projection), ("o_proj", "cublas", td._projection),
            ("rmsnorm", "triton", td.rmsnorm), ("add", "triton", td.add),
            ("attn_res_mix", "triton", td.attn_res_mix),
            ("attn_res_norm", "triton", td.attn_res_norm), ("router", "triton", td.router),
            ("routed_experts", "triton_fused_moe", tm.routed_experts)):
        REGISTRY.add(ProviderEntry(op, provider, factory, ("cuda", "cpu")))
    spec = load_spec(MODELS / "tiny_k3.yaml")
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, target="h200"))
    step = load(graph, weights="random", device="cpu", dtype="float32", block_size=4,
                max_context=16, progress=False, allow_target_mismatch=True)
    report = step.report()
    print(report)
    # (tiny_k3 has no rmsnorm launch left: the fuse pass made each its projection's input
    # norm, which the split-K GEMM standing in for cuBLAS computes)
    assert any("input_norm_eps" in n.attrs for n in graph)
    for needle in ("routed_experts:triton_fused_moe", "router:triton", "projection:cublas",
                   "attn_res_norm:triton"):
        assert needle in report, f"the runtime did not pick {needle}"
    prompts = [[1, 2, 3], [10, 20], [200, 100, 50], [7]]  # 4, 4, 3 (one padded) rows
    got = run_prompts(CompiledDecodeRunner(step), prompts)
    want = run_prompts(DecodeRunner(graph, random_weights(graph, 0, dtype=torch.float32),
                                    len(prompts), 14, block_size=4), prompts)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "different rows are defined"
    defined = ~np.isnan(want)
    err = float(np.linalg.norm(got[defined] - want[defined]) / np.linalg.norm(want[defined]))
    print(f"tiny_k3 logits relative error {err:.2e}")
    # float32 everywhere but the MoE's BF16 intermediate (and the interpreter's BF16
    # rounding, which truncates): well under 1e-2
    assert err < 1e-2, f"tiny_k3 through the runtime: logits relative error {err:.3e}"


# ----------------------------------------------------------------------------- sm_90 compiles


def _meta(*shape: int, dtype: Any = torch.bfloat16) -> Any:
    return torch.empty(*shape, dtype=dtype, device="meta")


def sm90_projection() -> None:
    """Every K3 projection shape x table tactic x bin compiles well for sm_90."""
    from stepgraph.runtime.kernels.splitk_gemm import SMEM_LIMIT, SplitKGemm, SplitKTactic

    seen: set[tuple[Any, ...]] = set()
    for n, k, out_name, tactics in K3_PROJECTIONS:
        for t in tactics:
            for rows in ROWS:
                gemm = SplitKGemm(_meta(rows, k), _meta(n, k),
                                  _meta(rows, n, dtype=_dtype(out_name)),
                                  SplitKTactic(*t), pdl=False)
                gemm.pdl = True  # meta tensors: pdl_allowed says no; compile the PDL form
                p = gemm.plan
                key = (p.block_w, p.block_r, p.block_k, p.split, p.stages, p.warps, out_name)
                if key in seen:
                    continue
                seen.add(key)
                where = f"n={n} k={k} rows={rows} tactic={t} plan={p}"
                for c in sm90_compiles(gemm):
                    print(f"{c.name} {key}: {c.regs} regs, {c.spills} B spilled, "
                          f"{c.shared} B shared")
                    assert c.spills == 0, f"{where}: {c.name} spills {c.spills} bytes"
                    assert c.shared <= SMEM_LIMIT, f"{where}: {c.name} shared {c.shared}"
                    assert "griddepcontrol.wait" in c.ptx, f"{where}: {c.name} has no PDL wait"
                    if c.name in ("_splitk_kernel", *GEMV_KERNELS):
                        assert c.loads_before_wait(), f"{where}: no weight load before the wait"
                        assert "griddepcontrol.launch_dependents" in c.ptx, where
                    if c.name == "_splitk_kernel":
                        assert "async_copy" in c.ttgir or "async_tma" in c.ttgir, \
                            f"{where}: the main loop is not pipelined"
                    if c.name in GEMV_KERNELS:  # registers only: no shared-memory staging
                        assert "async_copy" not in c.ttgir and c.shared <= 8192, \
                            f"{where}: the GEMV stages through shared memory"
                    if c.name == "gemv_rows_kernel":
                        assert p.block_r == t[1] and c.regs <= 65536 // (32 * p.warps) // 2, \
                            f"{where}: {c.regs} registers: under two programs an SM"
                        _assert_row_major_chunks(c.ttgir, where)
    # the GEMV with an input norm (k3-rank-tp8's routed_up, a TP1 in_proj, the lm_head):
    # still two programs an SM (at most 128 registers at 8 warps), no spills
    from stepgraph.runtime.kernels.splitk_gemm import InputNorm

    for n, k, t in ((7168, 3584, (32, 1, 1, 2, 0, 8)), (6288, 7168, (8, 1, 1, 2, 0, 8)),
                    (20480, 7168, (16, 1, 1, 2, 0, 8))):
        gemm = SplitKGemm(_meta(1, k), _meta(n, k), _meta(1, n), SplitKTactic(*t),
                          norm=InputNorm(_meta(k), 1e-5, torch.bfloat16))
        gemm.pdl = True
        (c,) = sm90_compiles(gemm)
        print(f"{c.name} {n}x{k} with an input norm: {c.regs} regs, {c.spills} B spilled")
        assert c.spills == 0 and c.regs <= 128, f"{n}x{k} input norm: {c.regs} regs"
        assert c.loads_before_wait(), f"{n}x{k} input norm: no weight load before the wait"
    # routed_expert_up summing k3-rank-tp8's two expert slots while it streams, with its norm,
    # at one row and at the H200 table's bin 2 (two rows a program)
    for rows, kernel in ((1, "_gemv_kernel"), (2, "gemv_rows_kernel")):
        gemm = SplitKGemm(_meta(rows, 2, 3584, dtype=torch.float32), _meta(7168, 3584),
                          _meta(rows, 7168), SplitKTactic(32, rows, 1, 2, 0, 8),
                          norm=InputNorm(_meta(3584), 1e-5, torch.bfloat16),
                          combine=torch.bfloat16)
        gemm.pdl = True
        (c,) = sm90_compiles(gemm)
        where = f"7168x3584, {rows} row(s), with an input combine and norm"
        print(f"{c.name} {where}: {c.regs} regs, {c.spills} B")
        assert c.name == kernel and c.spills == 0 and c.regs <= 128, f"{where}: {c.regs}"
        assert c.loads_before_wait(), f"{where}: no weight load before the wait"
        if rows > 1:
            _assert_row_major_chunks(c.ttgir, where)


def _assert_row_major_chunks(ttgir: str, where: str) -> None:
    """The multi-row GEMV's weight chunks ``[CHUNK_K / 8, BLOCK_W, 8]`` load 16 bytes a
    thread with a warp's lanes along the chunk's columns (one weight row's contiguous bytes),
    not across weight rows (what Triton picks without the kernel's contiguity hint)."""
    layouts = re.findall(r"sizePerThread = \[1, 1, 8\], threadsPerWarp = \[(\d+), (\d+), 1\]",
                         ttgir)
    assert layouts, f"{where}: no [1, 1, 8] 3-D load layout in the TTGIR"
    assert all(lanes == "32" for lanes, _ in layouts), \
        f"{where}: a warp's lanes span weight rows (threadsPerWarp {layouts})"


def sm90_small_ops() -> None:
    """rmsnorm / add / attn_res_mix / attn_res_norm at K3 widths compile for sm_90 without
    spills."""
    from stepgraph.runtime.kernels.elementwise import Add, AttnResMix, AttnResNorm, RmsNorm

    for width in (7168, 3584, 448):
        x = _meta(64, width)
        w = _meta(width)
        launches = [RmsNorm(x, w, _meta(64, width), 1e-5), RmsNorm(_meta(64, width,
                    dtype=torch.float32), w, _meta(64, width), 1e-5),
                    Add([x, x], _meta(64, width)),
                    AttnResMix([x] * 12, w, w, _meta(64, width), 1e-6),
                    AttnResMix([x] * 24, w, w, _meta(64, width), 1e-6),
                    AttnResNorm([x] * 9, [x, x], w, w, w, _meta(64, width), _meta(64, width),
                                1e-6, 1e-5),
                    AttnResNorm([x] * 3, [], w, w, w, _meta(64, width), None, 1e-6, 1e-5),
                    AttnResNorm([x] * 2, [x, x], w, w, w, _meta(64, width), _meta(64, width),
                                1e-6, 1e-5),  # k3-rank-tp8's most common mix
                    AttnResNorm([x] * 3, [x], w, w, w, _meta(64, width), _meta(64, width),
                                1e-6, 1e-5)]  # K3's 3-source mix: the one-tile kernel
        for launch in launches:
            launch.pdl = True
            for c in sm90_compiles(launch):
                print(f"{c.name} width={width}: {c.regs} regs, {c.spills} B spilled")
                assert c.spills == 0, f"{c.name} width={width}: spills {c.spills} bytes"
                assert "griddepcontrol.wait" in c.ptx, f"{c.name}: no PDL wait"
        # a mix waiting on a signalled branch's flag: it spins before its PDL wait, and so
        # before its dependents may launch
        flag = _meta(2, dtype=torch.int32)
        for one_tile in (True, False):
            mix = AttnResNorm([x] * 2, [x, x], w, w, w, _meta(64, width), _meta(64, width),
                              1e-6, 1e-5, one_tile=one_tile, wait=flag)
            mix.pdl = True
            (c,) = sm90_compiles(mix)
            assert c.spills == 0, f"waiting mix, width={width}: spills {c.spills}"
            head = c.ptx[:c.ptx.index("griddepcontrol.wait")]
            assert "gpu.acquire" in head, f"width={width}: no acquiring spin before the wait"
        # the one-tile mix with its sources readable before the wait loads them there
        for sources, deltas in ((2, 2), (3, 1)):
            loads = []
            for pre in (False, True):
                mix = AttnResNorm([x] * sources, [x] * deltas, w, w, w, _meta(64, width),
                                  _meta(64, width), 1e-6, 1e-5)
                mix.pdl, mix.pre_sources = True, pre
                (c,) = sm90_compiles(mix)
                assert c.spills == 0, f"pre-wait sources, width={width}: spills {c.spills}"
                loads.append(c.ptx[:c.ptx.index("griddepcontrol.wait")].count("ld.global"))
            print(f"attn_res_norm {sources}+{deltas} width={width}: loads before the wait "
                  f"{loads[0]} -> {loads[1]}")
            assert loads[1] > loads[0], f"width={width}: no source loads before the wait"
            # the earlier sources mixed before the wait: fewer barriers after it
            barriers = []
            for gram in (False, True):
                mix = AttnResNorm([x] * sources, [x] * deltas, w, w, w, _meta(64, width),
                                  _meta(64, width), 1e-6, 1e-5)
                mix.pdl, mix.pre_sources, mix.gram = True, True, gram
                (c,) = sm90_compiles(mix)
                assert c.spills == 0, f"gram={gram}, width={width}: spills {c.spills}"
                barriers.append(c.ptx[c.ptx.index("griddepcontrol.wait"):].count("bar.sync"))
            print(f"attn_res_norm {sources}+{deltas} width={width}: barriers after the wait "
                  f"{barriers[0]} -> {barriers[1]} (gram; its rare recompute's included)")
            assert barriers[1] < barriers[0], f"width={width}: gram form saves no barrier"


# ----------------------------------------------------------------------------- CPU tests

CHECKS = {
    "interp-projection": interpreter_projection,
    "interp-small": interpreter_small_ops,
    "interp-runtime": interpreter_runtime,
    "sm90-projection": sm90_projection,
    "sm90-small": sm90_small_ops,
}


@needs_triton
@pytest.mark.parametrize("check", ["interp-projection", "interp-small"])
def test_interpreter(check: str) -> None:
    """The kernels in Triton's CPU interpreter against the reference ops."""
    result = run_script(HERE, check, interpret=True)
    assert result.returncode == 0, explain(result)


@needs_triton
@pytest.mark.slow
def test_interpreter_runtime_tiny_k3() -> None:
    """tiny_k3 through the runtime with these providers in the interpreter vs the reference."""
    result = run_script(HERE, "interp-runtime", interpret=True)
    assert result.returncode == 0, explain(result)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("check", ["sm90-projection", "sm90-small"])
def test_sm90_compile(check: str) -> None:
    """The launches at K3 shapes compile for sm_90 (no GPU needed) without spills, with PDL."""
    result = run_script(HERE, check, interpret=False)
    assert result.returncode == 0, explain(result)


def test_sharded_rmsnorm_over_ranks_is_declined() -> None:
    """A sharded rmsnorm over 2 ranks is declined (NotImplementedError: the runtime tries
    the next provider), naming the node."""
    pytest.importorskip("triton")
    from stepgraph.runtime.providers.triton_dense import rmsnorm

    node = node_of("rmsnorm", 2, 1, eps=1e-5, group="tp", ways=2)
    x = torch.randn(2, 8)
    with pytest.raises(NotImplementedError, match=r"test\.rmsnorm.*2 ranks"):
        rmsnorm(context(node, [x, torch.ones(8), torch.empty(2, 8)]))


def test_providers_are_registered() -> None:
    """The tactic table's provider names resolve to these factories on CUDA."""
    pytest.importorskip("triton")
    from stepgraph.runtime.providers import REGISTRY
    from stepgraph.runtime.providers import triton_dense as td

    assert REGISTRY.get("projection", "splitk").factory is td._projection
    assert REGISTRY.get("o_proj", "splitk").factory is td._projection
    for op in ("rmsnorm", "add", "attn_res_mix", "attn_res_norm", "router"):
        entry = REGISTRY.get(op, "triton")
        assert entry is not None and entry.devices == ("cuda",), op
        assert entry.factory is getattr(td, op)


def test_tune_table_round_trip(tmp_path: Path) -> None:
    """Measurements -> a table file that loads as valid tactic tables, where the measured
    shape's bins pick the fastest choice and the base file's other rows stay."""
    pytest.importorskip("yaml")
    from stepgraph.runtime.tune import Measurement, ProjShape, table_rows, write_table
    from stepgraph.tactics import load_tables, table_path

    shape = ProjShape(6288, 7168, "bfloat16")
    results = [Measurement(shape, 1, 10.0, {(128, 8, 2, 6): 9.0, (64, 8, 4, 8): 9.5}),
               Measurement(shape, 16, 10.0, {(128, 16, 2, 6): 12.0}),
               Measurement(shape, 64, 30.0, {(64, 64, 1, 6): 20.0})]
    out = tmp_path / "h200.measured.yaml"
    source = "measured on TESTGPU 2026-01-01 by stepgraph tune"
    write_table(table_path("h200"), table_rows(results, 1, source), out, "TEST", "2026-01-01")
    tables = load_tables("h200", path=out)
    one = tables.choose("projection", 1, 6288, 7168, tp=8)
    assert (one.provider, one.tactic["split"], one.tactic["m_tile"]) == ("splitk", 2, 128)
    assert source in one.reason
    assert tables.choose("projection", 16, 6288, 7168, tp=8).provider == "cublas"
    assert tables.choose("projection", 64, 6288, 7168, tp=8).tactic["n_tile"] == 64
    seeded = tables.choose("projection", 8, 3648, 7168, tp=8)  # a base row, kept
    assert seeded.provider == "splitk" and "seeds 000" in seeded.reason
    only = tmp_path / "splitk-only.yaml"
    write_table(table_path("h200"), table_rows(results, 1, source, math.inf), only,
                "TEST", "2026-01-01")
    tables = load_tables("h200", path=only)
    forced = tables.choose("projection", 16, 6288, 7168, tp=8)  # cuBLAS was faster alone
    assert (forced.provider, forced.tactic["m_tile"]) == ("splitk", 128)
    mlp = tables.choose("shared_expert", 16, 6288, 7168, tp=8)  # a gated MLP's gate_up shape
    assert mlp.provider == "splitk"


def test_tune_refuses_without_cuda() -> None:
    """`stepgraph tune` on a machine without CUDA: exit 2 and a one-line message."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from conftest import run_cli

    result = run_cli("tune", "nothing.sgart", "--out", "x.yaml")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "CUDA" in result.stderr, result.stderr


def test_tune_shapes_select_the_named_weight_shapes_of_the_artifact() -> None:
    """`tune --shapes` on K3 at TP8: the MoE front (560 x 7168) and routed_up (7168 x 448),
    the two projection shapes no H200 table row holds there, are picked out in graph order;
    a shape the plan lacks is refused in one line that lists the plan's shapes."""
    from conftest import MODELS

    from stepgraph.compiler import compile_graph
    from stepgraph.errors import UserError
    from stepgraph.runtime.tune import projection_shapes, select_shapes
    from stepgraph.spec_loader import load_spec

    spec = load_spec(MODELS / "kimi_k3.yaml")
    graph, _ = compile_graph(spec, spec.deployment.model_copy(update={"tp": 8}))
    shapes = projection_shapes(graph)
    untabled = {(graph.values[n.inputs[1]].type.shape)
                for n in graph if n.op == "projection"
                and graph.meta["decisions"][n.name]["1"]["provider"] == "cublas"}
    assert untabled == {(560, 7168), (7168, 448)}
    chosen = select_shapes(shapes, [(7168, 448), (560, 7168)], "k3.sgart")
    assert [(s.n, s.k) for s in chosen] == [(560, 7168), (7168, 448)]  # the front comes first
    assert select_shapes(shapes, None, "k3.sgart") == shapes
    with pytest.raises(UserError, match=r"--shapes: 561x7168 is not a projection weight "
                                        r"shape of k3\.sgart; its shapes: .*560x7168"):
        select_shapes(shapes, [(560, 7168), (561, 7168)], "k3.sgart")


def test_candidate_tactics_keep_two_k_tiles_a_split() -> None:
    """The tuning grid never splits K below two K tiles a split, and takes the GEMV forms
    (one program for all the rows, in groups of 1, 2 or 4) only up to four rows."""
    from stepgraph.runtime.tune import candidate_tactics

    for rows in ROWS:
        for k in (1536, 3584, 7168):
            for m_tile, n_tile, split, *_ in candidate_tactics(rows, k):
                assert split == 1 or k // split >= 2 * (16384 // (2 * m_tile)), (k, split)
                assert 8 <= n_tile <= 64 or n_tile == {1: 1, 2: 2, 3: 4, 4: 4}.get(rows), \
                    (rows, n_tile)


# ----------------------------------------------------------------------------- GPU tests

gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape", K3_PROJECTIONS, ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_projection_gpu(shape: tuple[Any, ...]) -> None:
    """K3 per-rank projections at rows 1..64 with each tactic, eager, PDL on."""
    n, k, out_name, tactics = shape
    worst = 0.0
    for i, t in enumerate(tactics):
        for rows in ROWS:
            worst = max(worst, check_projection(rows, n, k, _tactic(t), _dtype(out_name),
                                                "cuda", pdl=True, strided=rows % 2 == 0,
                                                seed=100 * i + rows))
    print(f"projection {n}x{k} {out_name}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_projection_with_input_combine_gpu(rows: int) -> None:
    """routed_expert_up of k3-rank-tp8 (7168 x 3584, top-2 slots) with its latent norm and
    the experts' combine: the one-row GEMV sums the slots while it streams (its table
    tactic), more rows sum them in a launch first; bit-equal to the slots summed apart."""
    tactic = (32, 1, 1, 2, 0, 8) if rows == 1 else (64, 8, 2, 4)
    for norm in (True, False):
        err = check_combined_projection(rows, 7168, 3584, 2, _tactic(tactic), "cuda", norm,
                                        seed=rows)
        print(f"rows={rows} norm={norm}: {err:.2e}")


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_projection_with_input_norm_gpu(rows: int) -> None:
    """A projection with the fuse pass's input norm right after the launch writing its rows
    (an add), both PDL, captured in one CUDA graph and replayed on fresh rows: the GEMV
    normalizes inside at one row (routed_expert_up's table tactic), the MMA form runs the
    norm launch first; against rmsnorm -> matmul in float32 (a stale read of the rows shows
    as a large error, an unwritten output as NaN)."""
    from stepgraph.runtime.providers import triton_dense as td

    n, k = 7168, 3584
    gen = torch.Generator().manual_seed(rows)
    dev = "cuda"
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(dev)
    g = (1.0 + 0.5 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(dev)
    a = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    x = torch.empty_like(a)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    attrs = {"input_norm_eps": 1e-5, "input_norm_dtype": "bfloat16"}
    tactic = (32, 1, 1, 2, 0, 8) if rows == 1 else (64, 8, 2, 4)
    launches = [
        td.add(context(node_of("add", 2, 1), [a, b, x], pdl=True)),
        td._projection(context(node_of("projection", 3, 1, **attrs), [x, w, g, out],
                               pdl=True, tactic=_tactic(tactic))),
    ]
    runner = Replayer(launches, dev)
    for replay in range(4):
        scale = 3.0 * (1 + replay)
        a.copy_((torch.randn(rows, k, generator=gen) * scale).to(torch.bfloat16))
        b.copy_((torch.randn(rows, k, generator=gen) * scale).to(torch.bfloat16))
        out.fill_(float("nan"))
        runner.replay()
        ref = ref_op("projection", [x.float(), w.float(), g.float()], attrs,
                     [torch.float32])[0]
        err = rel_err(out, ref)
        print(f"input norm rows={rows} replay {replay}: {err:.2e}")
        assert err < TOL_BF16, f"rows={rows} replay {replay}: relative error {err:.3e}"


def check_chain(rows: int, device: str, hidden: int = 7168, n1: int = 6288, n2: int = 7168,
                inner: int = 1536, replays: int = 5) -> None:
    """rmsnorm -> in_proj (split 2) -> o_proj-like GEMM (split 4, reading a column view of
    the first) -> add, with PDL, captured in one CUDA graph (eager off CUDA) and replayed on
    fresh inputs: every kernel must wait for its producer (a stale read shows as a large
    error; an unwritten output as NaN)."""
    from stepgraph.runtime.providers import triton_dense as td

    gen = torch.Generator().manual_seed(rows)
    dev = device
    w_norm = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).to(dev)
    w1 = (torch.randn(n1, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(n2, inner, generator=gen) / inner ** 0.5).to(torch.bfloat16).to(dev)
    h = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    normed = torch.empty_like(h)
    proj = torch.empty(rows, n1, dtype=torch.bfloat16, device=dev)
    o = torch.empty(rows, n2, dtype=torch.bfloat16, device=dev)
    total = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    lo = min(100, n1 - inner)
    view = proj[:, lo:lo + inner]  # a column view of the packed output
    h.copy_(torch.randn(rows, hidden, generator=gen).to(torch.bfloat16))
    pdl = True
    launches = [
        td.rmsnorm(context(node_of("rmsnorm", 2, 1, eps=1e-5), [h, w_norm, normed], pdl=pdl)),
        td._projection(context(node_of("projection", 2, 1), [normed, w1, proj], pdl=pdl,
                               tactic=_tactic((128, 16, 2, 6)))),
        td._projection(context(node_of("o_proj", 2, 1), [view, w2, o], pdl=pdl,
                               tactic=_tactic((64, 16, 4, 6)))),
        td.add(context(node_of("add", 2, 1), [h, o, total], pdl=pdl)),
    ]
    runner = Replayer(launches, dev)
    for replay in range(replays):
        h.copy_((torch.randn(rows, hidden, generator=gen) * (1 + replay)).to(torch.bfloat16))
        for t in (normed, proj, o, total):
            t.fill_(float("nan"))
        runner.replay()
        ref_n = ref_op("rmsnorm", [h.float(), w_norm.float()], {"eps": 1e-5}, [torch.float32])[0]
        ref_p = ref_n @ w1.float().T
        ref_o = ref_p[:, lo:lo + inner] @ w2.float().T
        ref_t = h.float() + ref_o
        for name, out, ref in (("rmsnorm", normed, ref_n), ("in_proj", proj, ref_p),
                               ("o_proj", o, ref_o), ("add", total, ref_t)):
            err = rel_err(out, ref)
            assert err < TOL_BF16, (f"replay {replay} rows={rows} on {device}: {name} "
                                    f"relative error {err:.3e} (NaN: unwritten; large: stale "
                                    f"input)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", ROWS)
def test_graph_chain_with_pdl_gpu(rows: int) -> None:
    """The chain of :func:`check_chain` at K3 shapes in a CUDA graph with PDL."""
    check_chain(rows, "cuda")


def check_gated_mlp(rows: int, hidden: int, width: int, tactic: tuple[int, ...],
                    replays: int = 3, device: str = "cuda", k_tile: int = 0,
                    tol: float = TOL_BF16) -> float:
    """The split-K gated MLP (gate_up, SiTU, down) between an rmsnorm and an add, all with
    PDL in one CUDA graph (eager off CUDA), replayed on fresh inputs against the reference's
    linear and gated activation in float32 on the same normed rows, rounded to BF16 where the
    kernels store: the worst relative error (a stale intermediate or an unwritten output
    fails). ``tol``: the interpreter's BF16 GEMMs land about one BF16 step off float32, and
    SiTU passes that on from both halves, so its tiny shapes get a looser bound."""
    from stepgraph.lower.ref_common import gated_activation, linear
    from stepgraph.runtime.providers import triton_dense as td

    gen = torch.Generator().manual_seed(rows + width)
    dev = device
    attrs = {"width": width, "activation": "situ", "beta": 4.0, "beta_linear": 25.0}
    w_norm = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).to(dev)
    gate_up = (torch.randn(2 * width, hidden, generator=gen) / hidden ** 0.5).to(
        torch.bfloat16).to(dev)
    down = (torch.randn(hidden, width, generator=gen) / width ** 0.5).to(torch.bfloat16).to(dev)
    h = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    normed, mlp, total = (torch.empty_like(h) for _ in range(3))
    launches = [
        td.rmsnorm(context(node_of("rmsnorm", 2, 1, eps=1e-5), [h, w_norm, normed], pdl=True)),
        td._gated_mlp(context(node_of("shared_expert", 3, 1, **attrs),
                              [normed, gate_up, down, mlp], pdl=True,
                              tactic={**_tactic(tactic), "k_tile": k_tile})),
        td.add(context(node_of("add", 2, 1), [h, mlp, total], pdl=True)),
    ]
    runner = Replayer(launches, dev)
    worst = 0.0
    for replay in range(replays):
        h.copy_((torch.randn(rows, hidden, generator=gen) * (1 + replay)).to(torch.bfloat16))
        for t in (normed, mlp, total):
            t.fill_(float("nan"))
        runner.replay()
        ref_n = ref_op("rmsnorm", [h.float(), w_norm.float()], {"eps": 1e-5}, [torch.float32])[0]
        # the reference's gated MLP in float32, rounded to BF16 where the kernels store
        h_ref = linear(normed, gate_up, torch.float32).to(torch.bfloat16)
        act_ref = gated_activation(h_ref[:, :width], h_ref[:, width:], attrs)
        ref_m = linear(act_ref, down, torch.float32)
        for name, out, ref in (("mlp", mlp, ref_m), ("add", total, h.float() + ref_m)):
            err = rel_err(out, ref)
            assert err < tol, (f"replay {replay} rows={rows} width={width}: {name} "
                                    f"relative error {err:.3e}")
            worst = max(worst, err)
        assert rel_err(normed, ref_n) < TOL_BF16
    return worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width,tactic", [(768, (64, 8, 4, 4)), (6144, (128, 16, 2, 4)),
                                          (6144, (64, 64, 1, 4))])
def test_gated_mlp_splitk_gpu(width: int, tactic: tuple[int, ...]) -> None:
    """The shared expert at K3 TP8 (768 wide) and TP1 (6144) widths, rows 1..64."""
    worst = max(check_gated_mlp(rows, 7168, width, tactic) for rows in ROWS)
    print(f"gated mlp {width} {tactic}: worst relative error {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", (7168, 3584))
def test_small_ops_gpu(width: int) -> None:
    """rmsnorm / add / attn_res_mix / attn_res_norm at K3 widths, rows 1..64, PDL on."""
    for rows in ROWS:
        errors = check_small_ops(rows, width, "cuda", pdl=True, seed=rows)
        print(rows, width, {k: f"{v:.1e}" for k, v in errors.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tune_on_gpu(tmp_path: Path) -> None:
    """`stepgraph tune` on tiny_k3 (bins 1, 8, quick grid) writes a valid table whose rows
    say they were measured by stepgraph tune."""
    from conftest import MODELS, run_cli

    artifact = tmp_path / "tiny.sgart"
    from conftest import card_target

    target = card_target()
    result = run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--target", target, "-o",
                     str(artifact))
    assert result.returncode == 0, result.stderr
    from stepgraph.artifact import load_artifact
    from stepgraph.runtime.tune import projection_shapes

    shapes = projection_shapes(load_artifact(artifact).graph)[:2]  # --shapes picks these
    out = tmp_path / "measured.yaml"
    result = run_cli("tune", str(artifact), "--out", str(out), "--bins", "1,8", "--quick",
                     "--no-progress", "--shapes", ",".join(f"{s.n}x{s.k}" for s in shapes))
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    from stepgraph.tactics import load_tables

    tables = load_tables(target, path=out)
    rows = tables.data.tactics["projection"].rows
    # The rows written now are those the base table lacks (its own rows may carry the same
    # "by stepgraph tune" and margin words: some were written by earlier runs and committed).
    base_rows = load_tables(target).data.tactics["projection"].rows
    measured = [row for row in rows if row not in base_rows]
    assert sorted((row.match["n"], row.match["k"]) for row in measured) == sorted(
        (s.n, s.k) for s in shapes), measured
    margin = f"cuBLAS where faster alone by more than {tables.data.pdl.cublas_break_us:g} us"
    assert f"choices: {margin}" in result.stdout  # the target table's chain break by default
    card = torch.cuda.get_device_name()
    for row in measured:
        assert f"measured on {card}" in row.source and margin in row.source, row.source
        assert set(row.bins) >= {1, 8}, row.bins


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(CHECKS)}}}")
    if sys.argv[1].startswith("interp"):
        patch_interpreter()
    torch.manual_seed(0)
    CHECKS[sys.argv[1]]()
    print("ok")
