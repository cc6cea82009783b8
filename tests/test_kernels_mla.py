"""The MLA providers (``triton_splitkv`` of mla_core, ``triton_sparse`` of dsa_core,
``triton`` of mla_query / mla_value) against the reference ops of
:mod:`stepgraph.lower.ref_mla` on fresh random inputs and randomly filled paged caches.

CPU: the Triton kernels run in Triton's interpreter, in a subprocess started with
``TRITON_INTERPRET=1`` (this file run as a script), on small shapes: NoPE and rope, decode
and verify-style rows (a request's rows write first, row j sees the request's rows 0..j),
padded rows (slot -1, seq_len 0), a hole (-1) in a block table, DCP's two outputs, one and
several splits, kv_a read through a column view of a packed projection output; DSA with a
selective top-k (with and without rope); mla_query (q_lora or not, rope, DSA's indexer
query) and mla_value (gated or not).
GPU (``-m gpu``): K3 shapes (96 and 12 heads, 512 + 64 latent) in BF16 over contexts up to
4096 tokens with random block tables, rows 1..64, captured in a CUDA graph with PDL and
replayed, against the float32 reference.
"""

from __future__ import annotations

import json
import math
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

TOL_BF16 = 1e-2
TOL_F32 = 1e-4






def make_case(heads: int, requests: int, contexts: list[int] | None = None, q_len: int = 1,
              lora: int = 32, rope: int = 16, block_size: int = 16, padded: int = 0,
              rope_theta: float | None = None, dcp: bool = False, hole: bool = False,
              max_context: int = 64, dsa: tuple[int, int, int] | None = None,
              dtype: Any = None, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Random inputs of one mla_core node (a dsa_core node with ``dsa`` = (indexer heads,
    indexer head dim, top-k)): ``requests`` requests of ``q_len`` rows (their contexts random
    up to ``max_context`` unless given), then ``padded`` padded rows."""
    from stepgraph.ir.nodes import Node

    dtype = dtype or torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = lora + rope
    if contexts is None:
        contexts = [int(torch.randint(0, max_context + 1, (1,), generator=gen))
                    for _ in range(requests)]
    per_request = [math.ceil((c + q_len) / block_size) for c in contexts]
    table_width = max(per_request) + 1
    blocks_total = sum(per_request) + 2
    order = torch.randperm(blocks_total, generator=gen).tolist()
    rows = requests * q_len + padded
    tables = torch.zeros(rows, table_width, dtype=torch.int32)
    seq_lens = torch.zeros(rows, dtype=torch.int32)
    slots = torch.full((rows,), -1, dtype=torch.int64)
    positions = torch.zeros(rows, dtype=torch.int32)
    for n, (context, count) in enumerate(zip(contexts, per_request, strict=True)):
        own = [order.pop() for _ in range(count)]
        for j in range(q_len):
            row = n * q_len + j
            position = context + j
            tables[row, :count] = torch.tensor(own, dtype=torch.int32)
            seq_lens[row] = position + 1
            slots[row] = own[position // block_size] * block_size + position % block_size
            positions[row] = position
    if hole and requests and contexts[0] > block_size:
        tables[:q_len, 0] = -1  # the first request's first block is missing: skipped
    packed = torch.randn(rows, width + 24, generator=gen)
    kv_a = packed.to(dtype)[:, 8:8 + width]  # a column view with row stride width + 24
    q_latent = (torch.randn(rows, heads, width, generator=gen) * 0.5).to(dtype)
    cache = torch.randn(blocks_total, block_size, width, generator=gen).to(dtype)
    norm = (1.0 + 0.1 * torch.randn(lora, generator=gen)).to(dtype)
    names = ["q_latent", "kv_a", "norm", "cache", "block_tables", "seq_lens", "slot_mapping"]
    tensors = [q_latent, kv_a, norm, cache, tables, seq_lens, slots]
    if dsa is not None:
        index_heads, index_dim, _ = dsa
        front = torch.randn(rows, index_dim + index_heads + 8, generator=gen).to(dtype)
        names[3:3] = ["index_q", "index_k", "index_w", "k_norm", "k_norm_bias"]
        tensors[3:3] = [torch.randn(rows, index_heads, index_dim, generator=gen).to(dtype),
                        front[:, 8:8 + index_dim], front[:, 8 + index_dim:],
                        (1.0 + 0.1 * torch.randn(index_dim, generator=gen)).to(dtype),
                        (0.1 * torch.randn(index_dim, generator=gen)).to(dtype)]
        names.insert(9, "k_cache")
        tensors.insert(9, torch.randn(blocks_total, block_size, index_dim,
                                      generator=gen).to(dtype))
    if rope_theta is not None:
        names.append("positions")
        tensors.append(positions)
    bound = {n: t.to(device) for n, t in zip(names, tensors, strict=True)}
    outputs = ["o"] + (["lse"] if dcp else [])
    bound["o"] = torch.full((rows, heads, lora), float("nan"), dtype=dtype, device=device)
    if dcp:
        bound["lse"] = torch.full((rows, heads), float("nan"), dtype=torch.float32,
                                  device=device)
    attrs = dict(heads=heads, kv_lora_rank=lora, qk_nope_head_dim=lora // 2,
                 qk_rope_head_dim=rope, v_head_dim=lora // 2, rope_theta=rope_theta,
                 eps=1e-5, q_lora=True, softmax_scale=(lora // 2 + rope) ** -0.5, q=q_len)
    if dcp:
        attrs["lse"] = True
    if dsa is not None:
        attrs.update(index_heads=dsa[0], index_head_dim=dsa[1], index_top_k=dsa[2])
    node = Node("l3.core", "dsa_core" if dsa else "mla_core", tuple(names), tuple(outputs),
                attrs)
    return {"node": node, "bound": bound, "rows": rows}


def reference(case: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The float32 reference outputs and caches of a case (on copies of its tensors)."""
    from stepgraph.lower import ref_mla
    from stepgraph.lower.ref_common import OpCall

    ins = []
    for name in case["node"].inputs:
        tensor = case["bound"][name].clone()
        ins.append(tensor.float() if tensor.is_floating_point() else tensor)
    outs = len(case["node"].outputs)
    call = OpCall(case["node"], ins, [None] * outs, [torch.float32] * outs, torch.float32,
                  case["rows"])
    caches = {n: ins[case["node"].inputs.index(n)] for n in CACHES if n in case["node"].inputs}
    return getattr(ref_mla, case["node"].op)(call), caches


CACHES = ("cache", "k_cache")


def rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 (inf when a has NaN; 0 when both are 0)."""
    a, b = a.double(), b.double()
    if bool(torch.isnan(a).any()):
        return float("inf")
    norm = float(b.norm())
    diff = float((a - b).norm())
    return diff / norm if norm > 0 else diff


def lse_error(lse: Any, ref: Any) -> float:
    """Largest |lse - ref| where the reference is finite; inf when -inf does not match."""
    finite = torch.isfinite(ref)
    if bool(torch.isnan(lse).any()) or not torch.equal(torch.isfinite(lse), finite):
        return float("inf")
    if not bool(finite.any()):
        return 0.0
    return float((lse[finite].double() - ref[finite].double()).abs().max())


def check_case(pdl: bool = False, capture: bool = False, replays: int = 1,
               tactic: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """Run one case through ``triton_splitkv`` (``triton_sparse`` for DSA) and the reference:
    relative errors of o and the caches, the LSE error (DCP), after each replay (the caches
    carry over)."""
    from stepgraph.runtime.providers import REGISTRY, load_providers

    load_providers()
    case = make_case(**spec)
    op, provider = case["node"].op, "triton_sparse" if spec.get("dsa") else "triton_splitkv"
    entry = REGISTRY.get(op, provider)
    if entry is None:
        return {"error": f"provider {provider} of {op} is not registered"}
    device = torch.device(spec.get("device", "cpu"))
    bound = case["bound"]
    ctx = FakeContext(case["node"], case["rows"], bound, device, pdl, dict(tactic or {}))
    launch = entry.factory(ctx)
    caches = [n for n in CACHES if n in bound]
    if capture:
        initial = {n: bound[n].clone() for n in caches}
        launch()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for n in caches:
            bound[n].copy_(initial[n])
        run = graph.replay
    else:
        run = launch
    result: dict[str, Any] = {"o": [], "cache": [], "lse": [], "nan": False}
    fresh = torch.Generator(device="cpu").manual_seed(1000 + spec.get("seed", 0))
    for _ in range(replays):
        refs, ref_caches = reference(case)
        for name in case["node"].outputs:
            bound[name].fill_(float("nan"))
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["nan"] = result["nan"] or bool(torch.isnan(bound["o"]).any())
        result["o"].append(rel(bound["o"], refs[0]))
        result["cache"].append(max(rel(bound[n], ref_caches[n]) for n in caches))
        if len(refs) > 1:
            result["lse"].append(lse_error(bound["lse"], refs[1]))
        # a fresh query for the next replay, drawn like the first (seeded: the run repeats)
        query = bound["q_latent"]
        query.copy_(torch.randn(query.shape, generator=fresh) * 0.5)
    result["shape"] = {k: spec.get(k) for k in ("heads", "requests", "q_len", "lora", "rope",
                                                 "padded", "dcp", "rope_theta", "hole", "dsa")}
    result["tactic"] = tactic
    return result


def make_query_case(heads: int, rows: int, q_lora: int | None = 32, nope: int = 16,
                    rope: int = 8, v_dim: int = 16, lora: int = 32,
                    rope_theta: float | None = None, index: tuple[int, int] | None = None,
                    dtype: Any = None, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Random inputs of one mla_query node (``index``: DSA's indexer heads and head dim)."""
    from stepgraph.ir.nodes import Node

    dtype = dtype or torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    qk = nope + rope
    if q_lora is not None:
        packed = rnd(rows, q_lora + 40)
        names = ["q_a", "q_norm", "q_b"]
        tensors = [packed[:, 8:8 + q_lora], (1.0 + 0.1 * rnd(q_lora)),
                   rnd(heads * qk, q_lora, scale=q_lora**-0.5)]
        resid = q_lora
    else:
        packed = rnd(rows, heads * qk + 8)
        names, tensors = ["q"], [packed[:, 4:4 + heads * qk]]
        resid = heads * qk
    if index is not None:
        names.append("wq_b")
        tensors.append(rnd(index[0] * index[1], resid, scale=resid**-0.5))
    names.append("kv_b")
    tensors.append(rnd(heads * (nope + v_dim), lora, scale=nope**-0.5))
    if rope_theta is not None:
        names.append("positions")
        tensors.append(torch.randint(0, 5000, (rows,), generator=gen, dtype=torch.int32))
    bound = {n: t.to(device) for n, t in zip(names, tensors, strict=True)}
    outputs = ["q_latent"] + (["index_q"] if index else [])
    shapes = [(rows, heads, lora + rope)] + ([(rows, *index)] if index else [])
    for name, shape in zip(outputs, shapes, strict=True):
        bound[name] = torch.full(shape, float("nan"), dtype=dtype, device=device)
    attrs = dict(heads=heads, kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                 v_head_dim=v_dim, rope_theta=rope_theta, eps=1e-5, q_lora=q_lora is not None)
    node = Node("l3.mla_query", "mla_query", tuple(names), tuple(outputs), attrs)
    return {"node": node, "bound": bound, "rows": rows, "shapes": shapes}


def make_value_case(heads: int, rows: int, nope: int = 16, v_dim: int = 16, lora: int = 32,
                    gated: bool = True, dtype: Any = None, device: str = "cpu",
                    seed: int = 0) -> dict[str, Any]:
    """Random inputs of one mla_value node (the gate a column view of a packed tensor)."""
    from stepgraph.ir.nodes import Node

    dtype = dtype or torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)
    names = ["o_latent", "kv_b"] + (["gate"] if gated else [])
    tensors = [torch.randn(rows, heads, lora, generator=gen).to(dtype),
               (torch.randn(heads * (nope + v_dim), lora, generator=gen) * lora**-0.5).to(dtype)]
    if gated:
        packed = torch.randn(rows, heads * v_dim + 16, generator=gen).to(dtype)
        tensors.append(packed[:, 16:])
    bound = {n: t.to(device) for n, t in zip(names, tensors, strict=True)}
    bound["out"] = torch.full((rows, heads * v_dim), float("nan"), dtype=dtype, device=device)
    attrs = dict(heads=heads, kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=8,
                 v_head_dim=v_dim, rope_theta=None, eps=1e-5, q_lora=True, gated=gated)
    node = Node("l3.mla_value", "mla_value", tuple(names), ("out",), attrs)
    return {"node": node, "bound": bound, "rows": rows, "shapes": [(rows, heads * v_dim)]}


def check_stateless(op: str, pdl: bool = False, capture: bool = False,
                    tactic: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """Run one mla_query / mla_value case through provider ``triton`` and the reference; the
    relative error of each output."""
    from stepgraph.ir.types import TensorType
    from stepgraph.lower import ref_mla
    from stepgraph.lower.ref_common import OpCall
    from stepgraph.runtime.providers import REGISTRY, load_providers

    load_providers()
    entry = REGISTRY.get(op, "triton")
    if entry is None:
        return {"error": f"provider triton of {op} is not registered"}
    case = (make_query_case if op == "mla_query" else make_value_case)(**spec)
    device = torch.device(spec.get("device", "cpu"))
    bound, node = case["bound"], case["node"]
    ins = [bound[n].float() if bound[n].is_floating_point() else bound[n] for n in node.inputs]
    outs = len(node.outputs)
    call = OpCall(node, ins, [TensorType(tuple(s), "float32") for s in case["shapes"]],
                  [torch.float32] * outs, torch.float32, case["rows"])
    refs = getattr(ref_mla, op)(call)
    launch = entry.factory(FakeContext(node, case["rows"], bound, device, pdl,
                                       dict(tactic or {})))
    if capture:
        launch()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        run = graph.replay
    else:
        run = launch
    for name in node.outputs:
        bound[name].fill_(float("nan"))
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    errors = [rel(bound[n], r) for n, r in zip(node.outputs, refs, strict=True)]
    return {"errors": errors, "op": op, "tactic": tactic,
            "spec": {k: v for k, v in spec.items() if k not in ("dtype", "device")}}


# ---------------------------------------------------------------------------- CPU cases

INTERP_CASES = [
    dict(heads=4, requests=3, padded=1),
    dict(heads=3, requests=2, q_len=2, padded=2, dcp=True, contexts=[0, 37]),
    dict(heads=4, requests=2, rope_theta=10000.0, rope=8, lora=16, block_size=8, hole=True,
         contexts=[20, 5]),
    dict(heads=2, requests=1, padded=1, tactic={"split": 1}),
    dict(heads=5, requests=2, contexts=[70, 3], tactic={"split": 3, "block_n": 16}),
    dict(heads=2, requests=1, padded=1, dcp=True, contexts=[0]),
    dict(heads=4, requests=3, padded=1, dsa=(16, 16, 12), contexts=[40, 3, 11]),
    dict(heads=3, requests=2, q_len=2, dsa=(16, 32, 8), rope_theta=10000.0, rope=8,
         contexts=[30, 17]),
]


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalar kernel values as 1-element arrays, which NumPy 2
    refuses to turn into an int when a kernel loops ``range(lo, hi)`` over them: let
    ``__index__`` take the element."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


QUERY_CASES = [
    dict(heads=3, rows=5),
    dict(heads=2, rows=3, rope_theta=10000.0, index=(4, 16)),
    dict(heads=2, rows=2, q_lora=None, nope=16, rope=16, v_dim=8, lora=48),
    dict(heads=2, rows=20, rope_theta=50000.0, rope=16),
    dict(heads=3, rows=1, tactic={"norm_inside": 1}),  # q_a's norm inside q_b's GEMV
    dict(heads=3, rows=2, tactic={"norm_inside": 1}),  # inside the two-row GEMV
    dict(heads=2, rows=2, rope_theta=10000.0),  # the two-row GEMV after a norm launch
    dict(heads=2, rows=4, rope_theta=10000.0, tactic={"norm_inside": 1}),  # norm launch first
    dict(heads=2, rows=1, index=(4, 16), tactic={"norm_inside": 1}),  # DSA keeps the norm
]
VALUE_CASES = [
    dict(heads=3, rows=5),
    dict(heads=2, rows=20, gated=False, v_dim=24, lora=48),
]


def _interpreter_main() -> None:
    _patch_interpreter_index()
    results = []
    for spec in INTERP_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            out = check_case(dtype=dtype, replays=2, **spec)
            out["dtype"] = str(dtype)
            results.append(out)
    stateless = []
    for op, cases in (("mla_query", QUERY_CASES), ("mla_value", VALUE_CASES)):
        for spec in cases:
            for dtype in (torch.float32, torch.bfloat16):
                out = check_stateless(op, dtype=dtype, **spec)
                out["dtype"] = str(dtype)
                stateless.append(out)
    print("RESULTS " + json.dumps(results))
    print("STATELESS " + json.dumps(stateless))


_INTERPRETER_RUN: dict[str, Any] = {}


def _run_interpreter(key: str = "RESULTS") -> list[dict[str, Any]]:
    """One interpreter subprocess for the whole file; the results printed under ``key``."""
    if not _INTERPRETER_RUN:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=900)
        _INTERPRETER_RUN["proc"] = proc
    proc = _INTERPRETER_RUN["proc"]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(key + " ")]
    assert proc.returncode == 0 and lines, (
        f"interpreter run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(key) + 1:])


def _assert_result(res: dict[str, Any], bf16: bool) -> None:
    assert "error" not in res, res
    tol = TOL_BF16 if bf16 else TOL_F32
    assert not res["nan"], f"NaN in o_latent: {res}"
    assert max(res["o"]) < tol, f"o_latent error {res['o']} >= {tol}: {res}"
    assert max(res["cache"]) < tol, f"cache error {res['cache']} >= {tol}: {res}"
    if res["lse"]:
        assert max(res["lse"]) < (2e-2 if bf16 else 1e-4), f"LSE error: {res}"


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_mla_interpreter() -> None:
    """The split-KV MLA kernels match the reference on small shapes (interpreter)."""
    results = _run_interpreter()
    assert len(results) == 2 * len(INTERP_CASES)
    for res in results:
        _assert_result(res, res["dtype"] == "torch.bfloat16")


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_mla_query_value_interpreter() -> None:
    """mla_query (RMSNorm, q_b, W_UK absorption, rope, DSA's indexer query) and mla_value
    (W_UV, gate) match the reference on small shapes (interpreter)."""
    results = _run_interpreter("STATELESS")
    assert len(results) == 2 * (len(QUERY_CASES) + len(VALUE_CASES))
    for res in results:
        assert "error" not in res, res
        tol = TOL_BF16 if res["dtype"] == "torch.bfloat16" else TOL_F32
        assert max(res["errors"]) < tol, f"error {res['errors']} >= {tol}: {res}"


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_mla_kernels_compile_for_h200() -> None:
    """Every MLA kernel compiles to sm_90a cubin at K3 shapes (and tiny_k3's 8 rope dims),
    with the PDL instructions."""
    from test_kernels_kda import compile_for_h200

    from stepgraph.runtime.kernels import mla

    f32, bf16, i32, i64 = "*fp32", "*bf16", "*i32", "*i64"
    write = dict(kv_ptr=bf16, kv_stride="i32", norm_ptr=bf16, cache_ptr=bf16,
                 cache_block_stride="i64", cache_token_stride="i32", slot_ptr=i64,
                 pos_ptr=i32, block_size="i32", eps="fp32", log_theta="fp32")
    for has_rope in (False, True):
        out = compile_for_h200(mla._mla_cache_write_kernel, write, dict(
            LORA=512, BL=512, ROPE=64, BP=64, HAS_ROPE=has_rope, USE_PDL=True), num_warps=4)
        assert "griddepcontrol.wait" in out["ptx"]
    partial = dict(q_ptr=bf16, q_row_stride="i32", q_head_stride="i32", cache_ptr=bf16,
                   cache_block_stride="i64", cache_token_stride="i32", table_ptr=i32,
                   table_stride="i32", table_width="i32", seq_ptr=i32, po_ptr=f32,
                   plse_ptr=f32, scale_log2="fp32", block_size="i32", pick_ptr=i64,
                   pick_stride="i32", picks="i32")
    for heads, lora, rope, rope_block, sparse in ((96, 512, 64, 64, False),
                                                  (12, 512, 64, 64, True),
                                                  (4, 32, 8, 16, False)):
        compile_for_h200(mla._mla_partial_kernel, partial, dict(
            H=heads, LORA=lora, BL=lora, ROPE=rope, BP=rope_block, BH=16, BN=32, SPLITS=8,
            SPARSE=sparse, DOT_F32=False, USE_PDL=True), num_warps=4, num_stages=2)
    key = dict(k_ptr=bf16, k_stride="i32", w_ptr=bf16, bias_ptr=bf16, kc_ptr=bf16,
               kc_block_stride="i64", kc_token_stride="i32", slot_ptr=i64, pos_ptr=i32,
               block_size="i32", log_theta="fp32")
    compile_for_h200(mla._dsa_key_write_kernel, key, dict(ID=128, BID=128, ROPE=64,
                                                          USE_PDL=True), num_warps=4)
    index = dict(iq_ptr=bf16, iq_row_stride="i32", iq_head_stride="i32", iw_ptr=bf16,
                 iw_stride="i32", kc_ptr=bf16, kc_block_stride="i64", kc_token_stride="i32",
                 table_ptr=i32, table_stride="i32", table_width="i32", seq_ptr=i32,
                 pos_ptr=i32, scores_ptr=f32, scores_stride="i32", block_size="i32",
                 capacity="i32", log_theta="fp32", key_scale="fp32", weight_scale="fp32")
    for rope in (0, 64):
        compile_for_h200(mla._dsa_index_kernel, index, dict(
            IH=32, BIH=32, ID=128, BID=128, ROPE=rope, BN=64, DOT_F32=False, USE_PDL=True),
            num_warps=8)
    merge = dict(po_ptr=f32, plse_ptr=f32, out_ptr=bf16, out_row_stride="i32",
                 out_head_stride="i32", lse_ptr=f32, lse_row_stride="i32")
    compile_for_h200(mla._mla_merge_kernel, merge, dict(
        H=96, LORA=512, BLC=64, SPLITS=44, BSP=64, HAS_LSE=True, USE_PDL=True), num_warps=4)
    absorb = dict(q_ptr=bf16, q_stride="i32", kvb_ptr=bf16, pos_ptr=i32, out_ptr=bf16,
                  out_row_stride="i32", out_head_stride="i32", rows="i32", log_theta="fp32")
    for nope, rope, has_rope in ((128, 64, False), (16, 8, True)):
        compile_for_h200(mla._mla_absorb_kernel, absorb, dict(
            NOPE=nope, BNOPE=max(16, nope), ROPE=rope, BP=rope, V=128, LORA=512, BC=64,
            BR=64, HAS_ROPE=has_rope, DOT_F32=False, USE_PDL=True), num_warps=4)
    value = dict(o_ptr=bf16, o_row_stride="i32", o_head_stride="i32", kvb_ptr=bf16,
                 gate_ptr=bf16, gate_stride="i32", out_ptr=bf16, out_stride="i32", rows="i32")
    for gated, one_shot in ((False, False), (True, False), (True, True)):
        out = compile_for_h200(mla._mla_value_kernel, value, dict(
            NOPE=128, V=128, LORA=512, BV=16 if one_shot else 32, BC=512 if one_shot else 128,
            BR=16 if one_shot else 64, GATED=gated, DOT_F32=False, USE_PDL=True,
            ONE_SHOT=one_shot), num_warps=4)
        # the one-shot form loads its W_UV slab before the PDL wait, the chunk loop after
        head = out["ptx"].split("griddepcontrol.wait", 1)[0]
        assert ("ld.global" in head) == one_shot, (gated, one_shot)


def test_reference_sees_the_context() -> None:
    """The check can fail: attending over one token instead of the whole context gives an
    output far from the reference's."""
    case = make_case(heads=2, requests=2, contexts=[30, 40])
    refs, _ = reference(case)
    solo = make_case(heads=2, requests=2, contexts=[30, 40])
    solo["bound"]["seq_lens"].fill_(1)
    solo_refs, _ = reference(solo)
    assert rel(solo_refs[0], refs[0]) > 0.1


# ---------------------------------------------------------------------------- GPU cases

GPU_CASES = [
    dict(heads=96, requests=1, contexts=[4095]),
    dict(heads=96, requests=4, max_context=4096, padded=1),
    dict(heads=96, requests=64, max_context=1024),
    dict(heads=12, requests=1, contexts=[0]),
    dict(heads=12, requests=8, max_context=4096, padded=8),
    dict(heads=12, requests=63, max_context=4096, padded=1),
    dict(heads=12, requests=8, q_len=2, max_context=2048),
    dict(heads=96, requests=4, max_context=4096, dcp=True, padded=2),
    dict(heads=12, requests=16, max_context=4096, tactic={"split": 1}),
    dict(heads=12, requests=1, contexts=[4095], tactic={"split": 128}),
    # the H200 table's one-row tactic (h200.yaml, mla_core)
    dict(heads=12, requests=1, contexts=[4095],
         tactic={"split": 128, "block_n": 32, "num_warps": 4, "stages": 1}),
    dict(heads=96, requests=1, contexts=[4096],
         tactic={"split": 128, "block_n": 32, "num_warps": 4, "stages": 1}),
    dict(heads=96, requests=2, contexts=[4000, 1500], dsa=(32, 128, 2048)),
    dict(heads=12, requests=16, max_context=4096, padded=2, dsa=(32, 128, 2048)),
    dict(heads=12, requests=4, q_len=2, max_context=4096, dsa=(32, 128, 2048),
         rope_theta=10000.0),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", GPU_CASES, ids=lambda s: "-".join(f"{k}{v}" for k, v in
                                                                    s.items()))
def test_mla_gpu(spec: dict[str, Any]) -> None:
    """K3 shapes in BF16, captured in a CUDA graph with PDL, replayed 3 times."""
    spec = dict(spec)
    res = check_case(pdl=True, capture=True, replays=3, dtype=torch.bfloat16, device="cuda",
                     lora=512, rope=64, block_size=64, **spec)
    print(res)
    _assert_result(res, True)


QV_GPU_CASES = [
    ("mla_query", dict(heads=96, rows=1, q_lora=1536, nope=128, rope=64, v_dim=128, lora=512)),
    ("mla_query", dict(heads=12, rows=64, q_lora=1536, nope=128, rope=64, v_dim=128,
                       lora=512)),
    ("mla_query", dict(heads=12, rows=7, q_lora=1536, nope=128, rope=64, v_dim=128, lora=512,
                       rope_theta=10000.0, index=(64, 128))),
    ("mla_query", dict(heads=12, rows=1, q_lora=1536, nope=128, rope=64, v_dim=128, lora=512,
                       rope_theta=10000.0, tactic={"norm_inside": 1})),
    ("mla_query", dict(heads=12, rows=8, q_lora=1536, nope=128, rope=64, v_dim=128, lora=512,
                       tactic={"norm_inside": 1})),
    ("mla_value", dict(heads=96, rows=1, nope=128, v_dim=128, lora=512)),
    ("mla_value", dict(heads=12, rows=64, nope=128, v_dim=128, lora=512)),
    ("mla_value", dict(heads=12, rows=5, nope=128, v_dim=128, lora=512, gated=False)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op,spec", QV_GPU_CASES,
                         ids=lambda c: c if isinstance(c, str) else "-".join(
                             f"{k}{v}" for k, v in c.items()))
def test_mla_query_value_gpu(op: str, spec: dict[str, Any]) -> None:
    """K3 shapes in BF16, captured in a CUDA graph with PDL."""
    res = check_stateless(op, pdl=True, capture=True, dtype=torch.bfloat16, device="cuda",
                          **spec)
    print(res)
    assert "error" not in res, res
    assert max(res["errors"]) < TOL_BF16, f"error too large: {res}"


if __name__ == "__main__":
    _interpreter_main()
