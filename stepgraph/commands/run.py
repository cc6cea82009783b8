"""``stepgraph run SPEC --weights DIR|random --tokens 1,2,3 [--tokens ...] --logits-out FILE.npy``:
run requests through the reference executor and save their logits.

Each ``--tokens`` is one request. All requests run together as one batch of decode steps
from empty caches, each prompt fed one token per step (requests of different lengths finish
at different steps). The file holds float32 logits [requests, max tokens, vocab], NaN where
a request has no token. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stepgraph.commands.common import parse_int_list
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("run", help="run requests with the reference executor; save logits")
    parser.add_argument("spec", help="model spec (YAML)")
    parser.add_argument("--weights", required=True,
                        help="safetensors checkpoint directory (Hugging Face layout) or `random`")
    parser.add_argument("--seed", type=int, default=0, help="seed of --weights random")
    parser.add_argument("--tokens", action="append", required=True,
                        help="one request's token ids, e.g. 1,2,3 (repeat for more requests)")
    parser.add_argument("--logits-out", required=True, help="where to save the logits (.npy)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
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


def run(args: argparse.Namespace) -> int:
    """Load, run, save."""
    prompts = [list(parse_int_list(text, "--tokens")) for text in args.tokens]
    output = Path(args.logits_out)
    import numpy as np
    import torch

    from stepgraph.lower.decode import DecodeRunner, run_prompts
    from stepgraph.lower.tensors import compute_dtype, resolve_device
    from stepgraph.lower.weights import load_weights, random_weights

    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype)
    graph = build_graph(args.spec)
    vocab = graph.values["embed_tokens"].type.shape[0]
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise UserError(f"--tokens: token {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    if args.weights == "random":
        weights = random_weights(graph, args.seed, dtype=dtype)
    else:
        weights = load_weights(graph, args.weights, dtype=dtype)
    with torch.inference_mode():
        runner = DecodeRunner(graph, weights, max_requests=len(prompts),
                              max_tokens=max(len(p) for p in prompts), device=device,
                              dtype=dtype)
        logits = run_prompts(runner, prompts)
    try:
        np.save(output, logits.astype(np.float32))
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror})") from None
    print(f"wrote {output}: logits {list(logits.shape)} float32")
    return 0
