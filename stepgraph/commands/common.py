"""Flags and helpers shared by the subcommands that compile a spec."""

from __future__ import annotations

import argparse

from stepgraph.errors import UserError
from stepgraph.spec import Deployment, Spec
from stepgraph.spec_loader import load_spec, override_deployment


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); a one-line error naming ``flag`` otherwise."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not values:
        raise UserError(f"{flag}: give at least one integer")
    return values


def check_nproc(graph, nproc: int | None) -> int:  # graph: stepgraph.ir.graph.Graph
    """The processes to start for a compiled graph: its ranks; a one-line error when
    ``--nproc`` asks for another count."""
    world = int(graph.meta.get("world", 1))
    if nproc is not None and nproc != world:
        raise UserError(f"--nproc {nproc}: the artifact was compiled for {world} rank(s)")
    return world


def add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    """--tp, --dcp, --dep, --batches, --q, --target (override the spec's deployment)."""
    group = parser.add_argument_group("deployment (overrides the spec's `deployment:`)")
    group.add_argument("--tp", type=int, help="tensor-parallel ranks")
    group.add_argument("--dcp", type=int, help="decode-context-parallel ranks (= tp)")
    group.add_argument("--dep", type=int, help="DEP: data-parallel attention, EP experts")
    group.add_argument("--batches", help="row bins, e.g. 1,2,4,8,16,32,64")
    group.add_argument("--q", type=int, help="tokens per request in a verify step")
    group.add_argument("--target", help="target GPU (h200, h100, b200, cpu)")


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """--no-pdl, --no-pack, --no-fuse, --no-streams (ablations); --tactics FILE."""
    parser.add_argument("--no-pdl", action="store_true",
                        help="turn the PDL + prefetch pass off (ablation)")
    parser.add_argument("--no-pack", action="store_true",
                        help="keep projections unpacked (ablation)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="keep the AttnRes add, mix and norm separate (ablation)")
    parser.add_argument("--no-streams", action="store_true",
                        help="run every launch on one stream, no side-stream branch "
                             "(ablation)")
    parser.add_argument("--tactics", metavar="FILE",
                        help="a tactic table file (e.g. `stepgraph tune`'s output) instead of "
                             "the target's own")


def options_from(args: argparse.Namespace):  # -> CompileOptions (lazy import)
    """The compile options the flags ask for."""
    from stepgraph.passes.pipeline import CompileOptions

    return CompileOptions(pdl=not args.no_pdl, pack=not args.no_pack,
                          fuse=not args.no_fuse, streams=not args.no_streams)


def spec_and_deployment(args: argparse.Namespace) -> tuple[Spec, Deployment]:
    """Load the spec and apply the deployment flags."""
    spec = load_spec(args.spec)
    batches = parse_int_list(args.batches, "--batches") if args.batches else None
    deployment = override_deployment(
        spec.deployment, tp=args.tp, dcp=args.dcp, dep=args.dep, batches=batches, q=args.q,
        target=args.target,
    )
    return spec, deployment
