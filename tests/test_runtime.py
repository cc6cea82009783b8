"""The runtime on CPU (eager launches, torch providers, float32) against the reference
executor: multi-step decode over every bin with padded rows (decode and verify steps), the
arena binding (no two temps live at once share a byte; NaN-poisoning the arena changes
nothing), padding touching no real state, and the refusals."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from conftest import MODELS  # noqa: E402

from stepgraph.artifact import load_artifact, write_artifact  # noqa: E402
from stepgraph.compiler import compile_document, compile_graph  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.ir.graph import Graph  # noqa: E402
from stepgraph.ir.types import Storage  # noqa: E402
from stepgraph.lower.caches import allocate_caches  # noqa: E402
from stepgraph.lower.decode import DecodeRunner, run_prompts  # noqa: E402
from stepgraph.lower.reference import ReferenceExecutor  # noqa: E402
from stepgraph.lower.weights import random_weights  # noqa: E402
from stepgraph.runtime import CompiledStep, StepInputs, load  # noqa: E402
from stepgraph.runtime.capture import BinContext, prepare_node  # noqa: E402
from stepgraph.runtime.decode import CompiledDecodeRunner  # noqa: E402
from stepgraph.runtime.loader import check_target  # noqa: E402
from stepgraph.runtime.providers import torch_ops  # noqa: E402
from stepgraph.runtime.providers.registry import ProviderEntry, Registry  # noqa: E402
from stepgraph.spec_loader import load_spec, override_deployment  # noqa: E402

SPECS = ("tiny_k3", "tiny_kimi_linear")
# six requests of different lengths: steps of 6, 5, 4, 3, 2, 1 requests use bins 8 (two
# padded rows), 8, 4, 4 (one padded), 2 and 1
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [10, 20, 30], [200, 100, 50, 25, 12],
           [5, 6, 7, 8, 9, 10, 11, 12, 13], [7, 7], [3, 1, 4, 1, 5, 9, 2]]
BLOCK_SIZE = 4
CONTEXT = 16


def compiled(name: str, target: str = "cpu", **deployment) -> Graph:
    """A tiny spec compiled at a world of one."""
    spec = load_spec(MODELS / f"{name}.yaml")
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, target=target,
                                                       **deployment))
    return graph


def cpu_step(graph: Graph, **options) -> CompiledStep:
    """The graph loaded on CPU in float32 with seed-0 random weights."""
    options.setdefault("allow_target_mismatch", True)
    return load(graph, weights="random", device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                max_context=CONTEXT, progress=False, **options)


def reference_runner(graph: Graph, requests: int) -> DecodeRunner:
    """The reference executor's decode runner on the same (seed-0) weights."""
    weights = random_weights(graph, 0, dtype=torch.float32)
    return DecodeRunner(graph, weights, requests, CONTEXT - 2, block_size=BLOCK_SIZE)


def worst_relative(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| over the entries both define."""
    assert np.array_equal(np.isnan(a), np.isnan(b)), "different rows are defined"
    return float(np.nanmax(np.abs(a - b)) / max(float(np.nanmax(np.abs(b))), 1e-12))


@pytest.mark.parametrize("target", ["cpu", "h200"])
@pytest.mark.parametrize("name", SPECS)
def test_decode_matches_the_reference_over_every_bin(name, target) -> None:
    graph = compiled(name, target)
    step = cpu_step(graph)
    got = run_prompts(CompiledDecodeRunner(step), PROMPTS)
    want = run_prompts(reference_runner(graph, len(PROMPTS)), PROMPTS)
    assert np.isfinite(want[0]).all()
    err = worst_relative(got, want)
    assert err < 1e-5, f"{name} (target {target}): worst relative error {err:.2e}"
    # the check can fail: other weights give other logits
    other = load(graph, weights="random", seed=1, device="cpu", dtype="float32",
                 block_size=BLOCK_SIZE, max_context=CONTEXT, progress=False,
                 allow_target_mismatch=True)
    assert worst_relative(run_prompts(CompiledDecodeRunner(other), PROMPTS[:1]),
                          want[:1, :len(PROMPTS[0])]) > 1e-2


@pytest.mark.parametrize("name", SPECS)
def test_verify_steps_match_the_reference(name) -> None:
    """q = 2: each request's two rows, some steps accepting one token only."""
    graph = compiled(name, q=2, batches=(2, 4, 8))
    step = cpu_step(graph)
    runners = [CompiledDecodeRunner(step, 3), reference_runner(graph, 3)]
    for runner in runners:
        for request in range(3):
            runner.add(request)
    plan = [[(0, [1, 2]), (1, [3, 4]), (2, [5, 6])], [(0, [7, 8]), (2, [9, 10])],
            [(1, [11, 12])], [(0, [13, 14]), (1, [15, 16]), (2, [17, 18])]]
    for index, work in enumerate(plan):
        got, want = (runner.step(work) for runner in runners)
        for request, _ in work:
            err = worst_relative(got[request].numpy(), want[request].numpy())
            assert err < 1e-5, f"{name} verify step {index} request {request}: {err:.2e}"
        if index == 1:
            for runner in runners:
                runner.accept(0, 1)


def test_saved_artifact_loads_and_runs(tmp_path) -> None:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    document, _ = compile_document(spec, override_deployment(spec.deployment, target="cpu"))
    path = tmp_path / "tiny.sgart"
    write_artifact(document, path)
    step = load(path, weights="random", device="cpu", dtype="float32", progress=False)
    assert step.document is not None and step.document["hash"] == document["hash"]
    logits = step.step(StepInputs(tokens=[1, 2, 3], positions=[0, 0, 0],
                                  kda_state_indices=[0, 1, 2], block_tables=[[0], [1], [2]],
                                  seq_lens=[1, 1, 1], slot_mapping=[0, 64, 128]))
    assert logits.shape == (3, 256) and torch.isfinite(logits).all()
    assert load(load_artifact(path), device="cpu", dtype="float32", progress=False).bins == [
        1, 2, 4, 8]


# ---------------------------------------------------------------------- long contexts


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when ``out`` holds a NaN or an inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_context_inputs(step: CompiledStep, rows: int, contexts: list[int],
                          gen: torch.Generator) -> StepInputs:
    """Row r: request r (state slot r, blocks r * width ...) with ``contexts[r]`` cached
    tokens before its new one."""
    width, size = step.limits.width, step.block_size
    return StepInputs(
        tokens=torch.randint(0, step.limits.vocab, (rows,), generator=gen).tolist(),
        positions=contexts[:rows], kda_state_indices=list(range(rows)),
        block_tables=[[r * width + j for j in range(width)] for r in range(rows)],
        seq_lens=[c + 1 for c in contexts[:rows]],
        slot_mapping=[(r * width + c // size) * size + c % size
                      for r, c in enumerate(contexts[:rows])])


@dataclass
class StepCheck:
    """One step of the compiled step against the FP32 reference (``want``) and, optionally,
    the reference executor in BF16 (``baseline``: how far BF16 itself lands from FP32)."""

    size: int
    repeat: int
    got: torch.Tensor
    want: torch.Tensor
    baseline: torch.Tensor | None = None

    @property
    def err(self) -> float:
        """The compiled step's relative error against the FP32 reference."""
        return relative_error(self.got, self.want)

    @property
    def baseline_err(self) -> float:
        """The BF16 reference's relative error against the FP32 reference (0 without)."""
        return 0.0 if self.baseline is None else relative_error(self.baseline, self.want)

    def line(self) -> str:
        """A readable summary."""
        rows = self.got.shape[0]
        worst = max(relative_error(self.got[r], self.want[r]) for r in range(rows))
        text = (f"bin {self.size} ({rows} rows) step {self.repeat}: relative error "
                f"{self.err:.3e}, worst row {worst:.3e}, NaN {int(torch.isnan(self.got).sum())}")
        if self.baseline is not None:
            text += f"; reference in bf16: {self.baseline_err:.3e}"
        return text


def run_against_reference(step: CompiledStep, weights: dict[str, torch.Tensor],
                          bins: tuple[int, ...], seed: int = 0, repeats: int = 2,
                          baseline_weights: dict[str, torch.Tensor] | None = None
                          ) -> list[StepCheck]:
    """Fill the step's caches with random contexts (never zeros), copy them into FP32 caches
    of a reference executor on the same weights (and into BF16 caches of a BF16 reference on
    ``baseline_weights`` when given), then run ``repeats`` consecutive steps at every bin
    (one padded row in each bin above 1) on all of them, the arena poisoned before each."""
    graph = step.graph
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, cache in step.caches.items():
            scale = 0.3 if name.endswith("recurrent_state") else 1.0
            cache.copy_(scale * torch.randn(cache.shape, generator=gen).to(cache.dtype))
    lim = step.limits

    def reference(dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> ReferenceExecutor:
        caches = allocate_caches(graph, lim.slots + 1, lim.blocks + 1, lim.block_size,
                                 step.device, dtype)
        for name, cache in caches.items():
            cache.copy_(step.caches[name])
        return ReferenceExecutor(graph, tensors, caches, step.device, dtype)

    fp32 = reference(torch.float32, weights)
    bf16 = None if baseline_weights is None else reference(torch.bfloat16, baseline_weights)
    names = {v.name for v in graph.values_of(Storage.INPUT)}
    contexts = torch.randint(1, lim.max_context - repeats, (bins[-1],), generator=gen).tolist()
    checks = []
    for size in bins:
        rows = size - 1 if size > 1 else 1
        for repeat in range(repeats):
            inputs = random_context_inputs(step, rows, [c + repeat for c in contexts], gen)
            step.poison_arena()
            got = step.step(inputs).float().cpu()
            feed = {n: torch.as_tensor(np.asarray(getattr(inputs, n))) for n in names}
            want = fp32.step(feed)["logits"].float().cpu()
            base = None if bf16 is None else bf16.step(feed)["logits"].float().cpu()
            check = StepCheck(size, repeat, got, want, base)
            print(check.line())
            checks.append(check)
    return checks


@pytest.mark.parametrize("name", SPECS)
def test_long_random_contexts_match_the_reference(name) -> None:
    graph = compiled(name)
    weights = random_weights(graph, 0, dtype=torch.float32)
    step = load(graph, weights=weights, device="cpu", dtype="float32", block_size=8,
                max_context=64, progress=False)
    checks = run_against_reference(step, weights, tuple(step.bins))
    assert all(c.err < 1e-5 for c in checks), [c.line() for c in checks]


# ---------------------------------------------------------------------- the arena


def _live_ranges(graph: Graph) -> dict[str, tuple[int, int]]:
    """Launch ranges of every arena temp, computed here from the program order."""
    spans: dict[str, list[int]] = {}
    for index, node in enumerate(graph):
        for name in node.inputs:
            root = graph.root(name)
            if graph.values[root].storage is Storage.TEMP:
                spans[root][1] = index
        for name in node.outputs:
            if graph.values[name].view is None and graph.values[name].storage is Storage.TEMP:
                spans[name] = [index, index]
    return {name: (a, b) for name, (a, b) in spans.items()}


def _byte_range(tensor: torch.Tensor, base: int) -> tuple[int, int]:
    start = tensor.data_ptr() - base
    return start, start + tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", SPECS)
def test_no_two_live_temps_share_arena_bytes(name, dtype) -> None:
    graph = compiled(name)
    step = load(graph, weights="random", device="cpu", dtype=dtype, progress=False)
    base = step.arena.data.data_ptr()
    spans = _live_ranges(graph)
    for size in step.bins:
        temps = step.temps(size)
        ranges = {n: _byte_range(temps[n], base) for n in spans}
        for n, (lo, hi) in ranges.items():
            assert 0 <= lo <= hi <= step.arena.nbytes, f"{n} lies outside the arena"
            assert temps[n].is_contiguous()
        names = sorted(spans)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                live = spans[a][0] <= spans[b][1] and spans[b][0] <= spans[a][1]
                bytes_ = ranges[a][0] < ranges[b][1] and ranges[b][0] < ranges[a][1]
                assert not (live and bytes_), f"bin {size}: {a} and {b} are live together " \
                                              f"and share bytes {ranges[a]} / {ranges[b]}"
        for n, value in graph.values.items():  # views look into their bases
            if value.view is not None and value.storage is Storage.TEMP:
                root = graph.root(n)
                lo, hi = _byte_range(temps[n], base)
                assert ranges[root][0] <= lo and hi <= ranges[root][1] + 1, n


@pytest.mark.parametrize("name", SPECS)
def test_poisoning_the_arena_before_each_step_changes_nothing(name) -> None:
    graph = compiled(name)
    clean, poisoned = cpu_step(graph), cpu_step(graph)
    runners = [CompiledDecodeRunner(clean), CompiledDecodeRunner(poisoned)]
    for runner in runners:
        for request in range(5):
            runner.add(request)
    for t in range(4):
        work = [(r, [(7 * r + 3 * t + 1) % 256]) for r in range(5 - t)]
        poisoned.poison_arena()
        a, b = (runner.step(work) for runner in runners)
        for request in a:
            assert torch.isfinite(b[request]).all()
            assert torch.equal(a[request], b[request]), f"step {t} request {request}"


def test_poison_reaches_the_temps_in_use() -> None:
    """The poison test can fail: poisoning between two launches of a step shows up."""
    step = cpu_step(compiled("tiny_k3"))
    inputs = StepInputs(tokens=[5, 6], positions=[0, 0], kda_state_indices=[0, 1],
                        block_tables=[[0], [4]], seq_lens=[1, 1], slot_mapping=[0, 16])
    step.filler.fill(inputs, 2)
    plan = step.plans[2]
    half = len(plan.launches) // 2
    for launch in plan.launches[:half]:
        launch()
    step.poison_arena()
    for launch in plan.launches[half:]:
        launch()
    assert torch.isnan(step.bindings.outputs["logits"][:2]).any()


def test_padding_rows_touch_no_real_slot_or_block() -> None:
    graph = compiled("tiny_k3")
    step = cpu_step(graph)
    for cache in step.caches.values():
        cache.normal_()
    before = {n: c.clone() for n, c in step.caches.items()}
    inputs = StepInputs(tokens=[9], positions=[3], kda_state_indices=[2],
                        block_tables=[[5, 6]], seq_lens=[4], slot_mapping=[5 * BLOCK_SIZE + 3])
    step.step(inputs)  # one real row in bin 1
    step.step(StepInputs(tokens=[9, 8, 7], positions=[4, 0, 0], kda_state_indices=[2, -1, -1],
                         block_tables=[[5, 6], [0, 0], [0, 0]], seq_lens=[5, 0, 0],
                         slot_mapping=[6 * BLOCK_SIZE, -1, -1]))  # bin 4, 3 padded rows
    for name, cache in step.caches.items():
        changed = (cache != before[name]).reshape(cache.shape[0], -1).any(1)
        touched = set(torch.nonzero(changed).flatten().tolist())
        scratch = cache.shape[0] - 1
        if name.endswith("latent_cache"):
            assert touched <= {5, 6, scratch}, (name, touched)
            assert {5, 6} <= touched
        else:
            assert touched <= {2, scratch}, (name, touched)
            assert 2 in touched


def test_inputs_live_in_one_block_and_a_bad_step_writes_nothing() -> None:
    """The input buffers are views of one device block (one copy fills them), each in its
    own bytes; a step refused for a bad input leaves every buffer as it was."""
    step = cpu_step(compiled("tiny_k3"))
    filler = step.filler
    buffers = filler.buffers
    assert set(buffers) == set(step.bindings.inputs)
    spans = []
    for name, buffer in buffers.items():
        assert buffer.untyped_storage().data_ptr() == filler.block.untyped_storage().data_ptr()
        start = buffer.data_ptr() - filler.block.data_ptr()
        spans.append((start, start + buffer.numel() * buffer.element_size(), name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        assert end <= start, f"{a} and {b} overlap"
    assert spans[-1][2] == "block_tables"  # the largest last: a bin copies its rows only

    good = StepInputs(tokens=[9, 8], positions=[3, 1], kda_state_indices=[2, -1],
                      block_tables=[[5, 6], [1, 2]], seq_lens=[4, 2],
                      slot_mapping=[5 * BLOCK_SIZE + 3, 1 * BLOCK_SIZE + 1])
    filler.fill(good, 4)
    assert buffers["tokens"][:4].tolist() == [9, 8, 0, 0]
    assert buffers["kda_state_indices"][:4].tolist() == [2] + [filler.limits.slots] * 3
    assert buffers["slot_mapping"][:4].tolist() == [23, 5, -1, -1]
    assert buffers["block_tables"][:2, :2].tolist() == [[5, 6], [1, 2]]
    assert buffers["block_tables"][2:4].abs().sum() == 0
    before = {name: buffer.clone() for name, buffer in buffers.items()}
    bad = StepInputs(tokens=[1, 2], positions=[0, 0], kda_state_indices=[0, 1],
                     block_tables=[[0], [1]], seq_lens=[1, 1], slot_mapping=[0, 10 ** 6])
    with pytest.raises(UserError, match="slot_mapping"):
        filler.fill(bad, 4)
    for name, buffer in buffers.items():
        assert torch.equal(buffer, before[name]), name


# ---------------------------------------------------------------------- refusals


def test_an_artifact_for_another_target_is_refused() -> None:
    graph = compiled("tiny_k3", "h200")
    with pytest.raises(UserError, match=r"compiled for target h200 but the device is cpu: "
                                        r"recompile with --target cpu, or .*allow_target_mismatch"):
        load(graph, device="cpu", dtype="float32", progress=False)
    check_target("cpu", torch.device("cpu"))
    with pytest.raises(UserError, match="target b200"):
        check_target("b200", torch.device("cpu"))
    check_target("b200", torch.device("cpu"), allow_mismatch=True)


def test_stepgraph_run_refuses_another_targets_artifact_in_one_line(tmp_path) -> None:
    """`stepgraph run` of an H200 artifact on the CPU: exit 2, one line naming the --target
    to recompile with (no Python-API escape a command line cannot use), no logits file."""
    from conftest import MODELS, run_cli

    artifact, out = tmp_path / "tiny.sgart", tmp_path / "logits.npy"
    assert run_cli("compile", str(MODELS / "tiny_k3.yaml"), "--target", "h200", "-o",
                   str(artifact)).returncode == 0
    result = run_cli("run", str(artifact), "--weights", "random", "--tokens", "1,2",
                     "--device", "cpu", "--logits-out", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the artifact was compiled for target h200 but the device is cpu: recompile "
        "with --target cpu"]
    assert not out.exists()


def test_a_gpu_refusal_names_the_cards_target(monkeypatch) -> None:
    """On a GPU (its name patched in: the check reads only the name) the refusal names the
    --target of the card, or says that no target names it."""
    from stepgraph.runtime.loader import device_target

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_target(cuda) == "h100"
    check_target("h100", cuda)
    with pytest.raises(UserError, match=r"compiled for target h200 but the device is NVIDIA "
                                        r"H100 80GB HBM3: recompile with --target h100, or"):
        check_target("h200", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4")
    assert device_target(cuda) is None
    with pytest.raises(UserError, match="recompile for a target of this device"):
        check_target("h200", cuda)


def test_a_multi_rank_artifact_is_refused() -> None:
    graph = compiled("tiny_k3", tp=2)
    with pytest.raises(UserError, match=r"runs on 2 ranks: start one process a GPU .*--nproc 2"):
        load(graph, device="cpu", dtype="float32", progress=False)


def test_rows_above_the_largest_bin_are_refused_with_the_bin_named() -> None:
    step = cpu_step(compiled("tiny_k3"))
    rows = 9
    inputs = StepInputs(tokens=[1] * rows, positions=[0] * rows,
                        kda_state_indices=list(range(rows)),
                        block_tables=[[r] for r in range(rows)], seq_lens=[1] * rows,
                        slot_mapping=[r * BLOCK_SIZE for r in range(rows)])
    with pytest.raises(UserError, match=r"9 rows exceed the largest bin 8 .*--batches"):
        step.step(inputs)


def test_bad_inputs_are_one_line_errors() -> None:
    step = cpu_step(compiled("tiny_k3"))
    good = dict(tokens=[1, 2], positions=[0, 0], kda_state_indices=[0, 1],
                block_tables=[[0], [1]], seq_lens=[1, 1], slot_mapping=[0, BLOCK_SIZE])
    step.step(StepInputs(**good))
    for change, needle in (
        ({"tokens": [1, 999]}, "outside the vocabulary"),
        ({"seq_lens": [1, CONTEXT + 1]}, "exceed max_context"),
        ({"kda_state_indices": [0, 99]}, "outside the 8 state slots"),
        ({"block_tables": [[0] * 9, [1] * 9]}, "has 9 columns"),
        ({"slot_mapping": [0, 10**6]}, "outside the cache"),
        ({"seq_lens": [1]}, "expected 2"),
        ({"slot_mapping": None}, "slot_mapping is missing"),
    ):
        with pytest.raises(UserError, match=needle) as caught:
            step.step(StepInputs(**{**good, **change}))
        assert "\n" not in str(caught.value)


def test_two_input_blocks_taken_in_turn_decode_as_the_reference() -> None:
    """With two device blocks of input buffers (what a CUDA-graph load uses: each bin
    prepared once per block), the steps alternate between the blocks, and decoding matches
    the reference executor: a plan bound to the other block would read the step before's
    inputs."""
    graph = compiled("tiny_k3")
    step = cpu_step(graph, input_blocks=2)
    assert len(step.plan_sets) == 2
    for size in step.bins:  # each block its own plans (launches bound to its buffers)
        assert step.plan_sets[0][size] is not step.plan_sets[1][size]
    runner = CompiledDecodeRunner(step)
    seen = []
    original = step.replay

    def replay(size: int) -> None:
        seen.append(step.filler.current)
        original(size)

    step.replay = replay  # type: ignore[method-assign]
    got = run_prompts(runner, PROMPTS)
    want = run_prompts(reference_runner(graph, len(PROMPTS)), PROMPTS)
    assert worst_relative(got, want) < 1e-5
    assert len(seen) > 4 and seen == [i % 2 for i in range(len(seen))]
    with pytest.raises(UserError, match="input blocks"):
        cpu_step(graph, input_blocks=0)


def test_step_returns_a_copy_unless_told_otherwise() -> None:
    step = cpu_step(compiled("tiny_k3"))
    one = dict(positions=[0], kda_state_indices=[0], block_tables=[[0]], seq_lens=[1],
               slot_mapping=[0])
    kept = step.step(StepInputs(tokens=[1], **one))
    snapshot = kept.clone()
    view = step.step(StepInputs(tokens=[2], **one), clone=False)
    before = view.clone()
    step.step(StepInputs(tokens=[3], **one))
    assert not torch.equal(kept, before)  # different tokens, different logits
    assert not torch.equal(view, before)  # the view followed the next step
    assert torch.equal(kept, snapshot)  # the copy did not: two more steps left it as it was


def test_a_declining_provider_falls_back_and_says_why() -> None:
    step = cpu_step(compiled("tiny_kimi_linear"))  # a plain residual stream: adds
    node = next(n for n in step.graph if n.op == "add")
    ctx = BinContext(node, 2, {}, True, step.device, step.dtype, step.graph,
                     step.bindings.for_bin(2))

    def declines(ctx):
        raise NotImplementedError("no float32 here")

    def breaks(ctx):
        raise ValueError("a bug")

    registry = Registry()
    registry.add(ProviderEntry("add", "fancy", declines, ("cpu",)))
    registry.add(ProviderEntry("add", "broken", breaks, ("cpu",)))
    registry.add(ProviderEntry("add", "torch", torch_ops.add, ("cuda", "cpu")))
    _, choice = prepare_node(ctx, "fancy", ["fancy"], registry)
    assert (choice.wanted, choice.provider) == ("fancy", "torch")
    assert choice.reason == "fancy declined: no float32 here"
    _, choice = prepare_node(ctx, "fancy", ["fancy"], registry, allowed={"cublas"})
    assert choice.provider == "torch" and "excluded by providers=['cublas']" in choice.reason
    _, choice = prepare_node(ctx, "gpu_only", [], registry)
    assert choice.reason == "gpu_only is not registered for add"
    with pytest.raises(ValueError, match="a bug") as caught:
        prepare_node(ctx, "broken", [], registry)
    assert "while preparing node" in " ".join(caught.value.__notes__)


def test_touched_experts_read_from_the_launches_match_the_reference_routing() -> None:
    """The bench's count of touched experts (ids copied from the compiled step's launches as
    they run) equals the count from the reference executor's routing on the same inputs."""
    from stepgraph.bench.protocol import touched_experts
    from stepgraph.bench.ranks import touched_experts_of

    graph = compiled("tiny_k3")
    step = cpu_step(graph)
    rows = 4
    feed = {"tokens": np.array([3, 77, 150, 201], np.int32),
            "positions": np.zeros(rows, np.int32),
            "kda_state_indices": np.arange(rows, dtype=np.int32),
            "block_tables": np.arange(rows, dtype=np.int32)[:, None],
            "seq_lens": np.ones(rows, np.int32),
            "slot_mapping": (np.arange(rows) * BLOCK_SIZE).astype(np.int64)}
    step.filler.fill(StepInputs.from_feed(feed), rows)
    got = touched_experts_of(step, rows)
    weights = random_weights(graph, 0, dtype=torch.float32)
    caches = allocate_caches(graph, rows + 1, rows + 1, BLOCK_SIZE)
    reference = ReferenceExecutor(graph, weights, caches)
    reference.step({k: torch.from_numpy(v) for k, v in feed.items()}, keep_values=True)
    want = touched_experts(graph, reference.last_values, rows)
    assert got == want
    assert len(got) == 5 and all(1 <= n <= 8 for n in got.values())


def test_the_root_fork_is_enqueued_before_the_first_launch(monkeypatch) -> None:
    """A bin plan with ``root_fork`` forks its empty launch onto the side stream before any
    launch of the step and joins the side stream after the last; one without does not."""
    from stepgraph.runtime import capture

    events: list[str] = []
    monkeypatch.setattr(capture, "fork_empty", lambda device: events.append("root"))
    monkeypatch.setattr(capture, "join", lambda device: events.append("join"))
    launches = [lambda i=i: events.append(f"launch {i}") for i in range(3)]
    device = torch.device("cpu")
    capture.BinPlan(1, launches, [], device=device, root_fork=True).run_eager()
    assert events == ["root", "launch 0", "launch 1", "launch 2", "join"]
    events.clear()
    capture.BinPlan(1, launches, [], device=device).run_eager()
    assert events == ["launch 0", "launch 1", "launch 2", "join"]


def test_signal_flags_one_a_branch_where_the_reader_is_its_own() -> None:
    """A graph marked for signalled joins gets one zeroed int32 [2] flag per branch that has
    a reader of its own; a reader two branches join before keeps its graph joins (no
    flag); an unmarked graph gets none."""
    from stepgraph.runtime.capture import signal_flags

    graph = compiled("tiny_k3")
    graph.meta["streams"] = {"signal": True}
    side = {"a": "r1", "b": "r2", "c": "r2", "d": None}
    flags = signal_flags(graph, side, torch.device("cpu"))
    assert sorted(flags) == ["a"]
    assert flags["a"].dtype == torch.int32 and flags["a"].tolist() == [0, 0]
    graph.meta["streams"] = {"signal": False}
    assert signal_flags(graph, side, torch.device("cpu")) == {}


def test_a_branch_signals_only_where_its_reader_waits(monkeypatch) -> None:
    """The runtime's flag hand-over, wired on the CPU (forks run inline): where the reader's
    launch takes the flag, the branch's launch sets it after its own work and the reader
    carries no graph join; where the reader cannot wait (the torch provider), the branch
    sets no flag and the reader joins. Logits match the reference both ways."""
    from stepgraph.memory.liveness import side_branches
    from stepgraph.runtime import capture
    from stepgraph.runtime.providers.registry import REGISTRY, ProviderEntry, Registry

    graph = compiled("tiny_k3", target="h200")
    assert graph.meta["streams"]["signal"] and graph.meta["streams"]["side"]
    branches = len(graph.meta["streams"]["side"])
    events: list[str] = []
    monkeypatch.setattr(capture, "device_side_branches", lambda g, d: side_branches(g))
    monkeypatch.setattr(capture, "fork", lambda device, launch: (events.append("fork"),
                                                                 launch()))
    monkeypatch.setattr(capture, "fork_empty", lambda device: events.append("root"))
    monkeypatch.setattr(capture, "join", lambda device: events.append("join"))
    monkeypatch.setattr(capture, "signal", lambda flag: events.append("signal"))
    torch_norm = REGISTRY.get("attn_res_norm", "torch")

    def waiting(ctx):
        launch = torch_norm.factory(ctx)
        launch.awaits = ctx.wait_flag  # a launch that takes the flag says so
        return launch

    custom = Registry(dict(REGISTRY.entries))
    custom.add(ProviderEntry("attn_res_norm", "torch", waiting, ("cuda", "cpu")))
    want = run_prompts(reference_runner(graph, len(PROMPTS)), PROMPTS)
    for registry, signals, joins in ((custom, branches, 1), (REGISTRY, 0, branches + 1)):
        step = cpu_step(graph, registry=registry)
        events.clear()
        step.replay(step.bins[0])
        assert events.count("fork") == branches
        assert events.count("signal") == signals and events.count("join") == joins, events
        if signals:  # each branch sets its flag right after its own work, on its stream
            assert all(a == "fork" for a, b in itertools.pairwise(events) if b == "signal")
        got = run_prompts(CompiledDecodeRunner(step), PROMPTS)
        assert worst_relative(got, want) < 1e-5
