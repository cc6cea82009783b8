"""The KDA core providers (``triton``, ``fla_fused_recurrent``) against the reference op
:func:`stepgraph.lower.ref_kda.kda_core` on fresh random inputs.

CPU: the Triton kernels run in Triton's interpreter, in a subprocess started with
``TRITON_INTERPRET=1`` (this file run as a script), on small shapes: both gate forms, both
output gates, decode (q = 1) and verify (q = 2, 3) steps, padded requests (slot -1),
activations read through column views of a packed projection output.
GPU (``-m gpu``): K3 per-rank shapes (96 and 12 heads x 128) in BF16, rows 1..64, captured in
a CUDA graph with PDL and replayed several times, against the float32 reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_check import ROOT, FakeContext  # noqa: E402
from triton_check import has_triton as _has_triton  # noqa: E402

TOL_BF16 = 1e-2  # ||out - ref|| / ||ref||, BF16 against the float32 reference
TOL_F32 = 1e-4






def make_case(heads: int, dim: int, rows: int, q_len: int = 1, kernel: int = 4,
              rank: int = 16, form: str = "lower_bound", low_rank: bool = False,
              grank: int = 16, padded: int = 0, dtype: Any = None, device: str = "cpu",
              seed: int = 0, scratch_slot: bool = False) -> dict[str, Any]:
    """Random inputs of one kda_core node: the node, its bound tensors (activations as column
    views of one packed [rows, ...] tensor), ``padded`` trailing requests with slot -1 (or the
    scratch slot, the pool's last, when ``scratch_slot``)."""
    from stepgraph.ir.nodes import Node

    dtype = dtype or torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    width = heads * dim
    requests = rows // q_len
    gate_width = grank if low_rank else width
    widths = [width, width, width, gate_width, rank, heads]
    packed = rnd(rows, sum(widths) + 3).to(dtype)
    acts, start = [], 0
    for w in widths:
        acts.append(packed[:, start:start + w])
        start += w
    slots_total = requests * q_len + 2  # + a free slot + the scratch slot (the last)
    names = ["q", "k", "v", "g", "f_a", "b", "q_conv", "k_conv", "v_conv", "f_b", "dt_bias",
             "A_log", "o_norm"] + (["g_b"] if low_rank else []) + [
        "state", "q_state", "k_state", "v_state", "slots"] + (["accepted"] if q_len > 1 else [])
    weights = [rnd(width, kernel, scale=0.5).to(dtype) for _ in range(3)]
    weights += [rnd(width, rank, scale=rank**-0.5).to(dtype), rnd(width),
                rnd(heads, scale=0.5), (1.0 + 0.1 * rnd(dim)).to(dtype)]
    if low_rank:
        weights.append(rnd(width, grank, scale=grank**-0.5).to(dtype))
    states = [rnd(slots_total, heads, dim, dim, scale=0.05)]
    states += [rnd(slots_total, width, kernel - 1).to(dtype) for _ in range(3)]
    perm = torch.randperm(slots_total - 1, generator=gen)[:requests * q_len]
    slots = perm.to(torch.int32)
    if padded:
        slots[(requests - padded) * q_len:] = slots_total - 1 if scratch_slot else -1
    accepted = torch.ones(rows, dtype=torch.int32)
    for n in range(requests):
        accepted[n * q_len:(n + 1) * q_len] = int(torch.randint(1, q_len + 1, (1,),
                                                                generator=gen))
    meta = [slots.to(device)] + ([accepted.to(device)] if q_len > 1 else [])
    tensors = acts + weights + states + meta
    attrs = dict(heads=heads, head_dim=dim, conv_kernel=kernel, gate_form=form,
                 gate_lower_bound=-5.0 if form == "lower_bound" else None,
                 output_gate="low_rank" if low_rank else "full", eps=1e-5, q=q_len)
    node = Node("l0.kda_core", "kda_core", tuple(names), ("out",), attrs)
    bound = dict(zip(names, tensors, strict=True))
    bound["out"] = torch.full((rows, width), float("nan"), dtype=dtype, device=device)
    return {"node": node, "bound": bound, "rows": rows, "requests": requests,
            "real_rows": (requests - padded) * q_len, "state_names": names[-(4 + len(meta)):
                                                                           -len(meta)]}


def reference(case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The float32 reference output and states of a case (on copies of its tensors)."""
    from stepgraph.lower.ref_common import OpCall
    from stepgraph.lower.ref_kda import kda_core

    bound = case["bound"]
    ins = []
    for name in case["node"].inputs:
        tensor = bound[name].clone()
        ins.append(tensor.float() if tensor.is_floating_point() else tensor)
    call = OpCall(case["node"], ins, [None], [torch.float32], torch.float32, case["rows"])
    (out,) = kda_core(call)
    states = {n: ins[case["node"].inputs.index(n)] for n in case["state_names"]}
    return out, states


def rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 (inf when a has NaN)."""
    a, b = a.double(), b.double()
    if bool(torch.isnan(a).any()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_case(provider: str, pdl: bool = False, capture: bool = False, replays: int = 1,
               tactic: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """Run one case through ``provider`` and the reference; the relative errors of the real
    rows' output and of the states of the real slots, after each replay."""
    from stepgraph.runtime.providers import load_providers
    from stepgraph.runtime.providers.registry import REGISTRY

    load_providers()
    case = make_case(**spec)
    device = torch.device(spec.get("device", "cpu"))
    entry = REGISTRY.get("kda_core", provider)
    if entry is None:
        return {"error": f"provider {provider} is not registered"}
    ctx = FakeContext(case["node"], case["rows"], case["bound"], device, pdl, dict(tactic or {}))
    launch = entry.factory(ctx)
    bound = case["bound"]
    initial = {n: bound[n].clone() for n in case["state_names"]}
    if capture:
        launch()  # compile outside the capture
        torch.cuda.synchronize()
        for n in case["state_names"]:
            bound[n].copy_(initial[n])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for n in case["state_names"]:
            bound[n].copy_(initial[n])
        run = graph.replay
    else:
        run = launch
    real = case["real_rows"]
    slots = bound["slots"][:real].long()
    slots = slots[slots >= 0]
    result: dict[str, Any] = {"out": [], "state": [], "nan": False}
    for _ in range(replays):
        ref_out, ref_states = reference(case)
        bound["out"].fill_(float("nan"))
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out = bound["out"]
        result["nan"] = result["nan"] or bool(torch.isnan(out).any())  # padded rows too
        result["out"].append(rel(out[:real], ref_out[:real]))
        errs = [rel(bound[n][slots].float(), ref_states[n][slots].float())
                for n in case["state_names"]]
        result["state"].append(max(errs))  # the next replay starts from these states
    result["shape"] = {k: spec.get(k) for k in ("heads", "dim", "rows", "q_len", "form",
                                                 "low_rank", "padded")}
    result["tactic"] = tactic
    return result


# ---------------------------------------------------------------------------- CPU cases

INTERP_CASES = [
    dict(heads=2, dim=16, rows=4, padded=1),
    dict(heads=2, dim=16, rows=3, form="softplus", low_rank=True, grank=8),
    dict(heads=3, dim=12, rows=4, rank=5, kernel=2, padded=2),
    dict(heads=2, dim=16, rows=6, q_len=2, padded=1),
    dict(heads=2, dim=16, rows=6, q_len=3, kernel=3, form="softplus", low_rank=True),
    dict(heads=2, dim=16, rows=4, q_len=2, kernel=4),
    dict(heads=2, dim=16, rows=5, padded=1, tactic={"gate_rows": 1}),  # the gate kernel
    dict(heads=3, dim=12, rows=6, q_len=2, rank=20, form="softplus", tactic={"gate_rows": 1}),
    # the output norm inside the recurrence (its last V block of each head)
    dict(heads=2, dim=16, rows=4, padded=1, tactic={"out_norm": 1}),
    dict(heads=2, dim=16, rows=6, q_len=3, kernel=3, low_rank=True, tactic={"out_norm": 1}),
    dict(heads=3, dim=12, rows=6, q_len=2, padded=2, tactic={"out_norm": 1, "block_v": 4}),
    # the prep inside the recurrence (one launch: each V block recomputes its head's prep)
    # (decode steps; out_norm 1 gives way: the norm launch writes the conv states)
    dict(heads=2, dim=16, rows=4, padded=1, tactic={"prep_inside": 1, "block_v": 8}),
    dict(heads=3, dim=12, rows=4, rank=20, kernel=2, form="softplus",
         tactic={"prep_inside": 1, "block_v": 4}),
    dict(heads=2, dim=16, rows=3, kernel=3, low_rank=True, padded=1,
         tactic={"prep_inside": 1, "out_norm": 1, "block_v": 8}),
]


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalar kernel arguments as 1-element arrays, which
    NumPy 2 refuses to turn into an int when a kernel loops ``range(0, T)`` over one
    (fla-core's recurrence does): let ``__index__`` take the element."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _interpreter_main(provider: str) -> None:
    if provider == "fla_fused_recurrent":
        _patch_interpreter_index()
    results = []
    for spec in INTERP_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            scratch = provider != "triton"  # fla cannot skip a slot: padded rows -> scratch
            out = check_case(provider, dtype=dtype, scratch_slot=scratch, **spec)
            out["dtype"] = str(dtype)
            results.append(out)
    print("RESULTS " + json.dumps(results))


def _run_interpreter(provider: str) -> list[dict[str, Any]]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, provider], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"interpreter run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def _assert_results(results: list[dict[str, Any]]) -> None:
    assert results
    for res in results:
        assert "error" not in res, res
        tol = TOL_F32 if res["dtype"] == "torch.float32" else TOL_BF16
        assert not res["nan"], f"NaN in the output: {res}"
        assert max(res["out"]) < tol, f"output error {res['out']} >= {tol}: {res}"
        assert max(res["state"]) < tol, f"state error {res['state']} >= {tol}: {res}"


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_kda_interpreter() -> None:
    """Our three KDA kernels match the reference on small shapes (interpreter)."""
    _assert_results(_run_interpreter("triton"))


def _has_fla() -> bool:
    try:
        import fla.ops.kda.fused_recurrent  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not (_has_triton() and _has_fla()), reason="triton or fla-core missing")
def test_fla_kda_interpreter() -> None:
    """Our prep/norm kernels around fla-core's recurrence match the reference (interpreter)."""
    _assert_results(_run_interpreter("fla_fused_recurrent"))


def compile_for_h200(fn: Any, types: dict[str, str], constexprs: dict[str, Any],
                     **options: Any) -> dict[str, Any]:
    """Compile a Triton kernel for sm_90a without a GPU (Triton's bundled ptxas): its
    metadata and PTX. ``types`` gives the type of every non-constexpr parameter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types[name]
                 for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return {"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"]}


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_kda_kernels_compile_for_h200() -> None:
    """Every KDA kernel compiles to sm_90a cubin at K3 shapes (what the interpreter does not
    check: types, layouts, register allocation), with the PDL instructions when asked."""
    from stepgraph.runtime.kernels import kda

    f32, bf16, i32 = "*fp32", "*bf16", "*i32"
    prep = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, fa_ptr=bf16, b_ptr=bf16, q_stride="i32",
                k_stride="i32", v_stride="i32", fa_stride="i32", b_stride="i32",
                qw_ptr=bf16, kw_ptr=bf16, vw_ptr=bf16, qs_ptr=bf16, ks_ptr=bf16, vs_ptr=bf16,
                conv_slot_stride="i32", fb_ptr=bf16, dt_ptr=f32, alog_ptr=f32, slots_ptr=i32,
                accepted_ptr=i32, qn_ptr=f32, kn_ptr=f32, vo_ptr=f32, g_ptr=f32, beta_ptr=f32,
                fla_slots_ptr=i32, fla_accepted_ptr=i32, scratch_slot="i32",
                lower_bound="fp32")
    for q_len, lower, fla, fb_pre in ((1, True, False, True), (1, True, False, False),
                                      (2, False, True, False)):
        out = compile_for_h200(kda._kda_prep_kernel, prep, dict(
            H=96, D=128, BD=128, KS=4, KW=4, KSP=4, RANK=128, BR=128 if fb_pre else 32,
            Q=q_len, LOWER_BOUND=lower, GATE=not fla, FB_PRE=fb_pre, FLA=fla, USE_PDL=True),
            num_warps=8 if fb_pre else 4)
        assert "griddepcontrol.wait" in out["ptx"]
    gate = dict(fa_ptr=bf16, fa_stride="i32", fb_ptr=bf16, dt_ptr=f32, alog_ptr=f32,
                g_ptr=f32, rows="i32", lower_bound="fp32")
    for lower in (False, True):
        compile_for_h200(kda._kda_gate_kernel, gate, dict(
            H=12, D=128, BD=128, RANK=128, BR=32, BM=64, LOWER_BOUND=lower, DOT_F32=False,
            USE_PDL=True), num_warps=4)
    rec = dict(qn_ptr=f32, kn_ptr=f32, vo_ptr=f32, g_ptr=f32, beta_ptr=f32, state_ptr=f32,
               state_slot_stride="i64", slots_ptr=i32, accepted_ptr=i32, o_ptr=f32,
               scale="fp32", gate_ptr=bf16, gate_stride="i32", gb_ptr=bf16, onorm_ptr=bf16,
               out_ptr=bf16, out_stride="i32", eps="fp32", sem_ptr=i32)
    for q_len, out_norm, low in ((1, True, False), (4, True, True), (1, False, False)):
        out = compile_for_h200(kda._kda_recurrent_kernel, rec, dict(
            H=12, D=128, BD=128, BV=32, Q=q_len, USE_PDL=q_len == 1, OUT_NORM=out_norm,
            GRANK=128 if low else 1, BR=32 if low else 1, LOW_RANK=low, FENCE=True),
            num_warps=4)
        assert ("griddepcontrol.wait" in out["ptx"]) == (q_len == 1)
        assert ("atom" in out["ptx"]) == out_norm, "the output norm's counter"
    norm = dict(o_ptr=f32, gate_ptr=bf16, gate_stride="i32", gb_ptr=bf16, onorm_ptr=bf16,
                out_ptr=bf16, out_stride="i32", eps="fp32", q_ptr=bf16, k_ptr=bf16,
                v_ptr=bf16, q_stride="i32", k_stride="i32", v_stride="i32", qs_ptr=bf16,
                ks_ptr=bf16, vs_ptr=bf16, conv_slot_stride="i32", slots_ptr=i32)
    for low, conv in ((False, False), (True, False), (False, True)):
        compile_for_h200(kda._kda_out_norm_kernel, norm, dict(
            H=96, D=128, BD=128, GRANK=128 if low else 1, BR=32 if low else 1, LOW_RANK=low,
            CONV=conv, KS=4, KW=4, USE_PDL=True), num_warps=4)


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_prep_inside_recurrence_compiles_for_h200() -> None:
    """The one-launch prep + recurrence at k3-rank-tp8's shapes (12 heads x 128, f_b rank
    128, one row) compiles for sm_90a without spills, at the tactics' 4 and 8 warps, and
    issues its loads (state, conv states, f_b slab) before the PDL wait."""
    from triton_check import sm90_compiles

    from stepgraph.runtime.kernels import kda

    heads, dim, rank, width = 12, 128, 128, 12 * 128
    bf16, f32 = torch.bfloat16, torch.float32
    packed = torch.zeros(1, 3 * width + rank + heads, dtype=bf16)
    q, k, v = (packed[:, i * width:(i + 1) * width] for i in range(3))
    f_a = packed[:, 3 * width:3 * width + rank]
    b = packed[:, 3 * width + rank:]
    conv_w = tuple(torch.zeros(width, 4, dtype=bf16) for _ in range(3))
    conv_s = tuple(torch.zeros(3, width, 3, dtype=bf16) for _ in range(3))
    state = torch.zeros(3, heads, dim, dim, dtype=f32)
    slots = torch.zeros(1, dtype=torch.int32)
    o = torch.zeros(1, heads, dim, dtype=f32)
    for warps in (4, 8):
        (c,) = sm90_compiles(lambda w=warps: kda.launch_prep_recurrent(
            q, k, v, f_a, b, conv_w, conv_s, torch.zeros(width, rank, dtype=bf16),
            torch.zeros(width, dtype=f32), torch.zeros(heads, dtype=f32), state, slots, o,
            heads=heads, head_dim=dim, gate_form="lower_bound", lower_bound=-5.0,
            block_v=32, num_warps=w, pdl=True))
        print(c.name, warps, "warps:", c.regs, "registers,", c.spills, "spill bytes")
        assert c.name == "_kda_prep_recurrent_kernel"
        assert c.spills == 0, f"{c.spills} bytes of spills at {warps} warps"
        assert "griddepcontrol.wait" in c.ptx
        assert c.loads_before_wait(), "the state / conv / f_b loads belong before the wait"
        # the f_b slab in 32-wide chunks keeps the state's V block unreplicated (one
        # [128, 128] slab tile put it in a layout four times its width: 255 registers)
        assert c.regs <= (168 if warps == 4 else 128), c.regs
    out = torch.zeros(1, width, dtype=bf16)
    (c,) = sm90_compiles(lambda: kda.launch_out_norm(
        o, packed[:, :width], None, torch.zeros(dim, dtype=bf16), out, heads=heads,
        head_dim=dim, eps=1e-5, conv=kda.ConvUpdate((q, k, v), conv_s, slots), pdl=True))
    assert c.spills == 0 and "griddepcontrol.wait" in c.ptx
    head, tail = c.ptx.split("griddepcontrol.wait", 1)
    assert "st.global" not in head, "the conv states are written only after the wait"
    assert tail.count("st.global") >= 4, "the output and the three conv states"


def test_fake_values_differ() -> None:
    """The check can fail: a wrong output (the reference's own inputs) is far from it."""
    case = make_case(heads=2, dim=16, rows=4)
    ref_out, _ = reference(case)
    assert rel(case["bound"]["q"].float(), ref_out) > 0.1


# ---------------------------------------------------------------------------- GPU cases

GPU_CASES = [
    dict(heads=96, dim=128, rows=1, rank=128),
    dict(heads=96, dim=128, rows=64, rank=128, padded=3),
    dict(heads=12, dim=128, rows=8, rank=128, form="softplus", low_rank=True, grank=128),
    dict(heads=12, dim=128, rows=64, rank=128, padded=5),
    dict(heads=12, dim=128, rows=16, rank=128, q_len=2, padded=1),
    dict(heads=96, dim=128, rows=8, rank=128, q_len=4),
    dict(heads=12, dim=128, rows=4, rank=128, form="softplus", tactic={"gate_rows": 1}),
    dict(heads=12, dim=128, rows=1, rank=128, tactic={"out_norm": 1}),
    dict(heads=12, dim=128, rows=8, rank=128, tactic={"out_norm": 1, "block_v": 16}),
    dict(heads=96, dim=128, rows=64, rank=128, q_len=2, low_rank=True, grank=128,
         tactic={"out_norm": 1}),
    dict(heads=12, dim=128, rows=1, rank=128, tactic={"prep_inside": 1}),
    dict(heads=12, dim=128, rows=8, rank=128, padded=2, tactic={"prep_inside": 1,
                                                                "num_warps": 8}),
    dict(heads=96, dim=128, rows=4, rank=128, q_len=2, form="softplus",
         tactic={"prep_inside": 1, "out_norm": 1}),
]


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
@pytest.mark.parametrize("provider", ["triton", "fla_fused_recurrent"])
@pytest.mark.parametrize("spec", GPU_CASES, ids=lambda s: "-".join(f"{k}{v}" for k, v in
                                                                    s.items()))
def test_kda_gpu(provider: str, spec: dict[str, Any]) -> None:
    """K3 per-rank shapes in BF16, captured in a CUDA graph with PDL, replayed 3 times."""
    from stepgraph.runtime.providers import REGISTRY, load_providers
    from stepgraph.runtime.providers.triton_kda import fla_forward

    load_providers()
    if provider == "fla_fused_recurrent" and (REGISTRY.get("kda_core", provider) is None
                                              or fla_forward() is None):
        pytest.skip("fla-core is not importable here")
    res = check_case(provider, pdl=True, capture=True, replays=3, dtype=torch.bfloat16,
                     device="cuda", scratch_slot=provider != "triton", **spec)
    print(provider, res)
    assert "error" not in res, res
    assert not res["nan"], f"NaN in the output: {res}"
    assert max(res["out"]) < TOL_BF16, f"output error too large: {res}"
    assert max(res["state"]) < TOL_BF16, f"state error too large: {res}"


if __name__ == "__main__":
    _interpreter_main(sys.argv[1])
