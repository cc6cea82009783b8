"""The compile driver: spec + deployment -> verified graph through the pipeline -> artifact."""

from __future__ import annotations

from typing import Any

from stepgraph.artifact import build_document
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.passes.manager import CompileContext, DumpHook, PassReport, run_pipeline
from stepgraph.passes.pipeline import CompileOptions, default_pipeline
from stepgraph.spec import Deployment, Spec


def _tables(deployment: Deployment) -> tuple[Any, dict[str, Any]]:
    from stepgraph.tactics import load_tables

    tables = load_tables(deployment.target)
    return tables, {"target": deployment.target, "version": tables.version,
                    "digest": tables.digest}


def compile_graph(
    spec: Spec,
    deployment: Deployment | None = None,
    options: CompileOptions | None = None,
    after: DumpHook | None = None,
    stop_after: str | None = None,
) -> tuple[Graph, list[PassReport]]:
    """Build the step graph of ``spec`` and run the pipeline; returns the graph and per-pass
    reports."""
    deployment = deployment or spec.deployment
    options = options or CompileOptions()
    tables, _ = _tables(deployment)
    ctx = CompileContext(spec.model, deployment, {"tactics": tables})
    graph = build_step(spec.model, deployment)
    if after is not None:
        after("frontend", graph)
    return run_pipeline(graph, default_pipeline(options), ctx, after, stop_after)


def compile_document(
    spec: Spec,
    deployment: Deployment | None = None,
    options: CompileOptions | None = None,
    after: DumpHook | None = None,
) -> tuple[dict[str, Any], list[PassReport]]:
    """Compile and wrap the result in an artifact document (see :mod:`stepgraph.artifact`)."""
    deployment = deployment or spec.deployment
    options = options or CompileOptions()
    graph, reports = compile_graph(spec, deployment, options, after)
    _, tables = _tables(deployment)
    document = build_document(
        graph,
        spec.model.model_dump(mode="json"),
        deployment.model_dump(mode="json"),
        options.to_json(),
        tables,
    )
    return document, reports
