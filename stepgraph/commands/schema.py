"""``stepgraph schema``: the JSON Schema of spec files."""

from __future__ import annotations

import argparse
import json

from stepgraph.spec import Spec


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser("schema", help="print the JSON Schema of spec files")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the schema."""
    print(json.dumps(Spec.model_json_schema(), indent=2, sort_keys=True))
    return 0
