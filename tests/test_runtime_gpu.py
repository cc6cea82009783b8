"""The runtime on the GPU (one CUDA graph per bin, the arena poisoned with NaN before every
step, many replays of every bin) against the reference executor on the same weights, caches
and inputs. Skipped without CUDA (``pytest -m gpu``).

Two kinds of checks:

* FP32 runs (``dtype="float32"``) with the torch baseline providers must match the FP32
  reference to 1e-3: these catch any binding, padding, capture or provider bug;
* BF16 runs with the plan's providers are held to ‖out − ref‖ / ‖ref‖ < 1e-2 against the
  FP32 reference, or, where BF16 itself lands farther from FP32 (the reference executor run
  in BF16 on the same inputs: tiny random models, long recurrences and top-k routing amplify
  rounding), to the BF16 reference's own error: over a whole run (root mean square over
  rows and steps) at most 1.5 times it, each row at most 4 times it. Every check prints both
  numbers.
"""

from __future__ import annotations

import gc
import math

import pytest

torch = pytest.importorskip("torch")

from conftest import MODELS, fork_tables  # noqa: E402
from test_runtime import relative_error, run_against_reference  # noqa: E402

from stepgraph.compiler import compile_graph  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.ir.graph import Graph  # noqa: E402
from stepgraph.ir.types import Storage, eval_dim  # noqa: E402
from stepgraph.lower.decode import DecodeRunner  # noqa: E402
from stepgraph.lower.weights import random_weights  # noqa: E402
from stepgraph.passes.pipeline import CompileOptions  # noqa: E402
from stepgraph.runtime import CompiledStep, StepInputs, load  # noqa: E402
from stepgraph.runtime.decode import CompiledDecodeRunner  # noqa: E402
from stepgraph.runtime.loader import device_target  # noqa: E402
from stepgraph.spec_loader import load_spec, override_deployment, parse_spec_text  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = 1e-2
FP32_TOL = 1e-3
TORCH_ONLY = ("torch", "cublas")


def on_h200() -> bool:
    """Whether this GPU is the artifacts' target (else the tests load with the escape hatch)."""
    return device_target(torch.device("cuda")) == "h200"


def tiny_graph(name: str, all_experts: bool = False) -> Graph:
    """A tiny spec compiled for the H200; ``all_experts``: every row routes to all 8 experts
    (no top-k decision a rounding can flip)."""
    text = (MODELS / f"{name}.yaml").read_text()
    if all_experts:
        text = text.replace("top_k: 2\n", "top_k: 8\n")
        assert "top_k: 8\n" in text
    spec = parse_spec_text(text)
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, target="h200"))
    return graph


def bf16_row_ok(err: float, baseline: float) -> bool:
    """The BF16 criterion of one row or step (see the module docstring)."""
    return err < max(TOL, 4.0 * baseline)


def bf16_run_ok(errors: list[tuple[float, float]]) -> tuple[bool, str]:
    """The BF16 criterion of a run of (error, BF16 reference's error) pairs, and a summary."""
    rms = math.sqrt(sum(e * e for e, _ in errors) / len(errors))
    base = math.sqrt(sum(b * b for _, b in errors) / len(errors))
    worst = max(e for e, _ in errors)
    summary = (f"{len(errors)} rows: rms relative error {rms:.3e} (reference in bf16 "
               f"{base:.3e}), worst {worst:.3e}")
    return rms < max(TOL, 1.5 * base), summary


# ---------------------------------------------------------------------- tiny models


def _decode(graph: Graph, dtype: str, providers, requests: int = 7, length: int = 40
            ) -> tuple[list[str], list[tuple[float, float]]]:
    """Decode random prompts on the compiled step (CUDA graphs) and on the reference in FP32
    (and in BF16 for a BF16 step), every step with the arena poisoned; returns the failing
    rows' lines (all lines are printed) and every row's (error, BF16 reference's error)."""
    device = torch.device("cuda")
    step = load(graph, weights="random", device="cuda", dtype=dtype, block_size=16,
                max_context=256, progress=True, allow_target_mismatch=not on_h200(),
                providers=providers)
    print(step.report())
    assert step.captured, "every bin should replay a CUDA graph"
    weights = random_weights(graph, 0, dtype=torch.float32)
    runners = {"step": CompiledDecodeRunner(step, requests),
               "fp32": DecodeRunner(graph, weights, requests, length, device=device,
                                    dtype="float32", block_size=16)}
    if dtype == "bfloat16":
        runners["bf16"] = DecodeRunner(graph, weights, requests, length, device=device,
                                       dtype="bfloat16", block_size=16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(length // 3, length, (requests,), generator=gen)]
    for runner in runners.values():
        for r in range(requests):
            runner.add(r)
    failures, errors, replays = [], [], 0
    for t in range(length):
        active = [r for r in range(requests) if t < len(prompts[r])]
        if not active:
            break
        work = [(r, [prompts[r][t]]) for r in active]
        step.poison_arena()
        out = {key: runner.step(work) for key, runner in runners.items()}
        replays += 1
        for r in active:
            err = relative_error(out["step"][r], out["fp32"][r])
            base = relative_error(out["bf16"][r], out["fp32"][r]) if "bf16" in out else 0.0
            errors.append((err, base))
            ok = err < FP32_TOL if dtype == "float32" else bf16_row_ok(err, base)
            line = (f"{graph.name} {dtype} step {t} ({len(active)} rows, bin "
                    f"{step.bin_for(len(active))}) request {r}: relative error {err:.3e}"
                    + (f" (reference in bf16: {base:.3e})" if "bf16" in out else ""))
            print(line)
            if not ok:
                failures.append(line)
    assert replays >= length // 3
    return failures, errors


@pytest.mark.parametrize("name", ["tiny_k3", "tiny_kimi_linear"])
def test_tiny_decode_fp32_torch_providers_matches_the_reference(name) -> None:
    failures, _ = _decode(tiny_graph(name), "float32", TORCH_ONLY)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("name", ["tiny_k3", "tiny_kimi_linear"])
def test_tiny_decode_bf16_plan_providers_matches_the_reference(name) -> None:
    failures, errors = _decode(tiny_graph(name, all_experts=True), "bfloat16", None)
    ok, summary = bf16_run_ok(errors)
    print(summary)
    assert ok and not failures, "\n".join([summary, *failures[:10]])


def tiny_step_with_random_caches() -> tuple[CompiledStep, dict[str, torch.Tensor]]:
    """tiny_k3 loaded in BF16 with N(0, 1) caches, and a copy of those caches."""
    step = load(tiny_graph("tiny_k3"), weights="random", device="cuda", dtype="bfloat16",
                progress=False, allow_target_mismatch=not on_h200())
    for cache in step.caches.values():
        cache.normal_()
    return step, {n: c.clone() for n, c in step.caches.items()}


def test_replays_of_one_step_agree() -> None:
    """The same inputs on the same caches, replayed 100 times, give the same logits."""
    step, saved = tiny_step_with_random_caches()
    rows = 5
    inputs = StepInputs(tokens=[3, 1, 4, 1, 5], positions=[7] * rows,
                        kda_state_indices=list(range(rows)),
                        block_tables=[[r, r + 8] for r in range(rows)], seq_lens=[70] * rows,
                        slot_mapping=[(r + 8) * 64 + 5 for r in range(rows)])
    first = step.step(inputs).clone()
    assert torch.isfinite(first).all()
    for replay in range(100):
        for name, cache in step.caches.items():
            cache.copy_(saved[name])
        err = relative_error(step.step(inputs), first)
        assert err < 1e-3, f"replay {replay}: relative error {err:.3e} against the first"
    # the caches moved: without restoring them, the next step differs
    assert relative_error(step.step(inputs), first) > 1e-3


def test_steps_queued_ahead_of_the_gpu_keep_their_own_inputs() -> None:
    """step() does not wait for the GPU: with the GPU held busy, the host queues several
    steps (the input copies are asynchronous, from pinned mirrors), and a burst of steps
    longer than the mirrors, queued without waiting, gives each step the logits it gives
    when every step is waited for."""
    step, saved = tiny_step_with_random_caches()
    rows = 3
    gen = torch.Generator().manual_seed(11)
    burst = [StepInputs(tokens=torch.randint(0, 256, (rows,), generator=gen).tolist(),
                        positions=[7 + t] * rows, kda_state_indices=list(range(rows)),
                        block_tables=[[r, r + 8] for r in range(rows)],
                        seq_lens=[8 + t] * rows,
                        slot_mapping=[r * 64 + 7 + t for r in range(rows)])
             for t in range(3 * len(step.filler.mirrors))]

    def run(wait: bool) -> list[torch.Tensor]:
        for name, cache in step.caches.items():
            cache.copy_(saved[name])
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the GPU is busy while the host queues the burst
        outs = []
        for t, inputs in enumerate(burst):
            outs.append(step.step(inputs))
            if t == len(step.filler.mirrors) - 2 and not wait:
                assert not torch.cuda.current_stream().query(), \
                    "the host waited for the GPU within the first steps"
            if wait:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return outs

    waited, queued = run(True), run(False)
    for t, (a, b) in enumerate(zip(queued, waited, strict=True)):
        assert torch.isfinite(b).all()
        err = relative_error(a, b)
        assert err < 1e-3, f"step {t}: queued differs from waited by {err:.3e}"
    assert relative_error(waited[0], waited[1]) > 1e-2  # the steps differ from each other


@pytest.mark.parametrize("rule", ["seeds", "next_weights"])
def test_prefetch_forks_on_the_side_stream_change_no_logit(rule: str, tmp_path) -> None:
    """tiny_k3 compiled with L2 prefetch forks (the l2_prefetch provider forks them onto a
    side stream inside the CUDA graph) gives the same logits, bit for bit, as without forks,
    over replays of every bin."""
    spec = load_spec(MODELS / "tiny_k3.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    plain, _ = compile_graph(spec, deployment)
    # tiny weights: every launch of at least 2 KiB of weights counts as streaming
    forked, _ = compile_graph(spec, deployment,
                              tables_path=fork_tables(tmp_path, 4096, rule, stream_min=2048))
    assert not [n for n in plain if n.op == "prefetch"]
    assert [n for n in forked if n.op == "prefetch"]
    steps = [load(graph, weights="random", device="cuda", dtype="bfloat16", progress=False,
                  allow_target_mismatch=not on_h200()) for graph in (plain, forked)]
    assert {c.provider for c in steps[1].choices() if c.op == "prefetch"} == {"l2_prefetch"}
    assert_same_logits(steps, "the forks")


def test_side_stream_shared_expert_changes_no_logit() -> None:
    """tiny_k3 with its shared experts on the side stream (the streams pass, on by default
    for the H200) gives the same logits, bit for bit, as on one stream, over replays of
    several bins (the reference checks of the other tiny_k3 tests run with it on)."""
    spec = load_spec(MODELS / "tiny_k3.yaml")
    deployment = override_deployment(spec.deployment, target="h200")
    one, _ = compile_graph(spec, deployment, CompileOptions(streams=False))
    two, _ = compile_graph(spec, deployment)
    assert not one.meta["streams"]["side"]
    assert {two.node(n).op for n in two.meta["streams"]["side"]} == {"shared_expert"}
    steps = [load(graph, weights="random", device="cuda", dtype="bfloat16", progress=False,
                  allow_target_mismatch=not on_h200()) for graph in (one, two)]
    assert_same_logits(steps, "the side stream")


def assert_same_logits(steps: list[CompiledStep], what: str) -> None:
    """Both steps give bit-equal, finite logits from the same caches at 1, 3, 5 and 2 rows,
    three replays each (the steps bound the same random weights)."""
    gen = torch.Generator().manual_seed(3)
    caches = {n: torch.randn(c.shape, generator=gen).to(c.dtype)
              for n, c in steps[0].caches.items()}
    for rows in (1, 3, 5, 2):
        inputs = StepInputs(tokens=torch.randint(0, 256, (rows,), generator=gen).tolist(),
                            positions=[9] * rows, kda_state_indices=list(range(rows)),
                            block_tables=[[r, r + 8] for r in range(rows)],
                            seq_lens=[10] * rows, slot_mapping=[r * 64 + 9 for r in range(rows)])
        outs = []
        for step in steps:
            for name, cache in step.caches.items():
                cache.copy_(caches[name])
            for _ in range(3):
                out = step.step(inputs)
            outs.append(out)
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1]), f"{rows} rows: {what} changed the logits"


def test_other_targets_are_refused_on_the_gpu() -> None:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    name = torch.cuda.get_device_name()
    own = next((t for card, t in (("H200", "h200"), ("H100", "h100")) if card in name), None)
    for target in ("cpu", "b200"):
        graph, _ = compile_graph(spec, override_deployment(spec.deployment, target=target))
        fix = f"recompile with --target {own}" if own else "recompile for a target"
        with pytest.raises(UserError, match=f"compiled for target {target} .*{fix}"):
            load(graph, device="cuda", progress=False)


# ---------------------------------------------------------------------- a K3 slice

SLICE_BINS = (1, 4, 16, 64)


def k3_slice_graph(experts: int = 64) -> Graph:
    """K3 at real dimensions, TP1, four layers with attention kda, kda, mla, kda (K3's layers
    1..4), every MLP a latent MoE with ``experts`` routed experts, bins 1, 4, 16, 64."""
    text = (MODELS / "kimi_k3.yaml").read_text()
    text = text.replace("experts: 896", f"experts: {experts}")
    text = text.replace("count: 93", "count: 4")
    text = text.replace('      - {at: "3-91/4, 92", attention: mla}\n      - {at: 0, mlp: dense}',
                        '      - {at: "2", attention: mla}')
    spec = parse_spec_text(text)
    kinds = [(k.attention, k.mlp) for k in spec.model.layer_list()]
    assert kinds == [("kda", "moe"), ("kda", "moe"), ("mla", "moe"), ("kda", "moe")], kinds
    deployment = override_deployment(spec.deployment, batches=SLICE_BINS, target="h200")
    graph, _ = compile_graph(spec, deployment)
    return graph


def gpu_random_weights(graph: Graph, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random FP32 weights drawn on ``device`` (fast at K3 sizes), scaled like a trained
    model: matrices N(0, 1/fan_in), norms ~1, A_log = log U(1, 16), dt_bias the FLA init,
    small biases; zero rows where a packed weight pads."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for value in graph.values_of(Storage.WEIGHT):
        shape = tuple(eval_dim(d, 1) for d in value.type.shape)
        leaf = value.name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            t = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
        elif leaf == "dt_bias":
            dt = torch.empty(shape, device=device).uniform_(math.log(1e-3), math.log(1e-1),
                                                            generator=gen).exp()
            t = dt + torch.log(-torch.expm1(-dt))
        elif leaf in ("e_score_correction_bias", "k_norm_bias"):
            t = 0.05 * torch.randn(shape, device=device, generator=gen)
        elif "norm" in leaf or leaf.endswith("layernorm"):
            t = 1.0 + 0.05 * torch.randn(shape, device=device, generator=gen)
        else:
            t = torch.randn(shape, device=device, generator=gen) / math.sqrt(shape[-1])
        for segment in value.segments:
            if segment.source is None:
                t[segment.offset : segment.offset + segment.rows] = 0
        weights[value.name] = t
    return weights


@pytest.fixture(scope="module")
def k3_slice():
    """The K3 slice graph and its FP32 weights on the GPU (about 50 GB)."""
    graph = k3_slice_graph()
    weights = gpu_random_weights(graph, 0, torch.device("cuda"))
    yield graph, weights
    del weights
    torch.cuda.empty_cache()


def _load_slice(graph: Graph, weights, dtype: str, providers):
    return load(graph, weights=weights, device="cuda", dtype=dtype, max_requests=64,
                max_context=1024, block_size=64, progress=True,
                allow_target_mismatch=not on_h200(), providers=providers)


def test_k3_slice_fp32_torch_providers_match_the_reference(k3_slice) -> None:
    graph, weights = k3_slice
    step = _load_slice(graph, weights, "float32", TORCH_ONLY)
    print(step.report())
    checks = run_against_reference(step, weights, SLICE_BINS, seed=1)
    bad = [c.line() for c in checks if not c.err < FP32_TOL]
    assert not bad, "\n".join(bad)


def bf16_slice_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Roughly what the BF16 slice check holds at once: the FP32 weights (the reference's),
    the step's BF16 copy of them, the reference's FP32 upcast of the largest BF16 matrix
    (transient, twice for its output and slack) and 2 GiB of caches, arena and activations.
    An H100's 80 GB ran out 4.4 GiB short of it (2026-12-06)."""
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    return int(1.5 * sum(sizes) + 2 * max(sizes) + (2 << 30))


def test_k3_slice_bf16_plan_providers_match_the_reference(k3_slice) -> None:
    graph, weights = k3_slice
    need, have = bf16_slice_bytes(weights), torch.cuda.get_device_properties(0).total_memory
    if have < need:
        pytest.skip(f"the BF16 slice check needs about {need / 2**30:.0f} GiB of GPU memory "
                    f"and this GPU has {have / 2**30:.0f} GiB: run it on an H200")
    gc.collect()
    torch.cuda.empty_cache()
    step = _load_slice(graph, weights, "bfloat16", None)
    print(step.report())
    checks = run_against_reference(step, weights, SLICE_BINS, seed=1,
                                   baseline_weights=step.bindings.fixed)
    assert all(torch.isfinite(c.got).all() for c in checks), "NaN or inf in the logits"
    errors = [(relative_error(c.got[r], c.want[r]), relative_error(c.baseline[r], c.want[r]))
              for c in checks for r in range(c.got.shape[0])]
    ok, summary = bf16_run_ok(errors)
    print(f"k3 slice bf16, every bin and step: {summary}")
    bad = [c.line() for c in checks if not bf16_row_ok(c.err, c.baseline_err)]
    assert ok and not bad, "\n".join([summary, *bad])
