"""The compile driver: spec + deployment -> verified graph through the pipeline -> artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepgraph.artifact import build_document
from stepgraph.frontend import build_step
from stepgraph.ir.graph import Graph
from stepgraph.passes.manager import CompileContext, DumpHook, PassReport, run_pipeline
from stepgraph.passes.pipeline import CompileOptions, default_pipeline
from stepgraph.spec import Deployment, Spec


def _tables(deployment: Deployment, path: str | Path | None = None
            ) -> tuple[Any, dict[str, Any]]:
    """The tactic tables of the deployment's target (or of the file at ``path``, which must
    be a table for that target or the portable ``default`` one) and what the artifact records
    of them (the bin pass records a file other than the target's own in ``meta["tactics"]``)."""
    from stepgraph.tactics import TacticsError, load_tables

    tables = load_tables(deployment.target, path)
    if path is not None and tables.data.target not in (deployment.target, "default"):
        raise TacticsError(f"{path}: a tactic table for target {tables.data.target}, but the "
                           f"deployment targets {deployment.target}: compile with --target "
                           f"{tables.data.target} or give a {deployment.target} table")
    return tables, {"target": deployment.target, "version": tables.version,
                    "digest": tables.digest}


def _run(spec: Spec, deployment: Deployment, options: CompileOptions, tables: Any,
         after: DumpHook | None, stop_after: str | None) -> tuple[Graph, list[PassReport]]:
    """The frontend and the pipeline with loaded tactic tables."""
    ctx = CompileContext(spec.model, deployment, {"tactics": tables})
    graph = build_step(spec.model, deployment)
    if after is not None:
        after("frontend", graph)
    return run_pipeline(graph, default_pipeline(options), ctx, after, stop_after)


def compile_graph(
    spec: Spec,
    deployment: Deployment | None = None,
    options: CompileOptions | None = None,
    after: DumpHook | None = None,
    stop_after: str | None = None,
    tables_path: str | Path | None = None,
) -> tuple[Graph, list[PassReport]]:
    """Build the step graph of ``spec`` and run the pipeline; returns the graph and per-pass
    reports. ``tables_path``: a tactic table file (``stepgraph tune``'s output) instead of
    the target's own."""
    deployment = deployment or spec.deployment
    tables, _ = _tables(deployment, tables_path)
    return _run(spec, deployment, options or CompileOptions(), tables, after, stop_after)


def compile_document(
    spec: Spec,
    deployment: Deployment | None = None,
    options: CompileOptions | None = None,
    after: DumpHook | None = None,
    tables_path: str | Path | None = None,
) -> tuple[dict[str, Any], list[PassReport]]:
    """Compile and wrap the result in an artifact document (see :mod:`stepgraph.artifact`)."""
    deployment = deployment or spec.deployment
    options = options or CompileOptions()
    tables, record = _tables(deployment, tables_path)
    graph, reports = _run(spec, deployment, options, tables, after, None)
    document = build_document(
        graph,
        spec.model.model_dump(mode="json"),
        deployment.model_dump(mode="json"),
        options.to_json(),
        record,
    )
    return document, reports
