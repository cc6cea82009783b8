"""The ``stepgraph`` command line: one subcommand per module in :mod:`stepgraph.commands`.

User errors print ``error: <one line>`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from stepgraph import __version__
from stepgraph.errors import UserError

DESCRIPTION = """Compile the decode step of a hybrid LLM (a model spec and a deployment) into an
artifact: the step graph, a tactic per node and row bin, and one memory plan. Inspect it on
any machine; run, tune and benchmark it on a GPU."""
EPILOG = """typical use:
  stepgraph compile models/kimi_k3.yaml --tp 8 -o k3.sgart
  stepgraph inspect k3.sgart --summary
  stepgraph bench k3.sgart --weights random        (on a GPU)

`stepgraph COMMAND --help` describes each command."""
COMMANDS = ("compile", "inspect", "diff", "dump", "schema", "run", "import_hf", "bench", "tune")


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


class _Commands(argparse._SubParsersAction):
    """The subcommand action: a command's ``--help`` opens with its line in the command list
    unless the command gives a description of its own."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("description", kwargs.get("help"))
        return super().add_parser(name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = _Parser(prog="stepgraph", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"stepgraph {__version__}")
    parser.register("action", "parsers", _Commands)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"stepgraph.commands.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"stepgraph.commands.{name}":
                raise
            continue
        command = module.add_parser(sub)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
