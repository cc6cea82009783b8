"""The provider registry: for each (op, provider name) a factory that prepares one node's
launch for one bin.

A factory receives a :class:`PrepareContext` (the node, its per-bin tensors, its decision)
and returns a :data:`Launch`: a zero-argument callable that enqueues the node's kernels on
the current CUDA stream (or computes eagerly on the CPU). Launches must be capturable in a
CUDA graph: no host synchronization, no allocation that depends on data, no shape that
depends on data. Every input and output tensor is bound before the factory is called and
stays the same for every replay, so a factory may precompute pointers, strides and grids.

Providers register with :func:`register`; :func:`candidates` lists, in order, the provider
the bin pass chose and the next available ones in the op's preference order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Launch = Callable[[], None]


class PrepareContext(Protocol):
    """What a provider factory may read."""

    node: Any  # stepgraph.ir.nodes.Node
    rows: int  # the bin's row count
    tactic: Mapping[str, Any]  # the bin pass's tactic (may be empty)
    pdl: bool  # whether this launch may use programmatic dependent launch
    device: Any  # torch.device
    comm: Any  # stepgraph.runtime.comm.Communicator of a multi-rank step, else None
    pre_wait: frozenset[str]  # inputs readable before the PDL wait (empty without PDL)

    def tensor(self, name: str) -> Any:
        """The bound tensor of a value (arena temp or view, weight, state, input, output)."""
        ...

    def inputs(self) -> list[Any]:
        """The node's input tensors in order."""
        ...

    def outputs(self) -> list[Any]:
        """The node's output tensors in order."""
        ...


Factory = Callable[[PrepareContext], Launch]


@dataclass(frozen=True)
class ProviderEntry:
    """A registered provider: its factory and whether it can run on a device type."""

    op: str
    provider: str
    factory: Factory
    devices: tuple[str, ...] = ("cuda",)
    note: str = ""


@dataclass
class Registry:
    """Providers keyed by (op, provider name)."""

    entries: dict[tuple[str, str], ProviderEntry] = field(default_factory=dict)

    def add(self, entry: ProviderEntry) -> None:
        """Register ``entry`` (a second registration of the same key replaces the first)."""
        self.entries[(entry.op, entry.provider)] = entry

    def get(self, op: str, provider: str) -> ProviderEntry | None:
        """The entry of (op, provider), or None."""
        return self.entries.get((op, provider))

    def providers_of(self, op: str) -> list[str]:
        """The provider names registered for ``op``."""
        return [p for (o, p) in self.entries if o == op]


REGISTRY = Registry()


def register(op: str, provider: str, devices: tuple[str, ...] = ("cuda",),
             note: str = "") -> Callable[[Factory], Factory]:
    """Decorator: register a factory for (op, provider) on ``devices`` ("cuda", "cpu")."""

    def decorate(factory: Factory) -> Factory:
        REGISTRY.add(ProviderEntry(op, provider, factory, devices, note))
        return factory

    return decorate


def candidates(op: str, wanted: str | None, preference: Sequence[str], device_type: str,
               registry: Registry = REGISTRY) -> list[ProviderEntry]:
    """The registered providers of ``op`` runnable on ``device_type``, in the order to try:
    ``wanted`` (the bin pass's choice), the op's preference list, ``torch``. The runtime
    takes the first whose factory does not decline (NotImplementedError) and records why
    it is not ``wanted``."""
    order = dict.fromkeys([*(n for n in (wanted,) if n), *preference, "torch"])
    found = []
    for name in order:
        entry = registry.get(op, name)
        if entry is not None and device_type in entry.devices:
            found.append(entry)
    return found
