"""Reference KDA core (Kimi Delta Attention) for decode and verify steps.

Per token: a depthwise causal short conv (kernel K) + SiLU on q, k and v, with a conv state
holding the previous K-1 inputs; the per-channel log-space decay gate (``lower_bound``:
``lb * sigmoid(exp(A_log) * (f + dt_bias))``, ``softplus``: ``-exp(A_log) * softplus(f +
dt_bias)``, f = f_b(f_a(x))); L2-normalised q and k (``x / sqrt(sum x^2 + 1e-6)``), q scaled by
head_dim^-0.5; beta = sigmoid(b); the delta rule on a float32 state S [K, V] per head:
``S *= exp(g)``; ``S += k (beta (v - k^T S))^T``; ``o = q^T S``; then a per-head RMSNorm of o
times sigmoid of the output gate (full rank, or low rank g_b(g_a(x))).

States live in caller-owned slots. A decode step (q = 1) reads and writes row r's slot
``kda_state_indices[r]``. A verify step (q > 1) groups q consecutive rows per request: the
request starts from the state in the slot of its row ``num_accepted_tokens - 1`` (how many of
the previous step's tokens were accepted) and the state after its j-th token is written to
the slot of its row j, so the next step can resume after any accepted prefix. A negative slot
(a padded row) reads zeros and writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stepgraph.lower.ref_common import OpCall, linear

L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def decay_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, heads: int,
               form: str, lower_bound: float | None) -> torch.Tensor:
    """The log-space decay [R, heads, head_dim] (float32) of the gate form."""
    rows = f.shape[0]
    x = (f.float() + dt_bias.float()).view(rows, heads, -1)
    rate = torch.exp(a_log.float()).view(1, heads, 1)
    if form == "lower_bound":
        assert lower_bound is not None
        return lower_bound * torch.sigmoid(rate * x)
    softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return -rate * softplus


def _gather_slots(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``state`` at ``slots`` (zeros where a slot is negative), as a copy."""
    valid = slots >= 0
    picked = state[slots.clamp(min=0).long()].clone()
    picked[~valid] = 0
    return picked


def _scatter_slots(state: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    valid = slots >= 0
    if bool(valid.any()):
        state[slots[valid].long()] = values[valid].to(state.dtype)


def kda_token(conv_states: list[torch.Tensor], inputs: list[torch.Tensor],
              conv_weights: tuple[torch.Tensor, ...], state: torch.Tensor, gate: torch.Tensor,
              beta: torch.Tensor, heads: int, dim: int,
              act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every request: the short conv of q, k, v (``conv_states`` [n, W, K-1],
    replaced in the list by the advanced windows) + SiLU, L2-normalised q (scaled) and k, then
    the delta rule on the fp32 ``state`` [n, H, K, V] with ``gate`` [n, H, D] (log decay) and
    ``beta`` [n, H]. Returns (new state, output [n, H, V] in ``act_dtype``)."""
    requests, width = inputs[0].shape
    convolved = []
    for index in range(3):
        window = torch.cat([conv_states[index], inputs[index][:, :, None].to(
            conv_states[index].dtype)], dim=-1)  # [n, W, K]
        conv_states[index] = window[:, :, 1:]
        weight = conv_weights[index]
        y = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), None, groups=width)[..., -1]
        convolved.append(F.silu(y).to(act_dtype))
    qj = _l2norm(convolved[0].float().view(requests, heads, dim)) * dim**-0.5
    kj = _l2norm(convolved[1].float().view(requests, heads, dim))
    vj = convolved[2].float().view(requests, heads, dim)
    state = state * gate.exp()[..., None]
    memory = (state * kj[..., None]).sum(-2)
    delta = (vj - memory) * beta[..., None]
    state = state + kj[..., None] * delta[..., None, :]
    return state, (state * qj[..., None]).sum(-2).to(act_dtype)


def kda_core(call: OpCall) -> list[torch.Tensor]:
    """One decode or verify step of the KDA core (see the module docstring)."""
    a = call.attrs
    heads, dim, q_len = a["heads"], a["head_dim"], a.get("q", 1)
    low_rank = a["output_gate"] == "low_rank"
    ins = call.ins
    q_in, k_in, v_in, g_in, f_a, b = ins[:6]
    nweights = 8 if low_rank else 7
    q_conv, k_conv, v_conv, f_b, dt_bias, a_log, o_norm = ins[6:13]
    g_b = ins[13] if low_rank else None
    rec_state, q_state, k_state, v_state = ins[6 + nweights : 10 + nweights]
    meta = ins[10 + nweights :]
    slot_of_row = meta[0].long()
    rows = q_in.shape[0]
    width = heads * dim
    requests = rows // q_len
    act_dtype = q_in.dtype

    slots = slot_of_row.view(requests, q_len)
    if q_len > 1:
        accepted = meta[1].long().view(requests, q_len)[:, 0]
        start = slots.gather(1, (accepted - 1).clamp(0, q_len - 1)[:, None])[:, 0]
        start = torch.where(slots[:, 0] >= 0, start, slots[:, 0])
    else:
        start = slots[:, 0]

    f = linear(f_a, f_b, act_dtype)
    gate = decay_gate(f, dt_bias, a_log, heads, a["gate_form"], a.get("gate_lower_bound"))
    gate = gate.view(requests, q_len, heads, dim)
    beta = torch.sigmoid(b.float()).view(requests, q_len, heads)
    out_gate = g_in if not low_rank else linear(g_in, g_b, act_dtype)

    inputs = [x.view(requests, q_len, width) for x in (q_in, k_in, v_in)]
    weights = (q_conv, k_conv, v_conv)
    conv_states = [_gather_slots(s, start) for s in (q_state, k_state, v_state)]
    state = _gather_slots(rec_state, start).float()  # [n, H, K, V]
    outputs = []
    for j in range(q_len):
        state, token = kda_token(conv_states, [x[:, j] for x in inputs], weights, state,
                                 gate[:, j], beta[:, j], heads, dim, act_dtype)
        outputs.append(token)
        if q_len > 1 or j == q_len - 1:
            dest = slots[:, j]
            _scatter_slots(rec_state, dest, state)
            for cache, value in zip((q_state, k_state, v_state), conv_states, strict=True):
                _scatter_slots(cache, dest, value)

    o = torch.stack(outputs, dim=1).reshape(rows, heads, dim).float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + a["eps"]) * o_norm.float()
    o = o * torch.sigmoid(out_gate.float().view(rows, heads, dim))
    return [o.reshape(rows, width).to(call.out_dtypes[0])]
