"""``stepgraph diff A B``: what differs between two compiled artifacts (inputs, graph,
decisions per bin, PDL chain, arena); exit status 0 when they compile the same step, 1 when
they differ, 2 on a user error, as diff(1)."""

from __future__ import annotations

import argparse
import json

from stepgraph.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand."""
    parser = sub.add_parser(
        "diff", help="what differs between two compiled artifacts: inputs, graph, the "
                     "tactic of each node per bin, PDL chain, arena",
        epilog="exit status: 0 the same step, 1 they differ, 2 an error. Typical use: "
               "check that a tactic table variant changes only the nodes it should "
               "before an A/B on the GPU.")
    parser.add_argument("a", help="artifact file (the 'a' side)")
    parser.add_argument("b", help="artifact file (the 'b' side)")
    parser.add_argument("--bin", type=int, action="append", dest="bins", metavar="ROWS",
                        help="compare decisions at this bin only (repeatable)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def run(args: argparse.Namespace) -> int:
    """Load both artifacts, print what differs; 0 if nothing does, else 1."""
    from stepgraph.artifact import load_artifact
    from stepgraph.commands.artifact_diff import diff_artifacts, diff_text
    from stepgraph.memory.arena import bin_rows

    a, b = load_artifact(args.a), load_artifact(args.b)
    if args.bins:
        both = set(bin_rows(a.graph)) | set(bin_rows(b.graph))
        missing = sorted(set(args.bins) - both)
        if missing:
            raise UserError(f"--bin {missing[0]}: neither artifact has that bin (a: "
                            f"{', '.join(map(str, bin_rows(a.graph)))}; b: "
                            f"{', '.join(map(str, bin_rows(b.graph)))})")
    diff = diff_artifacts(a, b, args.bins)
    if args.format == "json":
        print(json.dumps(diff.to_json(), indent=1, sort_keys=True))
    else:
        print(diff_text(diff, args.a, args.b))
    return 0 if diff.same else 1
