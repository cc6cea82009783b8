"""``stepgraph import-hf DIR -o spec.yaml``: a model spec from a Hugging Face config.json."""

from __future__ import annotations

import argparse
import sys

from stepgraph.atomic_file import writable_path
from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser(
        "import-hf",
        help="write a model spec from a Hugging Face checkpoint's config.json",
        description="Supports transformers kimi_linear, Kimi K3 (text_config of kimi_linear), "
                    "deepseek_v3 and deepseek_v32. A config field the spec cannot express is "
                    "refused with a message naming it.",
    )
    parser.add_argument("directory", help="checkpoint directory holding config.json")
    parser.add_argument("-o", "--output", required=True, help="spec file to write (YAML)")
    parser.add_argument("--name", help="model name in the spec (default: from the directory)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Import the config, check the spec loads, write it."""
    from stepgraph.importers.hf import import_hf
    from stepgraph.spec_loader import parse_spec_text

    text, notes = import_hf(args.directory, args.name)
    try:
        parse_spec_text(text, args.output)
    except UserError as error:
        raise UserError(f"the imported spec does not validate: {error}") from None
    output = writable_path(args.output, "-o")
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as error:
        raise UserError(f"{output}: cannot write ({error.strerror})") from None
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {output}")
    return 0
