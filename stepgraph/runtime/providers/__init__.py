"""Kernel providers of the runtime, registered by (op, provider name).

Importing this package registers every provider module that can be imported here (the
torch baseline always; Triton providers where triton is installed).
"""

from __future__ import annotations

import importlib

from stepgraph.runtime.providers.registry import REGISTRY, candidates, register

_MODULES = ("collectives", "torch_ops", "triton_dense", "triton_moe", "triton_kda", "triton_mla",
            "l2_prefetch")


def load_providers() -> list[str]:
    """Import every provider module available; returns the names that failed to import,
    each with its reason, for the runtime's report."""
    skipped = []
    for name in _MODULES:
        try:
            importlib.import_module(f"stepgraph.runtime.providers.{name}")
        except ImportError as error:  # triton (or a module) not installed here
            skipped.append(f"{name}: {error}")
    return skipped


__all__ = ["REGISTRY", "candidates", "load_providers", "register"]
