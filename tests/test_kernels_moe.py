"""The MoE Triton providers (``triton_fused_moe`` routed experts, ``triton`` router) against
the reference executor's op functions on fresh random inputs.

CPU, interpreter (this file as a script in a subprocess with ``TRITON_INTERPRET=1``): small
shapes, SiTU and SiLU, float32 and BF16 inputs read through column views, experts of other
ranks (``expert_offset``) dropped, rows whose experts are all elsewhere, several row chunks
per expert; the router with sigmoid / softmax, with and without the correction bias.
CPU, sm_90 compiles: K3 per-rank shapes (64 and 112 local experts, 3584 x 3072, top-16;
router over 64 / 112 / 896 experts) compile without spills, pipelined, with PDL waits.
GPU (``-m gpu``): those shapes at rows 1..64 in BF16 against the float32 reference
(||out - ref|| / ||ref|| < 1e-2, no NaN, outputs poisoned first), and router -> experts
captured in a CUDA graph with PDL, replayed on fresh inputs.
"""

from __future__ import annotations

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
ROWS = (1, 2, 4, 8, 16, 32, 64)
SITU = {"activation": "situ", "beta": 4.0, "beta_linear": 25.0}
SILU = {"activation": "silu"}

needs_triton = pytest.mark.skipif(not has_triton(), reason="triton is not installed")


# ----------------------------------------------------------------------------- inputs


def routing(rows: int, experts: int, top_k: int, gen: Any, device: str) -> tuple[Any, Any]:
    """Distinct top-k ids of random scores (int32) and positive weights summing to 1."""
    scores = torch.rand(rows, experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(rows, top_k, generator=gen) + 0.1
    weights = weights / weights.sum(1, keepdim=True)
    return ids.to(device), weights.to(device)


def expert_weights(local: int, width: int, inter: int, gen: Any, device: str) -> tuple[Any, Any]:
    """Random BF16 gate_up [local, 2I, W] and down [local, W, I], scaled like a trained
    model (1/sqrt(fan-in)); generated on ``device``."""
    g = torch.Generator(device=device).manual_seed(int(torch.randint(1 << 30, (1,),
                                                                     generator=gen)))
    gate_up = (torch.randn(local, 2 * inter, width, generator=g, device=device)
               / width ** 0.5).to(torch.bfloat16)
    down = (torch.randn(local, width, inter, generator=g, device=device)
            / inter ** 0.5).to(torch.bfloat16)
    return gate_up, down


def check_routed_experts(rows: int, experts: int, local: int, offset: int, top_k: int,
                         width: int, inter: int, act: dict[str, Any], x_dtype: Any,
                         device: str, weights: tuple[Any, Any] | None = None,
                         tactic: dict[str, int] | None = None, pdl: bool = False,
                         seed: int = 0) -> float:
    """The provider on fresh random rows and routing; x a column view of a wider buffer;
    out poisoned with NaN. Returns the relative error against the float32 reference."""
    from stepgraph.runtime.providers.triton_moe import routed_experts

    gen = torch.Generator().manual_seed(seed)
    xs = (torch.randn(rows, width + 7, generator=gen) * 2).to(x_dtype).to(device)
    x = xs[:, 3:3 + width]
    ids, wts = routing(rows, experts, top_k, gen, device)
    gate_up, down = weights or expert_weights(local, width, inter, gen, device)
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device=device)
    attrs = {"experts": experts, "expert_offset": offset, "local_experts": local,
             "top_k": top_k, "width": inter, **act}
    node = node_of("routed_experts", 5, 1, **attrs)
    routed_experts(context(node, [x, ids, wts, gate_up, down, out], pdl=pdl, tactic=tactic))()
    ref = ref_op("routed_experts", [x.float(), ids, wts, gate_up.float(), down.float()],
                 attrs, [torch.float32])[0]
    where = (f"routed_experts rows={rows} experts={experts} local={local} offset={offset} "
             f"top_k={top_k} W={width} I={inter} {act['activation']} x={x_dtype} "
             f"tactic={tactic} pdl={pdl}")
    assert not torch.isnan(out).any(), f"{where}: NaN (unwritten) in the output"
    held = ((ids.long() >= offset) & (ids.long() < offset + local)).any(1)
    assert (out[~held] == 0).all(), f"{where}: rows with no expert here are not zero"
    err = rel_err(out, ref) if held.any() else 0.0
    assert err < TOL_BF16, f"{where}: relative error {err:.3e} >= {TOL_BF16}"
    return err


def check_combine_forms(rows: int, experts: int, local: int, offset: int, top_k: int,
                        width: int, inter: int, device: str,
                        weights: tuple[Any, Any] | None = None,
                        tactic: dict[str, int] | None = None, seed: int = 0) -> None:
    """The down launch's own combine (tactic ``combine`` 1) and the combine launch (0)
    write the same bits on the same fresh inputs (both summing in slot order), twice in a
    row (the tile counters must be left at zero for the next launch), and both match the
    float32 reference. Holding every expert, the fuse pass's form too: the slots the down
    launch leaves (NaN-poisoned first: each must be written), summed by the add kernel,
    give the combine launch's bits, and the slots match the reference's."""
    from stepgraph.runtime.providers.triton_moe import routed_experts

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * 2).to(device)
    ids, wts = routing(rows, experts, top_k, gen, device)
    gate_up, down = weights or expert_weights(local, width, inter, gen, device)
    attrs = {"experts": experts, "expert_offset": offset, "local_experts": local,
             "top_k": top_k, "width": inter, **SITU}
    node = node_of("routed_experts", 5, 1, **attrs)
    outs = []
    for combine in (1, 0, 1):
        out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device=device)
        launch = routed_experts(context(node, [x, ids, wts, gate_up, down, out], pdl=True,
                                        tactic={**(tactic or {}), "combine": combine}))
        launch()
        outs.append(out)
    where = f"rows={rows} experts={experts} local={local}+{offset} k={top_k} {width}x{inter}"
    assert not torch.isnan(outs[1]).any(), f"{where}: NaN from the combine launch"
    assert torch.equal(outs[0], outs[1]), f"{where}: fused and launched combines differ"
    assert torch.equal(outs[2], outs[1]), f"{where}: a second fused combine differs"
    ref = ref_op("routed_experts", [x.float(), ids, wts, gate_up.float(), down.float()],
                 attrs, [torch.float32])[0]
    err = rel_err(outs[0], ref)
    assert err < TOL_BF16, f"{where}: relative error {err:.3e} against the reference"
    if local != experts:
        return
    from stepgraph.runtime.kernels.elementwise import Add

    slot_attrs = {**attrs, "slots": True, "slot_dtype": "float32"}
    slots = torch.full((rows, top_k, width), float("nan"), device=device)
    routed_experts(context(node_of("routed_experts", 5, 1, **slot_attrs),
                           [x, ids, wts, gate_up, down, slots], pdl=True, tactic=tactic))()
    assert not torch.isnan(slots).any(), f"{where}: a slot left unwritten"
    summed = torch.empty(rows, width, dtype=torch.bfloat16, device=device)
    Add([slots[:, j] for j in range(top_k)], summed)()
    assert torch.equal(summed, outs[1]), f"{where}: summed slots differ from the combine"
    ref = ref_op("routed_experts", [x.float(), ids, wts, gate_up.float(), down.float()],
                 slot_attrs, [torch.float32])[0]
    err = rel_err(slots, ref)
    assert err < TOL_BF16, f"{where}: slots' relative error {err:.3e} against the reference"


def check_router(rows: int, experts: int, top_k: int, score: str, bias: bool,
                 renormalize: bool, device: str, pdl: bool = False, seed: int = 0) -> float:
    """The router provider against the reference: the same set of ids per row and the same
    weights per id (the order within a row is free). Returns the largest weight error."""
    from stepgraph.runtime.providers.triton_dense import router

    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, experts + 5, generator=gen) * 2
    logits = wide[:, 2:2 + experts].to(device)  # a column view, as in the packed MoE front
    ins = [logits]
    if bias:
        ins.append((torch.randn(experts, generator=gen) * 0.2).to(device))
    attrs = {"experts": experts, "top_k": top_k, "score": score, "correction_bias": bias,
             "renormalize": renormalize, "scaling_factor": 2.5}
    ids = torch.full((rows, top_k), -1, dtype=torch.int32, device=device)
    wts = torch.full((rows, top_k), float("nan"), device=device)
    node = node_of("router", len(ins), 2, **attrs)
    router(context(node, [*ins, ids, wts], pdl=pdl))()
    ref_ids, ref_w = ref_op("router", ins, attrs, [torch.int32, torch.float32])
    a, b = ref_ids.long().sort(1), ids.long().sort(1)
    where = f"router rows={rows} experts={experts} top_k={top_k} {score} bias={bias}"
    assert torch.equal(a.values, b.values), f"{where}: ids differ\n{a.values}\n{b.values}"
    err = float((ref_w.gather(1, a.indices) - wts.gather(1, b.indices)).abs().max())
    assert err < 1e-5, f"{where}: weights differ by {err:.3e}"
    return err


# ----------------------------------------------------------------------------- interpreter


def interpreter_experts() -> None:
    """Routed experts on small shapes in the interpreter."""
    cases = [  # rows, experts, local, offset, k, W, I, act, x dtype, tactic
        (3, 8, 8, 0, 2, 32, 48, SITU, torch.float32, None),
        (5, 16, 8, 4, 4, 40, 24, SILU, torch.bfloat16, None),       # ids of other ranks
        (1, 6, 6, 0, 3, 64, 32, SITU, torch.bfloat16, None),
        (20, 12, 12, 0, 3, 32, 32, SITU, torch.float32,              # 2 row chunks
         {"block_m": 16, "block_k": 16, "block_n_gate_up": 16, "block_n_down": 16}),
        (6, 32, 4, 28, 2, 48, 40, SILU, torch.float32, {"block_k": 32}),  # many rows elsewhere
        (4, 8, 8, 0, 2, 32, 48, SITU, torch.float32, {"block_k": 16, "pre": 2}),  # pre-wait
        (2, 8, 8, 0, 2, 32, 24, SILU, torch.float32, {"block_k": 16, "pre": 3}),  # 2 > K tiles
        (5, 16, 8, 4, 4, 40, 24, SILU, torch.bfloat16, {"combine": 1}),  # down combines
        (20, 12, 12, 0, 3, 32, 32, SITU, torch.float32,              # 2 row chunks, combined
         {"block_m": 16, "block_k": 16, "block_n_down": 16, "combine": 1}),
        # the one-row GEMV form: 3 chunks of 512 (ragged) over W and I, other ranks' ids,
        # the down launch's expert and first chunk before its wait
        (1, 6, 6, 0, 3, 1100, 600, SITU, torch.bfloat16, {"gemv": 16}),
        (1, 16, 8, 4, 4, 1030, 520, SILU, torch.float32, {"gemv": 16, "pre": 1}),
        (1, 32, 4, 28, 2, 48, 40, SILU, torch.float32, {"gemv": 32, "gemv_warps": 4}),
        (1, 8, 8, 0, 2, 600, 72, SITU, torch.float32, {"gemv": 8}),  # 8 rows a program
        # the GEMV form at a few rows (an expert slot a program column), other ranks' ids
        (3, 8, 8, 0, 2, 32, 48, SITU, torch.float32, {"gemv": 16}),
        (2, 16, 8, 4, 4, 1030, 520, SILU, torch.bfloat16, {"gemv": 16, "pre": 1}),
        (4, 6, 6, 0, 3, 600, 72, SITU, torch.float32, {"gemv": 8}),
        (5, 8, 8, 0, 2, 32, 48, SITU, torch.float32, {"gemv": 16}),  # 5 rows: MMA tiles
    ]
    for seed, (rows, e, local, off, k, w, i, act, dt, tactic) in enumerate(cases):
        err = check_routed_experts(rows, e, local, off, k, w, i, act, dt, "cpu", tactic=tactic,
                                   seed=seed)
        print(f"routed_experts rows={rows} E={e} local={local}+{off} k={k} {w}x{i} "
              f"{act['activation']} {dt}: {err:.2e}")
    for seed, (rows, e, local, off, k, tactic) in enumerate([
            (3, 8, 8, 0, 2, {"block_k": 16}), (5, 16, 8, 4, 4, {"block_k": 16}),
            (20, 12, 12, 0, 3, {"block_m": 16, "block_k": 16, "block_n_down": 16}),
            (1, 12, 12, 0, 3, {"gemv": 16})]):
        check_combine_forms(rows, e, local, off, k, 40, 24, "cpu", tactic=tactic, seed=seed)
        print(f"combine forms rows={rows} E={e} local={local}+{off} k={k}: equal")
    gen = torch.Generator().manual_seed(11)
    gate_up, down = expert_weights(12, 40, 24, gen, "cpu")
    for rows, pre, gemv in ((1, 0, 0), (5, 0, 0), (3, 1, 0), (1, 1, 16), (3, 1, 16)):
        check_moe_chain(rows, "cpu", gate_up, down, top_k=4, replays=2,
                        tactic={"pre": pre, "block_k": 16, "gemv": gemv})
        print(f"router -> experts chain rows={rows} pre={pre} gemv={gemv}: ok")


def check_router_ties(device: str, pdl: bool = False) -> None:
    """The router's pick on tied logits: a tie inside the top-k takes every tied expert once
    (each with its own score), a tie across the k-th place takes the lowest ids (the rule
    the kernel documents; the reference's torch.topk leaves that order free)."""
    from stepgraph.runtime.providers.triton_dense import router

    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.5, -2.0],
                           [-1.0, 2.0, -1.0, 2.0, 2.0, -3.0, 2.0, -1.0]]).to(device)
    attrs = {"experts": 8, "top_k": 3, "score": "sigmoid", "correction_bias": False,
             "renormalize": False, "scaling_factor": 1.0}
    ids = torch.full((2, 3), -1, dtype=torch.int32, device=device)
    wts = torch.full((2, 3), float("nan"), device=device)
    router(context(node_of("router", 1, 2, **attrs), [logits, ids, wts], pdl=pdl))()
    assert sorted(ids[0].tolist()) == [1, 2, 4], f"a tie inside the top-3: {ids[0].tolist()}"
    assert sorted(ids[1].tolist()) == [1, 3, 4], f"a tie across the 3rd place: {ids[1].tolist()}"
    want = torch.sigmoid(logits.gather(1, ids.long()))
    assert torch.allclose(wts, want), f"tied picks' weights {wts.tolist()} != {want.tolist()}"


def interpreter_router() -> None:
    """The router in the interpreter."""
    for seed, (rows, e, k, score, bias, renorm) in enumerate([
            (3, 8, 2, "sigmoid", True, True), (4, 37, 5, "softmax", False, False),
            (2, 64, 16, "sigmoid", False, True), (2, 896, 16, "sigmoid", True, True)]):
        err = check_router(rows, e, k, score, bias, renorm, "cpu", seed=seed)
        print(f"router rows={rows} E={e} k={k} {score} bias={bias}: {err:.1e}")
    check_router_ties("cpu")
    print("router ties: ok")


# ----------------------------------------------------------------------------- sm_90 compiles


def _meta(*shape: int, dtype: Any = torch.bfloat16) -> Any:
    return torch.empty(*shape, dtype=dtype, device="meta")


def sm90_moe() -> None:
    """K3 per-rank expert and router launches compile well for sm_90."""
    from stepgraph.runtime.kernels.moe import MoeTactic, RoutedExperts
    from stepgraph.runtime.kernels.routing import Router
    from stepgraph.runtime.kernels.splitk_gemm import SMEM_LIMIT

    width, inter, k = 3584, 3072, 16
    for experts, rows, combine in ((64, 1, 1), (64, 16, 1), (64, 32, 1), (64, 64, 1),
                                   (112, 1, 1), (112, 64, 1), (112, 1, 0), (112, 64, 0)):
        launch = RoutedExperts(
            _meta(rows, width, dtype=torch.float32), _meta(rows, k, dtype=torch.int32),
            _meta(rows, k, dtype=torch.float32), _meta(experts, 2 * inter, width),
            _meta(experts, width, inter), _meta(rows, width), **SITU,
            tactic=MoeTactic(combine=combine))
        launch.pdl = True  # meta tensors: compile the PDL form
        for c in sm90_compiles(launch):
            where = f"{c.name} experts={experts} rows={rows} combine={combine}"
            print(f"{where}: {c.regs} regs, {c.spills} B spilled, {c.shared} B shared")
            assert c.spills == 0 and c.shared <= SMEM_LIMIT, where
            assert "griddepcontrol.wait" in c.ptx, f"{where}: no PDL wait"
            if c.name != "_moe_combine_kernel":
                assert "async_copy" in c.ttgir or "async_tma" in c.ttgir, \
                    f"{where}: the expert loop is not pipelined"
    for experts, gemv, warps, rows in ((112, 16, 8, 1), (112, 32, 8, 1), (64, 8, 8, 1),
                                       (112, 16, 4, 1), (112, 16, 8, 2)):
        launch = RoutedExperts(
            _meta(rows, width, dtype=torch.bfloat16), _meta(rows, 2, dtype=torch.int32),
            _meta(rows, 2, dtype=torch.float32), _meta(experts, 2 * inter, width),
            _meta(experts, width, inter), _meta(rows, 2, width, dtype=torch.float32), **SITU,
            tactic=MoeTactic(gemv=gemv, gemv_warps=warps, pre=1), slots=True)
        launch.pdl = True
        compiled = sm90_compiles(launch)
        assert sorted(c.name for c in compiled) == ["moe_gemv_down_kernel",
                                                     "moe_gemv_gate_up_kernel"], compiled
        for c in compiled:
            where = f"{c.name} experts={experts} gemv={gemv} warps={warps} rows={rows}"
            print(f"{where}: {c.regs} regs, {c.spills} B spilled, {c.shared} B shared")
            assert c.spills == 0 and "griddepcontrol.wait" in c.ptx, where
            # the tactic's rows a program reach the kernel's weight tiles
            assert f"tensor<{gemv}x" in c.ttgir, f"{where}: no [{gemv}, K] weight tile"
    for experts in (64, 112, 896):
        launch = Router(_meta(64, experts, dtype=torch.float32),
                        _meta(experts, dtype=torch.float32), _meta(64, k, dtype=torch.int32),
                        _meta(64, k, dtype=torch.float32), top_k=k, score="sigmoid",
                        renormalize=True, scaling=2.5)
        launch.pdl = True
        for c in sm90_compiles(launch):
            print(f"router experts={experts}: {c.regs} regs, {c.spills} B spilled")
            assert c.spills == 0 and "griddepcontrol.wait" in c.ptx, f"router {experts}"


CHECKS = {"interp-experts": interpreter_experts, "interp-router": interpreter_router,
          "sm90-moe": sm90_moe}


@needs_triton
@pytest.mark.parametrize("check", ["interp-experts", "interp-router"])
def test_interpreter(check: str) -> None:
    """The kernels in Triton's CPU interpreter against the reference ops."""
    result = run_script(HERE, check, interpret=True)
    assert result.returncode == 0, explain(result)


@needs_triton
@pytest.mark.slow
def test_sm90_compile() -> None:
    """The MoE launches at K3 shapes compile for sm_90 (no GPU needed)."""
    result = run_script(HERE, "sm90-moe", interpret=False)
    assert result.returncode == 0, explain(result)


def test_provider_is_registered() -> None:
    """routed_experts/triton_fused_moe resolves to this factory on CUDA only."""
    pytest.importorskip("triton")
    from stepgraph.runtime.providers import REGISTRY
    from stepgraph.runtime.providers.triton_moe import routed_experts

    entry = REGISTRY.get("routed_experts", "triton_fused_moe")
    assert entry is not None and entry.factory is routed_experts and entry.devices == ("cuda",)


def test_wrong_expert_count_is_refused() -> None:
    """gate_up holding another number of experts than local_experts is a UserError."""
    pytest.importorskip("triton")
    from stepgraph.errors import UserError
    from stepgraph.runtime.providers.triton_moe import routed_experts

    node = node_of("routed_experts", 5, 1, experts=8, expert_offset=0, local_experts=4,
                   top_k=2, width=8, **SILU)
    tensors = [torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2),
               torch.zeros(8, 16, 16), torch.zeros(8, 16, 8), torch.zeros(2, 16)]
    with pytest.raises(UserError, match=r"test\.routed_experts.*4 experts"):
        routed_experts(context(node, tensors))


# ----------------------------------------------------------------------------- GPU tests

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def k3_experts() -> dict[int, tuple[Any, Any]]:
    """K3 expert weights on the GPU: 64 and 112 local experts, W 3584, I 3072."""
    gen = torch.Generator().manual_seed(7)
    return {e: expert_weights(e, 3584, 3072, gen, "cuda") for e in (64, 112)}


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("experts", (64, 112))
def test_routed_experts_gpu(experts: int, k3_experts: dict[int, tuple[Any, Any]]) -> None:
    """K3 routed experts (SiTU, float32 latent rows through a column view), rows 1..64."""
    for rows in ROWS:
        err = check_routed_experts(rows, experts, experts, 0, 16, 3584, 3072, SITU,
                                   torch.float32, "cuda", weights=k3_experts[experts],
                                   pdl=True, seed=rows)
        print(f"experts={experts} rows={rows}: {err:.2e}")


@pytest.mark.gpu
@CUDA
def test_routed_experts_other_ranks_gpu(k3_experts: dict[int, tuple[Any, Any]]) -> None:
    """64 local experts of 128 at offset 64 (half the ids are another rank's), SiLU, BF16
    rows; and one explicit tactic."""
    for rows in (1, 8, 64):
        check_routed_experts(rows, 128, 64, 64, 16, 3584, 3072, SILU, torch.bfloat16, "cuda",
                             weights=k3_experts[64], pdl=True, seed=rows)
    check_routed_experts(64, 64, 64, 0, 16, 3584, 3072, SITU, torch.float32, "cuda",
                         weights=k3_experts[64], pdl=True, seed=5,
                         tactic={"block_m": 16, "block_n_gate_up": 128, "block_k": 64})


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("experts", (64, 112))
def test_combine_forms_gpu(experts: int, k3_experts: dict[int, tuple[Any, Any]]) -> None:
    """At K3 shapes the down launch's own combine writes the bits of the combine launch
    (top-16 and, as a k3-rank-tp8 rank routes, top-2), rows 1..64."""
    for rows in ROWS:
        for top_k in (2, 16):
            check_combine_forms(rows, experts, experts, 0, top_k, 3584, 3072, "cuda",
                                weights=k3_experts[experts], seed=rows)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("experts", (64, 112, 896))
def test_router_gpu(experts: int) -> None:
    """The router at K3 expert counts, rows 1..64, sigmoid + bias and softmax; tied
    logits."""
    for rows in ROWS:
        check_router(rows, experts, 16, "sigmoid", True, True, "cuda", pdl=True, seed=rows)
        check_router(rows, experts, 16, "softmax", False, False, "cuda", pdl=True, seed=rows)
    check_router_ties("cuda", pdl=True)


def check_moe_chain(rows: int, device: str, gate_up: Any, down: Any, top_k: int = 16,
                    replays: int = 4, tactic: dict[str, int] | None = None) -> None:
    """router -> routed experts with PDL, captured in one CUDA graph (eager off CUDA) and
    replayed on fresh logits and rows (every launch must wait for the routing it reads; the
    routing is poisoned before each replay, so a down launch reading it too early with
    ``pre`` shows); logits and rows are column views of one float32 MoE-front buffer."""
    from stepgraph.runtime.providers.triton_dense import router
    from stepgraph.runtime.providers.triton_moe import routed_experts

    experts, two_i, width = gate_up.shape
    inter = two_i // 2
    dev = device
    gen = torch.Generator().manual_seed(rows)
    front = torch.empty(rows, experts + width, device=dev)  # the packed MoE front (float32)
    logits, x = front[:, :experts], front[:, experts:]
    bias = (torch.randn(experts, generator=gen) * 0.1).to(dev)
    ids = torch.empty(rows, top_k, dtype=torch.int32, device=dev)
    wts = torch.empty(rows, top_k, device=dev)
    out = torch.empty(rows, width, dtype=torch.bfloat16, device=dev)
    r_attrs = {"experts": experts, "top_k": top_k, "score": "sigmoid",
               "correction_bias": True, "renormalize": True, "scaling_factor": 2.5}
    e_attrs = {"experts": experts, "expert_offset": 0, "local_experts": experts,
               "top_k": top_k, "width": inter, **SITU}
    front.copy_(torch.randn(rows, experts + width, generator=gen))
    launches = [
        router(context(node_of("router", 2, 2, **r_attrs), [logits, bias, ids, wts],
                       pdl=True)),
        routed_experts(context(node_of("routed_experts", 5, 1, **e_attrs),
                               [x, ids, wts, gate_up, down, out], pdl=True, tactic=tactic)),
    ]
    runner = Replayer(launches, dev)
    for replay in range(replays):
        front.copy_(torch.randn(rows, experts + width, generator=gen) * (1 + replay))
        ids.fill_(-1)
        wts.fill_(float("nan"))
        out.fill_(float("nan"))
        runner.replay()
        ref_ids, ref_w = ref_op("router", [logits, bias], r_attrs, [torch.int32, torch.float32])
        ref = ref_op("routed_experts", [x.float(), ref_ids, ref_w, gate_up.float(),
                                        down.float()], e_attrs, [torch.float32])[0]
        assert torch.equal(ref_ids.long().sort(1).values, ids.long().sort(1).values), \
            f"replay {replay} rows={rows} on {device}: router ids differ from the reference"
        err = rel_err(out, ref)
        assert err < TOL_BF16, (f"replay {replay} rows={rows} on {device}: routed experts "
                                f"relative error {err:.3e} (NaN: unwritten; large: stale "
                                f"routing)")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("experts", (64, 112))
@pytest.mark.parametrize(("gemv", "warps", "pre"), ((16, 8, 1), (32, 8, 0), (8, 4, 1)))
@pytest.mark.parametrize("rows", (1, 2, 4))
def test_routed_experts_gemv_gpu(experts: int, gemv: int, warps: int, pre: int, rows: int,
                                 k3_experts: dict[int, tuple[Any, Any]]) -> None:
    """The GEMV form at K3 shapes (top-16 of 64, top-2 of 112) and one to four rows against
    the float32 reference, alone and as the router's dependent in a replayed CUDA graph (the
    routing poisoned before each replay: a down launch reading it before its wait too early
    shows)."""
    tactic = {"gemv": gemv, "gemv_warps": warps, "pre": pre}
    top_k = 16 if experts == 64 else 2
    check_routed_experts(rows, experts, experts, 0, top_k, 3584, 3072, SITU, torch.bfloat16,
                         "cuda", weights=k3_experts[experts], tactic=tactic, pdl=True)
    check_moe_chain(rows, "cuda", *k3_experts[experts], top_k=top_k, tactic=tactic)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("pre", "combine"), ((0, 1), (1, 1), (1, 0)))
def test_moe_graph_with_pdl_gpu(rows: int, pre: int, combine: int,
                                k3_experts: dict[int, tuple[Any, Any]]) -> None:
    """The chain of :func:`check_moe_chain` at K3 shapes (64 experts) in a CUDA graph, the
    down launch loading ``pre`` weight tiles (and so the routing) before its wait, and
    combining itself (``combine`` 1) or leaving it to a third launch."""
    check_moe_chain(rows, "cuda", *k3_experts[64], tactic={"pre": pre, "combine": combine})


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(CHECKS)}}}")
    if sys.argv[1].startswith("interp"):
        patch_interpreter()
    torch.manual_seed(0)
    CHECKS[sys.argv[1]]()
    print("ok")
