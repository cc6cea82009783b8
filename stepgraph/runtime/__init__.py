"""The stepgraph runtime: load a compiled artifact onto a device and run decode steps.

``load(artifact, weights, device)`` allocates one arena from the memory plan, binds weights,
caches and static input / output buffers, prepares every node's launch per bin (providers
from :mod:`stepgraph.runtime.providers`), and captures one CUDA graph per bin;
``CompiledStep.step(StepInputs)`` runs a step. Imports torch (the compile path never
imports this package).
"""

from __future__ import annotations

from stepgraph.runtime.inputs import StepInputs
from stepgraph.runtime.loader import load
from stepgraph.runtime.step import CompiledStep

__all__ = ["CompiledStep", "StepInputs", "load"]
