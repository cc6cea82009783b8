"""The deployments the shard pass refuses, each with a one-line message that names the numbers.

Checked before any rewriting, in this order: the parallelism combination (DEP with TP, DCP
without or unequal to TP, DCP on a model with no latent cache, DCP over DSA layers), then
every size TP splits (attention heads of each kind used, MLP widths, expert count, latent
width, vocabulary), then the expert count DEP splits.
"""

from __future__ import annotations

from math import gcd
from typing import NoReturn

from stepgraph.passes.manager import PassError
from stepgraph.spec import Deployment, Model

PASS = "shard"


def _refuse(message: str) -> NoReturn:
    raise PassError(PASS, message)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: list[int], limit: int = 12) -> str:
    text = ", ".join(str(v) for v in values[:limit])
    return text + (", ..." if len(values) > limit else "")


def tp_constraints(model: Model) -> list[tuple[str, int]]:
    """(what, size) of every size tensor parallelism splits, in the order they are checked.

    Attention heads of each kind a layer uses (KDA heads split q/k/v/g/b, conv, f_b, states;
    MLA/DSA heads split q_b/kv_b/gate and the query), the dense MLP and shared-expert widths
    (column-parallel gate|up, row-parallel down), the routed experts (split whole over the TP
    ranks), the latent MoE width (column-parallel down, row-parallel up) and the vocabulary
    (vocab-parallel embedding and lm_head). KDA's f_a / low-rank g_a, MLA's q_a / kv_a and the
    DSA indexer stay replicated and constrain nothing.
    """
    kinds = model.layer_list()
    used_attention = {k.attention for k in kinds}
    used_mlp = {k.mlp for k in kinds}
    out: list[tuple[str, int]] = []
    for kind in ("kda", "mla", "dsa"):
        spec = getattr(model.attention, kind)
        if kind in used_attention and spec is not None:
            out.append((f"{kind.upper()} heads", spec.heads))
    if "dense" in used_mlp and model.mlp.dense is not None:
        out.append(("dense MLP intermediate size", model.mlp.dense.intermediate_size))
    moe = model.mlp.moe
    if "moe" in used_mlp and moe is not None:
        out.append(("routed experts", moe.experts))
        if moe.shared_width:
            out.append(("shared expert width", moe.shared_width))
        if moe.latent is not None:
            out.append(("latent MoE width", moe.latent.width))
    out.append(("vocabulary rows", model.vocab_size))
    return out


def allowed_tp(model: Model) -> list[int]:
    """Every tp that divides all of :func:`tp_constraints` (the divisors of their gcd)."""
    common = 0
    for _, size in tp_constraints(model):
        common = gcd(common, size)
    return _divisors(common)


def check_deployment(model: Model, deployment: Deployment) -> None:
    """Raise :class:`PassError` (one line) if ``deployment`` cannot serve ``model``."""
    tp, dcp, dep = deployment.tp, deployment.dcp, deployment.dep
    kinds = model.layer_list()
    attention = {k.attention for k in kinds}
    if dep > 1 and tp > 1:
        _refuse(
            f"dep={dep} with tp={tp}: DEP runs the attention at TP1 on each rank's own requests "
            f"and splits only the experts; use tp=1 with dep={dep}, or dep=1 with tp={tp}")
    if dcp > 1 and tp == 1:
        _refuse(
            f"dcp={dcp} without tp: the DCP group is the TP group (each rank gathers the "
            f"query heads of its TP peers and merges their partials by LSE), so dcp needs "
            f"tp={dcp}")
    if dcp > 1 and dcp != tp:
        _refuse(
            f"dcp={dcp} with tp={tp}: dcp must equal tp (the DCP group is the TP group: the "
            f"query gather and the LSE merge exchange the TP ranks' heads); use dcp={tp} or "
            f"dcp=1")
    if dcp > 1 and not attention & {"mla", "dsa"}:
        _refuse(
            f"dcp={dcp}: {model.name} has no MLA or DSA layer, so there is no latent cache to "
            f"shard along tokens; use dcp=1")
    if dcp > 1 and "dsa" in attention:
        layers = [i for i, k in enumerate(kinds) if k.attention == "dsa"]
        _refuse(
            f"dcp={dcp} with {len(layers)} DSA layers (first: {layers[0]}): the indexer picks "
            f"the top-k over all cached tokens, which a token-sharded cache spreads over the "
            f"ranks, and the IR has no global top-k exchange; use dcp=1 for DSA models")
    if tp > 1:
        allowed = allowed_tp(model)
        for what, size in tp_constraints(model):
            if size % tp:
                _refuse(
                    f"tp={tp} does not divide the {size} {what} (tp must divide {size}; "
                    f"every split of {model.name} allows tp = {_listing(allowed)})")
    if dep > 1:
        moe = model.mlp.moe
        if moe is None or "moe" not in {k.mlp for k in kinds}:
            _refuse(
                f"dep={dep}: {model.name} has no MoE layer, so there are no experts to split "
                f"over EP ranks; use tp instead")
        experts = moe.experts
        if dep > experts:
            _refuse(
                f"dep={dep} is more EP ranks than the {experts} routed experts (each rank "
                f"holds whole experts; use a dep that divides {experts}: "
                f"{_listing(_divisors(experts))})")
        if experts % dep:
            _refuse(
                f"dep={dep} does not divide the {experts} routed experts (every EP rank holds "
                f"the same number of whole experts; use a dep that divides {experts}: "
                f"{_listing(_divisors(experts))})")
