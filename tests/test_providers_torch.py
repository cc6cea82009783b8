"""The torch baseline providers (``torch``, ``cublas``) against the reference op functions,
node by node, on fresh random inputs: outputs poisoned with NaN before the launch, states
compared after it (the scratch slot / block excluded), padded rows included.

The harness (:func:`node_case`, :func:`run_provider`, :func:`check_node`) works for any
provider: ``check_node(graph, node, rows, provider, device, dtype)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from conftest import MODELS  # noqa: E402

from stepgraph.compiler import compile_graph  # noqa: E402
from stepgraph.errors import UserError  # noqa: E402
from stepgraph.ir.graph import Graph  # noqa: E402
from stepgraph.ir.nodes import Node  # noqa: E402
from stepgraph.ir.types import Storage, eval_dim  # noqa: E402
from stepgraph.lower.ref_common import OpCall  # noqa: E402
from stepgraph.lower.reference import REFERENCE_OPS  # noqa: E402
from stepgraph.lower.tensors import read_view, storage_dtype, torch_dtype  # noqa: E402
from stepgraph.lower.weights import random_weights  # noqa: E402
from stepgraph.runtime.capture import BinContext  # noqa: E402
from stepgraph.runtime.providers import REGISTRY, load_providers  # noqa: E402
from stepgraph.runtime.providers.torch_ops import MULTI_RANK, check_one_rank  # noqa: E402
from stepgraph.spec_loader import load_spec, override_deployment, parse_spec_text  # noqa: E402

load_providers()

BLOCK_SIZE = 4
WIDTH = 4  # blocks per row's table
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------- specs


def tiny_dsa_text(rope: bool = True) -> str:
    """tiny_k3 with DSA (a 4-token top-k) in place of MLA, and rope when ``rope``."""
    text = (MODELS / "tiny_k3.yaml").read_text()
    text = text.replace("    mla:\n", "    dsa:\n").replace("attention: mla}", "attention: dsa}")
    text = text.replace("      output_gate: {kind: full}\n  mlp:",
                        "      output_gate: {kind: full}\n"
                        "      indexer: {heads: 2, head_dim: 16, top_k: 4}\n  mlp:")
    if rope:
        text = text.replace("rope: null", "rope: {theta: 10000.0}")
    return text


def compiled(name: str, q: int = 1, rope: bool = False, target: str = "cpu") -> Graph:
    """A tiny spec compiled at TP1 (``name`` "tiny_dsa" is :func:`tiny_dsa_text`)."""
    if name == "tiny_dsa":
        spec = parse_spec_text(tiny_dsa_text(rope))
    else:
        text = (MODELS / f"{name}.yaml").read_text()
        if rope:
            text = text.replace("rope: null", "rope: {theta: 10000.0}")
        spec = parse_spec_text(text)
    batches = tuple(b * q for b in (1, 2, 4))
    deployment = override_deployment(spec.deployment, q=q, batches=batches, target=target)
    graph, _ = compile_graph(spec, deployment)
    return graph


# ---------------------------------------------------------------------- harness


@dataclass
class Case:
    """One node's random inputs (float values in float32, on CPU) at ``rows`` rows."""

    graph: Graph
    node: Node
    rows: int
    values: dict[str, torch.Tensor]  # every input name and every view base, and states
    symbols: dict[str, int]


def _request_layout(rows: int, q: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Step metadata of rows grouped by request (q rows each), the last request padding."""
    requests = rows // q
    slots = torch.randperm(requests * q + 2, generator=gen)[: requests * q].view(requests, q)
    blocks = torch.randperm(requests * WIDTH + 2, generator=gen)[: requests * WIDTH]
    blocks = blocks.view(requests, WIDTH)
    context = torch.randint(0, WIDTH * BLOCK_SIZE - q + 1, (requests,), generator=gen)
    positions = context[:, None] + torch.arange(q)[None, :]  # [n, q]
    seq_lens = positions + 1
    slot_mapping = (blocks.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE
                    + positions % BLOCK_SIZE)
    accepted = torch.randint(1, q + 1, (requests,), generator=gen)[:, None].expand(requests, q)
    tables = blocks[:, None, :].expand(requests, q, WIDTH)
    out = {
        "kda_state_indices": slots.reshape(-1).clone(),
        "block_tables": tables.reshape(rows, WIDTH).clone(),
        "seq_lens": seq_lens.reshape(-1).clone(),
        "slot_mapping": slot_mapping.reshape(-1).clone(),
        "positions": positions.reshape(-1).clone(),
        "num_accepted_tokens": accepted.reshape(-1).clone(),
    }
    if requests > 1:  # the last request is padding
        pad = slice((requests - 1) * q, rows)
        out["kda_state_indices"][pad] = -1
        out["block_tables"][pad] = 0
        out["seq_lens"][pad] = 0
        out["slot_mapping"][pad] = -1
        out["positions"][pad] = 0
        out["num_accepted_tokens"][pad] = 1
    return out


_WEIGHTS: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def _weights(graph: Graph, seed: int) -> dict[str, torch.Tensor]:
    key = (id(graph), seed)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = random_weights(graph, seed, dtype=torch.float32)
    return _WEIGHTS[key]


def node_case(graph: Graph, node: Node, rows: int, seed: int = 0) -> Case:
    """Fresh random inputs and states for ``node`` at ``rows`` rows (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = int(graph.meta.get("deployment", {}).get("q", 1))
    requests = rows // q
    symbols = {"S": requests * q + 3, "NB": requests * WIDTH + 3, "BS": BLOCK_SIZE, "T": WIDTH}
    layout = _request_layout(rows, q, gen)
    weights = _weights(graph, seed)
    values: dict[str, torch.Tensor] = {}
    names = list(node.inputs)
    for name in names:
        value = graph.values[name]
        while value.view is not None:
            names.append(value.view.base)
            value = graph.values[value.view.base]
    for name in dict.fromkeys(names):
        value = graph.values[name]
        if value.view is not None:
            continue
        shape = tuple(eval_dim(d, rows, symbols) for d in value.type.shape)
        dtype = torch_dtype(value.type.dtype)
        if value.storage is Storage.WEIGHT:
            values[name] = weights[name]
        elif value.storage is Storage.INPUT:
            if name == "tokens":
                vocab = int(graph.values["embed_tokens"].type.shape[0])
                values[name] = torch.randint(0, vocab, shape, generator=gen)
            else:
                values[name] = layout[name]
            values[name] = values[name].to(dtype)
        elif name.endswith("topk_ids"):
            experts = node.attrs["local_experts"]
            ids = torch.stack([torch.randperm(experts, generator=gen)[: shape[1]]
                               for _ in range(shape[0])])
            values[name] = ids.to(torch.int32)
        elif name.endswith("topk_weights"):
            values[name] = torch.rand(shape, generator=gen) + 0.05
        elif value.storage is Storage.STATE and name.endswith("recurrent_state"):
            values[name] = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith(("index_q", "indexer.k_cache", "index_weights")):
            # DSA indexer scores relu(q.k): positive queries, keys and head weights keep the
            # scores of cached tokens off relu's zero, where top-k would break ties by chance
            values[name] = torch.rand(shape, generator=gen) + 0.1
        else:
            values[name] = torch.randn(shape, generator=gen)
    return Case(graph, node, rows, values, symbols)


def _read(case: Case, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    value = case.graph.values[name]
    if value.view is None:
        return tensors[name]
    return read_view(_read(case, tensors, value.view.base), value.view)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7, dtype=dtype, device=device)


def run_provider(case: Case, provider: str, device: torch.device, dtype: torch.dtype,
                 tactic: dict | None = None, pdl: bool = False
                 ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run ``provider`` on the case (values cast to their run dtypes on ``device``, outputs
    poisoned); returns (outputs, states after, the inputs as given: on CPU, activations and
    weights in float32, states in their run dtype)."""
    graph, node = case.graph, case.node
    held = {name: t.to(device=device, dtype=storage_dtype(graph.values[name].type.dtype, dtype))
            for name, t in case.values.items()}
    given = {}  # what the reference reads: activations in float32, states as held (so
    for name, t in held.items():  # both sides round what they store in a cache alike)
        state = graph.values[name].storage is Storage.STATE
        given[name] = (t.float() if t.is_floating_point() and not state else t).cpu().clone()
    bound = {name: _read(case, held, name) for name in node.inputs}
    for name in node.outputs:
        value = graph.values[name]
        shape = tuple(eval_dim(d, case.rows, case.symbols) for d in value.type.shape)
        bound[name] = _poisoned(shape, storage_dtype(value.type.dtype, dtype), device)
    ctx = BinContext(node, case.rows, tactic or {}, pdl, device, dtype, graph, bound)
    entry = REGISTRY.get(node.op, provider)
    assert entry is not None, f"provider {provider} of {node.op} is not registered"
    launch = entry.factory(ctx)
    launch()
    if device.type == "cuda":
        torch.cuda.synchronize()
    outs = [bound[name].cpu() for name in node.outputs]
    states = {name: held[name].cpu() for name in node.updates}
    return outs, states, given


def run_reference(case: Case, given: dict[str, torch.Tensor]
                  ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The reference op computing in float32 on CPU over ``given`` (states, in their run
    dtype, updated on copies)."""
    graph, node = case.graph, case.node
    tensors = {name: t.clone() for name, t in given.items()}
    ins = [_read(case, tensors, name) for name in node.inputs]
    out_values = [graph.values[name] for name in node.outputs]
    call = OpCall(node=node, ins=ins, out_types=[v.type for v in out_values],
                  out_dtypes=[storage_dtype(v.type.dtype, torch.float32) for v in out_values],
                  compute=torch.float32, rows=case.rows)
    outs = REFERENCE_OPS[node.op](call)
    return outs, {name: tensors[name] for name in node.updates}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out has a NaN)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _real_part(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A state without its scratch slot / block (the last)."""
    return tensor[:-1]


def check_node(graph: Graph, node: Node, rows: int, provider: str, device: torch.device,
               dtype: torch.dtype, tol: float, seed: int = 0, pdl: bool = False) -> float:
    """Run ``provider`` on ``node`` (with the plan's tactic of the bin holding ``rows`` when
    the plan chose this provider there) and the reference on the same inputs; assert every
    output and state is within ``tol`` relative error (and every output written); returns
    the worst error."""
    case = node_case(graph, node, rows, seed)
    outs, states, given = run_provider(case, provider, device, dtype,
                                       plan_tactic(graph, node, rows, provider), pdl)
    refs, ref_states = run_reference(case, given)
    where = (f"{provider} {node.op} {node.name} rows={rows} {dtype} on {device}; inputs "
             + ", ".join(f"{n}{list(case.values[n].shape)}" for n in node.inputs
                         if n in case.values))
    worst = 0.0
    for name, out, ref in zip(node.outputs, outs, refs, strict=True):
        assert out.shape == ref.shape, f"{where}: {name} {list(out.shape)} vs {list(ref.shape)}"
        if not ref.is_floating_point():
            assert (out != -7).all(), f"{where}: {name} has unwritten elements"
            if node.op == "router":  # top-k order is free: compare the sets
                out, ref = out.sort(-1).values, ref.sort(-1).values
            assert torch.equal(out.long(), ref.long()), f"{where}: {name} differs:\n{out}\n{ref}"
            continue
        if node.op == "router":  # weights follow their ids' order
            ids_out, ids_ref = outs[0].long(), refs[0].long()
            out = out.gather(1, ids_out.argsort(-1))
            ref = ref.gather(1, ids_ref.argsort(-1))
        err = relative_error(out, ref)
        assert err < tol, f"{where}: output {name} relative error {err:.3e} >= {tol}"
        worst = max(worst, err)
    for name in node.updates:
        out, ref = _real_part(name, states[name]), _real_part(name, ref_states[name])
        err = relative_error(out, ref)
        assert err < tol, f"{where}: state {name} relative error {err:.3e} >= {tol}"
        worst = max(worst, err)
    return worst


def plan_tactic(graph: Graph, node: Node, rows: int, provider: str) -> dict:
    """The bin pass's tactic for ``node`` at the smallest bin holding ``rows`` (the largest
    bin past the end) when it chose ``provider`` there, else {}."""
    per_bin = graph.meta.get("decisions", {}).get(node.name, {})
    if not per_bin:
        return {}
    bins = sorted(int(b) for b in per_bin)
    size = next((b for b in bins if b >= rows), bins[-1])
    chosen = per_bin[str(size)]
    return dict(chosen.get("tactic") or {}) if chosen.get("provider") == provider else {}


def nodes_by_op(graph: Graph) -> dict[str, Node]:
    """The first node of each op."""
    found: dict[str, Node] = {}
    for node in graph:
        found.setdefault(node.op, node)
    return found


VARIANTS = (("tiny_k3", 1, False), ("tiny_kimi_linear", 1, True), ("tiny_dsa", 1, True),
            ("tiny_k3", 2, False), ("tiny_dsa", 2, False))


def _cases(baseline: bool = True) -> list[tuple[str, int, bool, str, str]]:
    """(model, q, rope, op, provider) for every op of the tiny graphs and its providers:
    the torch baseline's (``baseline``) or every other registered one."""
    cases = []
    for model, q, rope in VARIANTS:
        for op in nodes_by_op(_graph(model, q, rope)):
            names = ("torch", "cublas") if baseline else [
                p for p in REGISTRY.providers_of(op) if p not in ("torch", "cublas")]
            for provider in names:
                if REGISTRY.get(op, provider) is not None:
                    cases.append((model, q, rope, op, provider))
    return cases


_GRAPHS: dict[tuple[str, int, bool], Graph] = {}


def _graph(model: str, q: int, rope: bool) -> Graph:
    key = (model, q, rope)
    if key not in _GRAPHS:
        _GRAPHS[key] = compiled(model, q, rope)
    return _GRAPHS[key]


CASES = _cases()
OTHER_CASES = _cases(baseline=False)


def _id(case: tuple[str, int, bool, str, str]) -> str:
    model, q, rope, op, provider = case
    return f"{model}-q{q}{'-rope' if rope else ''}-{op}-{provider}"


# ---------------------------------------------------------------------- tests


def test_every_op_of_the_tiny_graphs_has_a_torch_provider_on_both_devices() -> None:
    ops = {op for model, q, rope, op, _ in CASES}
    assert {"kda_core", "mla_core", "dsa_core", "routed_experts", "router", "mla_query",
            "attn_res_norm", "lm_head"} <= ops
    for op in ops | {"attn_res_mix", "add"}:  # the unfused AttnRes ops (--no-fuse)
        entry = REGISTRY.get(op, "torch")
        assert entry is not None and set(entry.devices) == {"cuda", "cpu"}, op


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_provider_matches_the_reference_on_cpu(case) -> None:
    model, q, rope, op, provider = case
    graph = _graph(model, q, rope)
    node = nodes_by_op(graph)[op]
    for rows, seed in ((3 * q, 1), (5 * q, 2)):
        check_node(graph, node, rows, provider, torch.device("cpu"), torch.float32, 1e-5, seed)


def test_the_check_can_fail() -> None:
    """A provider that gets the math wrong (or leaves an output unwritten) is caught."""
    graph = _graph("tiny_k3", 1, False)
    node = nodes_by_op(graph)["projection"]
    case = node_case(graph, node, 3)
    outs, _, given = run_provider(case, "torch", torch.device("cpu"), torch.float32)
    refs, _ = run_reference(case, given)
    assert relative_error(outs[0], refs[0]) < 1e-6
    assert relative_error(outs[0] * 1.01, refs[0]) > 5e-3
    outs[0][1, 3] = float("nan")
    assert relative_error(outs[0], refs[0]) == float("inf")


def test_kda_scratch_slot_reads_zeros_and_real_slots_are_untouched_by_padding() -> None:
    graph = _graph("tiny_k3", 1, False)
    node = nodes_by_op(graph)["kda_core"]
    case = node_case(graph, node, 4, seed=3)
    state = node.updates[0]
    before = case.values[state].clone()
    _, states, given = run_provider(case, "torch", torch.device("cpu"), torch.float32)
    used = given["kda_state_indices"].long()
    real = used[used >= 0]
    untouched = [s for s in range(before.shape[0] - 1) if s not in set(real.tolist())]
    assert torch.equal(states[state][untouched], before[untouched])
    assert not torch.equal(states[state][real], before[real])


def test_multi_rank_nodes_are_refused() -> None:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    graph, _ = compile_graph(spec, override_deployment(spec.deployment, tp=2, target="cpu"))
    sharded = [n for n in graph if n.attrs.get("ways", 1) > 1]
    assert sharded
    with pytest.raises(UserError, match=r"over 2 ranks\): the torch provider runs it on one "
                                        r"rank only"):
        check_one_rank(sharded[0])
    assert "collectives module" in MULTI_RANK


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_provider_matches_the_reference_on_gpu_in_bf16(case) -> None:
    model, q, rope, op, provider = case
    graph = _graph(model, q, rope)
    node = nodes_by_op(graph)[op]
    for rows, seed in ((3 * q, 1), (8 * q, 2)):
        check_node(graph, node, rows, provider, torch.device("cuda"), torch.bfloat16, 1e-2,
                   seed)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", OTHER_CASES, ids=_id)
def test_every_other_registered_provider_matches_the_reference_on_gpu(case) -> None:
    """The same harness over the Triton / fla providers, bound as the runtime binds them
    (packed outputs' column views included), with PDL on. A provider that declines the
    node (NotImplementedError: the runtime falls back) is skipped with its reason."""
    model, q, rope, op, provider = case
    graph = _graph(model, q, rope)
    node = nodes_by_op(graph)[op]
    for rows, seed in ((3 * q, 1), (8 * q, 2)):
        try:
            check_node(graph, node, rows, provider, torch.device("cuda"), torch.bfloat16,
                       1e-2, seed, pdl=True)
        except NotImplementedError as why:
            pytest.skip(f"{provider} declines {node.name}: {why}")
