"""The KDA core against fla-core's naive torch references (``fla/ops/kda/naive.py``
``naive_recurrent_kda`` and ``fla/ops/kda/gate.py`` ``naive_kda_lowerbound_gate`` /
``naive_kda_gate``) and transformers' ``KimiLinearRMSNormGated`` for the output norm.

fla-core's package imports triton, which a CPU box lacks; the naive file needs only torch and
einops, so it is loaded on its own, and the two gate functions are read out of gate.py (whose
module imports triton) by their source. Nothing is re-implemented here: the conv is made the
identity (last tap 1) so the core's recurrence meets fla's directly."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("einops")
pytest.importorskip("transformers")
torch.set_num_threads(1)

import torch.nn.functional as F  # noqa: E402

from stepgraph.ir.nodes import Node  # noqa: E402
from stepgraph.lower.ref_common import OpCall  # noqa: E402
from stepgraph.lower.ref_kda import kda_core  # noqa: E402


def _fla_dir() -> Path:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install fla-core --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda"


def _fla_naive():
    folder = _fla_dir()
    spec = importlib.util.spec_from_file_location("fla_kda_naive", folder / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = (folder / "gate.py").read_text()
    tree = ast.parse(source)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name in ("naive_kda_gate", "naive_kda_lowerbound_gate")]
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(folder / "gate.py"), "exec"),
         namespace)
    return module.naive_recurrent_kda, namespace


HEADS, DIM, KERNEL, RANK, REQUESTS, STEPS = 2, 8, 4, 4, 3, 6
WIDTH = HEADS * DIM


def _core_inputs(generator: torch.Generator):
    def rnd(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=generator)

    per_step = [dict(q=rnd(REQUESTS, WIDTH), k=rnd(REQUESTS, WIDTH), v=rnd(REQUESTS, WIDTH),
                     g=rnd(REQUESTS, WIDTH), f_a=rnd(REQUESTS, RANK), b=rnd(REQUESTS, HEADS))
                for _ in range(STEPS)]
    identity_conv = torch.zeros(WIDTH, KERNEL)
    identity_conv[:, -1] = 1.0
    weights = dict(f_b=rnd(WIDTH, RANK, scale=0.5), dt_bias=rnd(WIDTH, scale=0.5),
                   a_log=torch.empty(HEADS).uniform_(1.0, 16.0, generator=generator).log(),
                   o_norm=1.0 + rnd(DIM, scale=0.1), conv=identity_conv)
    return per_step, weights


@pytest.mark.parametrize("form", ["lower_bound", "softplus"])
def test_kda_core_matches_fla_naive_recurrence(form) -> None:
    naive_recurrent_kda, gates = _fla_naive()
    per_step, w = _core_inputs(torch.Generator().manual_seed(3))
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    states = [torch.zeros(REQUESTS, HEADS, DIM, DIM)] + [
        torch.zeros(REQUESTS, WIDTH, KERNEL - 1) for _ in range(3)]
    node = Node("kda", "kda_core", (), ("out",), attrs=dict(
        heads=HEADS, head_dim=DIM, conv_kernel=KERNEL, gate_form=form,
        gate_lower_bound=-5.0 if form == "lower_bound" else None, output_gate="full",
        eps=1e-5, q=1))
    ours = []
    for x in per_step:
        ins = [x["q"], x["k"], x["v"], x["g"], x["f_a"], x["b"], w["conv"], w["conv"], w["conv"],
               w["f_b"], w["dt_bias"], w["a_log"], w["o_norm"], *states, slots]
        call = OpCall(node, ins, [], [torch.float32], torch.float32, REQUESTS)
        ours.append(kda_core(call)[0])

    from transformers.models.kimi_linear.modeling_kimi_linear import (
        KimiLinearRMSNormGated,
        l2norm,
    )

    def seq(key):  # [requests, steps, heads, dim]
        return torch.stack([x[key] for x in per_step], 1).view(REQUESTS, STEPS, HEADS, -1)

    q, k, v = (F.silu(seq(key)) for key in ("q", "k", "v"))
    f = torch.stack([F.linear(x["f_a"], w["f_b"]) for x in per_step], 1)
    f = f.view(REQUESTS, STEPS, HEADS, DIM)
    if form == "lower_bound":
        g = gates["naive_kda_lowerbound_gate"](f, w["a_log"], w["dt_bias"], lower_bound=-5.0)
    else:
        g = gates["naive_kda_gate"](f, w["a_log"], w["dt_bias"])
    beta = torch.sigmoid(seq("b")[..., 0])
    o, final = naive_recurrent_kda(l2norm(q), l2norm(k), v, g, beta, output_final_state=True)
    norm = KimiLinearRMSNormGated(DIM, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w["o_norm"])
        expected = norm(o, seq("g")).reshape(REQUESTS, STEPS, WIDTH)
    got = torch.stack(ours, 1)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
    assert torch.allclose(states[0][slots.long()], final, atol=1e-5, rtol=1e-5)
    # the other gate form is a different model: the comparison can fail
    other = gates["naive_kda_gate" if form == "lower_bound" else "naive_kda_lowerbound_gate"](
        f, w["a_log"], w["dt_bias"])
    o_other, _ = naive_recurrent_kda(l2norm(q), l2norm(k), v, other, beta)
    assert not torch.allclose(o_other, o, atol=1e-3)
