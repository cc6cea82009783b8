"""The GPU benchmark workloads of shared/BENCHMARKS.md as specs in ``models/``.

* **k3-slice-tp1** (``models/k3_slice_tp1.yaml``): K3 at real dimensions, TP1 attention,
  K3's layers 1..4, 64 routed experts, top-16, MLA context 4096, rows 1, 4, 16, 64.
* **k3-rank-tp8** (``models/k3_rank_tp8.yaml``): **one rank's compute** of K3 at TP8, K3's
  layers 1..12, as a TP1 spec whose shapes are a TP8 rank's (12 heads, 112 local experts,
  ...), collectives removed; rows 1..64. Its YAML says how it mirrors a rank and where a
  TP1 spec cannot (the MoE's latent front and back are whole, not 1/8).

* **k3-tp2** (``models/k3_tp2.yaml``): k3-slice-tp1's model at TP2 (two GPUs, real NCCL
  collectives; 64 experts, 32 a rank).

The YAML files document their AttnRes block-boundary choice. :func:`k3_prefix_spec` builds
the K3 spec cut to its first layers (with optional experts / tp), which the tests compile to
check the workloads' shapes against what K3 itself compiles to. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stepgraph.spec import Spec

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: its spec file, what the tables call it, its MLA context and
    row bins, and the K3 layers (0-based, inclusive) its layers stand for."""

    name: str
    spec: str
    model: str
    label: str
    context: int
    batches: tuple[int, ...]
    k3_layers: tuple[int, int]

    @property
    def spec_path(self) -> Path:
        """The spec file in the repository."""
        return ROOT / self.spec


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="k3-slice-tp1",
            spec="models/k3_slice_tp1.yaml",
            model="k3_slice_tp1",
            label="k3-slice-tp1: K3 layers 1..4 at real dimensions, TP1 attention, 64 experts",
            context=4096,
            batches=(1, 4, 16, 64),
            k3_layers=(1, 4),
        ),
        Workload(
            name="k3-rank-tp8",
            spec="models/k3_rank_tp8.yaml",
            model="k3_rank_tp8",
            label=("k3-rank-tp8: ONE RANK'S COMPUTE of K3 at TP8 (collectives removed), "
                   "K3 layers 1..12"),
            context=4096,
            batches=(1, 2, 4, 8, 16, 32, 64),
            k3_layers=(1, 12),
        ),
        Workload(
            name="k3-tp2",
            spec="models/k3_tp2.yaml",
            model="k3_tp2",
            label=("k3-tp2: K3 layers 1..4 at TP2 (48 heads a rank, 64 experts: 32 a rank), "
                   "real NCCL collectives, two H200s"),
            context=4096,
            batches=(1, 4, 16, 64),
            k3_layers=(1, 4),
        ),
    )
}


def workload_of_model(model: str) -> Workload | None:
    """The workload whose spec defines model ``model`` (None for any other model)."""
    for workload in WORKLOADS.values():
        if workload.model == model:
            return workload
    return None


def title_of(model: str) -> str:
    """What the benchmark tables call a model: its workload's label, else its name."""
    workload = workload_of_model(model)
    return workload.label if workload else model


def k3_prefix_spec(k3: Spec, layers: int, experts: int | None = None, tp: int = 1,
                   batches: tuple[int, ...] = (1,)) -> Spec:
    """K3 (``k3``: the spec of ``models/kimi_k3.yaml``) cut to its first ``layers`` layers
    (MLA every 4th from 3, layer 0 dense), optionally with ``experts`` routed experts, at
    ``tp`` ranks. Used to compare a workload with the K3 layers it stands for."""
    model = k3.model.model_dump(mode="json")
    overrides = [{"at": 0, "mlp": "dense"}]
    if layers > 3:
        overrides.insert(0, {"at": f"3-{layers - 1}/4", "attention": "mla"})
    model["layers"] = {"count": layers, "default": {"attention": "kda", "mlp": "moe"},
                       "overrides": overrides}
    if experts is not None:
        model["mlp"]["moe"]["experts"] = experts
    deployment = {**k3.deployment.model_dump(mode="json"), "tp": tp, "batches": list(batches)}
    return Spec.model_validate({"model": model, "deployment": deployment})
