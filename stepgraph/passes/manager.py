"""The pass manager: an ordered pipeline of named, pure passes with typed options.

A pass is a frozen dataclass with a ``name`` and a ``run(graph, ctx)`` method that returns a
:class:`PassResult` holding a new graph (the input is never edited), whether anything
changed, and a one-line summary. The manager verifies the IR after every pass, times each
one, and can dump the IR after any of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.verify import VerifyError, verify
from stepgraph.spec import Deployment, Model


class PassError(UserError):
    """A pass that cannot proceed (an impossible deployment, a broken invariant); the message
    names the pass and, where there is one, the node."""

    def __init__(self, pass_name: str, message: str, node: str | None = None) -> None:
        where = f" at node {node}" if node else ""
        super().__init__(f"pass {pass_name}{where}: {message}")
        self.pass_name = pass_name
        self.node = node


@dataclass(frozen=True)
class CompileContext:
    """What every pass may read: the model, the deployment and named data (tactic tables)."""

    model: Model
    deployment: Deployment
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassResult:
    """A pass's new graph, whether it changed anything, and what it did in one line."""

    graph: Graph
    changed: bool
    summary: str = ""


class Pass(Protocol):
    """A named, pure graph transformation."""

    name: ClassVar[str]

    def run(self, graph: Graph, ctx: CompileContext) -> PassResult:
        """Return a new graph; never edit ``graph``."""
        ...


@dataclass
class PassReport:
    """One executed pass: its name, seconds, whether it changed the graph, and its summary."""

    name: str
    seconds: float
    changed: bool
    summary: str


DumpHook = Callable[[str, Graph], None]


def run_pipeline(
    graph: Graph,
    passes: Sequence[Pass],
    ctx: CompileContext,
    after: DumpHook | None = None,
    stop_after: str | None = None,
) -> tuple[Graph, list[PassReport]]:
    """Run ``passes`` in order, verifying after each; ``after(name, graph)`` sees every result.

    ``stop_after`` ends the pipeline after the pass of that name.
    """
    names = [p.name for p in passes]
    if stop_after is not None and stop_after not in names:
        raise UserError(f"no pass named {stop_after!r}; the pipeline is: {', '.join(names)}")
    try:
        verify(graph)
    except VerifyError as error:
        raise PassError("frontend", str(error), error.node) from None
    reports = []
    for step in passes:
        start = time.perf_counter()
        try:
            result = step.run(graph, ctx)
        except PassError:
            raise
        except VerifyError as error:
            raise PassError(step.name, str(error), error.node) from None
        try:
            verify(result.graph)
        except VerifyError as error:
            raise PassError(step.name, f"left an invalid graph: {error}", error.node) from None
        graph = result.graph
        reports.append(PassReport(step.name, time.perf_counter() - start, result.changed,
                                  result.summary))
        if after is not None:
            after(step.name, graph)
        if step.name == stop_after:
            break
    return graph, reports
