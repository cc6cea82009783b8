"""``stepgraph run SPEC|ARTIFACT --weights DIR|random --tokens 1,2,3 [--tokens ...] --logits-out
FILE.npy [--nproc N]``: run requests and save their logits.

With a spec (``.yaml``) the reference executor runs them; with a compiled artifact the
runtime does (CUDA graphs on a GPU), on ``--nproc`` processes for an artifact compiled for
several ranks (one GPU a rank; Gloo on the CPU with ``--device cpu``).

Each ``--tokens`` is one request. All requests run together as one batch of decode steps
from empty caches, each prompt fed one token per step (requests of different lengths finish
at different steps). The file holds float32 logits [requests, max tokens, vocab], NaN where
a request has no token. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stepgraph.atomic_file import writable_path
from stepgraph.commands.common import check_nproc, parse_int_list
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("run", help="run requests (reference executor for a spec, the "
                                        "compiled step for an artifact); save logits")
    parser.add_argument("spec", help="model spec (YAML) or compiled artifact (.sgart)")
    parser.add_argument("--weights", required=True,
                        help="safetensors checkpoint directory (Hugging Face layout) or `random`")
    parser.add_argument("--seed", type=int, default=0, help="seed of --weights random")
    parser.add_argument("--tokens", action="append", required=True,
                        help="one request's token ids, e.g. 1,2,3 (repeat for more requests)")
    parser.add_argument("--logits-out", required=True, help="where to save the logits (.npy)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--nproc", type=int,
                        help="processes (ranks) for an artifact compiled for several ranks "
                             "(default: the artifact's ranks)")
    return parser


def build_graph(spec_path: str):  # -> Graph
    """The compiled step graph (the whole pipeline at a world of one, q = 1) of a spec, or
    the frontend's graph where the pipeline is not available."""
    from stepgraph.spec_loader import load_spec, override_deployment

    spec = load_spec(spec_path)
    deployment = override_deployment(spec.deployment, q=1, tp=1, dcp=1, dep=1)
    try:
        from stepgraph.compiler import compile_graph
    except ImportError:
        from stepgraph.frontend import build_step

        return build_step(spec.model, deployment)
    graph, _ = compile_graph(spec, deployment)
    return graph


def check_tokens(prompts: list[list[int]], graph) -> None:  # graph: Graph
    """A one-line error for a token outside the graph's vocabulary."""
    from stepgraph.ir.graph import vocab_size

    vocab = vocab_size(graph)
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--tokens: token {bad[0]} is outside the vocabulary 0..{vocab - 1}")


def is_spec(path: str) -> bool:
    """Whether ``path`` names a spec (YAML) rather than a compiled artifact."""
    return Path(path).suffix.lower() in (".yaml", ".yml")


def run(args: argparse.Namespace) -> int:
    """Load, run, save."""
    prompts = [list(parse_int_list(text, "--tokens")) for text in args.tokens]
    output = writable_path(args.logits_out, "--logits-out")
    if not is_spec(args.spec):
        return run_artifact(args, prompts, output)
    if args.nproc not in (None, 1):
        raise UserError("--nproc runs a compiled artifact over ranks: compile the spec first "
                        "(stepgraph compile SPEC --tp N -o step.sgart)")
    import torch

    from stepgraph.lower.decode import DecodeRunner, run_prompts
    from stepgraph.lower.tensors import compute_dtype, resolve_device
    from stepgraph.lower.weights import load_weights, random_weights

    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype)
    graph = build_graph(args.spec)
    check_tokens(prompts, graph)
    if args.weights == "random":
        weights = random_weights(graph, args.seed, dtype=dtype)
    else:
        weights = load_weights(graph, args.weights, dtype=dtype)
    with torch.inference_mode():
        runner = DecodeRunner(graph, weights, max_requests=len(prompts),
                              max_tokens=max(len(p) for p in prompts), device=device,
                              dtype=dtype)
        logits = run_prompts(runner, prompts)
    return save_logits(output, logits)


def save_logits(output: Path, logits) -> int:  # logits: np.ndarray
    """Write the logits file (one line on failure)."""
    import numpy as np

    try:
        np.save(output, logits.astype(np.float32))
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror})") from None
    print(f"wrote {output}: logits {list(logits.shape)} float32")
    return 0


def run_artifact(args: argparse.Namespace, prompts: list[list[int]], output: Path) -> int:
    """Decode the prompts through a compiled artifact, on its ranks."""
    from stepgraph.artifact import load_artifact

    artifact = load_artifact(args.spec)
    world = check_nproc(artifact.graph, args.nproc)
    check_tokens(prompts, artifact.graph)
    from stepgraph.lower.tensors import compute_dtype, resolve_device
    from stepgraph.runtime.launch import launch
    from stepgraph.runtime.prompts import PromptRun, decode_on_rank, gather_logits

    resolve_device(args.device)
    compute_dtype(args.dtype)
    options = PromptRun(weights=args.weights, seed=args.seed, device=args.device,
                        dtype=args.dtype)
    if world == 1:
        parts = [decode_on_rank(None, args.spec, prompts, options)]
    else:
        parts = launch(decode_on_rank, world, args.spec, prompts, options, device=args.device)
    return save_logits(output, gather_logits(parts, len(prompts)))
