"""Sharded + packed graphs compute what the unsharded step computes.

Every rank of a TP / DCP / DEP plan runs in lockstep on the reference executor's ops
(stepgraph.lower.ref_*); the collectives are simulated here from their IR meaning
(all_reduce: sum, all_gather: concatenate, reduce_scatter: sum then this rank's columns,
dcp_gather: concatenate heads, lse_merge: log-sum-exp merge of the partials onto the
rank's heads, ep_dispatch / ep_combine: every row to every rank and back), as are the two
sharded compute forms the shard pass introduces (the vocab-parallel embedding and the
sharded latent RMSNorm). The expected logits come from the frontend's TP1 graph, run by
the same reference ops on the same random weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stepgraph.frontend import build_step  # noqa: E402
from stepgraph.ir.graph import Graph  # noqa: E402
from stepgraph.ir.types import eval_dim  # noqa: E402
from stepgraph.lower.caches import allocate_caches  # noqa: E402
from stepgraph.lower.ref_common import OpCall  # noqa: E402
from stepgraph.lower.reference import REFERENCE_OPS  # noqa: E402
from stepgraph.lower.tensors import read_view, storage_dtype, write_view  # noqa: E402
from stepgraph.lower.weights import RandomWeights, materialize  # noqa: E402
from stepgraph.passes.manager import CompileContext, run_pipeline  # noqa: E402
from stepgraph.passes.pack import Pack  # noqa: E402
from stepgraph.passes.shard import Shard  # noqa: E402
from stepgraph.runtime.loader import rank_graph  # noqa: E402
from stepgraph.spec import Deployment  # noqa: E402
from stepgraph.spec_loader import load_spec  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
BLOCK = 4
BLOCKS = 4  # per request
STEPS = 5
F32 = torch.float32


class Ranks:
    """``ranks`` copies of a plan run in lockstep, each with its weights and caches."""

    def __init__(self, graph: Graph, ranks: int, requests: int) -> None:
        self.g, self.n = graph, ranks
        self.rank_nodes = [{n.name: n for n in rank_graph(graph, r)} for r in range(ranks)]
        self.fixed = []
        for rank in range(ranks):
            weights = materialize(graph, RandomWeights(7), rank=rank, dtype=F32)
            caches = allocate_caches(graph, requests, requests * BLOCKS, BLOCK, dtype=F32)
            self.fixed.append({**weights, **caches})

    def read(self, env: dict, name: str) -> torch.Tensor:
        value = self.g.values[name]
        if value.view is None:
            return env[name]
        return read_view(self.read(env, value.view.base), value.view)

    def write(self, env: dict, name: str, tensor: torch.Tensor, rows: int) -> None:
        value = self.g.values[name]
        if value.view is None:
            env[name] = tensor
            return
        base = self.g.values[value.view.base]
        if base.name not in env:
            shape = tuple(eval_dim(d, rows) for d in base.type.shape)
            env[base.name] = torch.zeros(shape, dtype=storage_dtype(base.type.dtype, F32))
        write_view(env[base.name], value.view, tensor)

    def step(self, inputs: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """One step; ``inputs[r]`` is rank r's step metadata; returns every rank's logits."""
        n, g = self.n, self.g
        envs = [{**self.fixed[r], **{k: torch.as_tensor(v) for k, v in inputs[r].items()}}
                for r in range(n)]
        rows = len(inputs[0]["tokens"])
        for node in g:
            ins = [[self.read(envs[r], name) for name in node.inputs] for r in range(n)]
            outs = [g.values[name] for name in node.outputs]
            dtypes = [storage_dtype(v.type.dtype, F32) for v in outs]
            results = _collective(node, ins, rows, n)
            if results is None:
                results = []
                for r in range(n):
                    call = OpCall(self.rank_nodes[r][node.name], ins[r],
                                  [v.type for v in outs], dtypes, F32, rows)
                    results.append(REFERENCE_OPS[node.op](call))
            for r in range(n):
                for value, tensor, dtype in zip(outs, results[r], dtypes, strict=True):
                    self.write(envs[r], value.name, tensor.to(dtype), rows)
        return [self.read(envs[r], "logits") for r in range(n)]


def _collective(node, ins: list[list[torch.Tensor]], rows: int, n: int):
    """Every rank's outputs of a collective or sharded compute node; None for the rest."""
    op, attrs = node.op, node.attrs
    if op == "all_reduce":
        total = sum(x[0].float() for x in ins)
        return [[total]] * n
    if op == "all_gather":
        return [[torch.cat([x[0] for x in ins], -1)]] * n
    if op == "reduce_scatter":
        total = sum(x[0].float() for x in ins)
        return [[total.chunk(n, -1)[r]] for r in range(n)]
    if op == "dcp_gather":
        return [[torch.cat([x[0] for x in ins], 1)]] * n
    if op == "lse_merge":
        o = torch.stack([x[0].float() for x in ins])
        lse = torch.stack([x[1].float() for x in ins])
        weight = torch.exp(lse - torch.logsumexp(lse, 0)).nan_to_num(0.0)
        merged = (weight[..., None] * o).sum(0)
        heads = merged.shape[1] // n
        return [[merged[:, r * heads:(r + 1) * heads]] for r in range(n)]
    if op == "ep_dispatch":
        sent = [torch.cat([x[i] for x in ins]) for i in range(3)]
        return [sent] * n
    if op == "ep_combine":
        return [[sum(x[0][r * rows:(r + 1) * rows].float() for x in ins)] for r in range(n)]
    if op == "embed" and "vocab_split" in attrs:
        part = attrs["vocab_split"]["rows"]
        out = []
        for r, (tokens, table) in enumerate(ins):
            local = tokens.long() - r * part
            inside = (local >= 0) & (local < part)
            out.append([table[local.clamp(0, part - 1)] * inside[:, None]])
        return out
    if op == "rmsnorm" and "group" in attrs:
        width = sum(x[0].shape[-1] for x in ins)
        mean_square = sum(x[0].float().pow(2).sum(-1, keepdim=True) for x in ins) / width
        scale = torch.rsqrt(mean_square + attrs["eps"])
        return [[x[0].float() * scale * x[1].float()] for x in ins]
    return None


def _inputs(prompts: list[list[int]], t: int, rank: int = 0, dcp: int = 1
            ) -> dict[str, np.ndarray]:
    """Step t's metadata; with DCP, token p lives on rank p % dcp at local index p // dcp."""
    rank %= dcp
    count = len(prompts)
    d = {
        "tokens": np.array([p[t] for p in prompts], np.int32),
        "positions": np.full(count, t, np.int32),
        "kda_state_indices": np.arange(count, dtype=np.int32),
        "block_tables": np.stack([np.arange(BLOCKS, dtype=np.int32) + i * BLOCKS
                                  for i in range(count)]),
        "seq_lens": np.zeros(count, np.int32),
        "slot_mapping": np.full(count, -1, np.int64),
    }
    for i in range(count):
        if t >= rank:
            d["seq_lens"][i] = (t - rank) // dcp + 1
        if t % dcp == rank:
            d["slot_mapping"][i] = i * BLOCKS * BLOCK + t // dcp
    return d


def _prompts(seed: int, count: int) -> list[list[int]]:
    return [[(31 * seed + 17 * i + 7 * t * (i + 1)) % 256 for t in range(STEPS)]
            for i in range(count)]


@pytest.mark.parametrize(("model", "deployment"), [
    ("tiny_k3", {"tp": 2}),
    ("tiny_k3", {"tp": 2, "dcp": 2}),
    ("tiny_k3", {"dep": 2}),
    ("tiny_kimi_linear", {"tp": 4}),
])
def test_sharded_plan_matches_tp1(model: str, deployment: dict[str, int]) -> None:
    torch.set_num_threads(1)
    s = load_spec(MODELS / f"{model}.yaml")
    base = Deployment(batches=(1, 2, 4, 8))
    d = Deployment(batches=(1, 2, 4, 8), **deployment)
    plan, _ = run_pipeline(build_step(s.model, d), [Shard(), Pack()],
                           CompileContext(s.model, d))
    dep, dcp = d.dep, d.dcp
    n = max(d.tp, dep)
    per_rank = [_prompts(r if dep > 1 else 0, 2) for r in range(n)]
    everyone = [p for r in range(n) for p in per_rank[r]] if dep > 1 else per_rank[0]
    reference = Ranks(build_step(s.model, base), 1, len(everyone))
    ranks = Ranks(plan, n, 2)
    worst = 0.0
    for t in range(STEPS):
        got = ranks.step([_inputs(per_rank[r], t, r, dcp) for r in range(n)])
        full = reference.step([_inputs(everyone, t)])[0]
        for r in range(n):
            want = full[2 * r:2 * r + 2] if dep > 1 else full
            worst = max(worst, float((got[r] - want).abs().max()))
        assert float(full.abs().max()) > 0.1  # the logits are not trivially zero
    assert worst < 1e-3
