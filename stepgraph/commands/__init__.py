"""Subcommands of the ``stepgraph`` CLI: each module has ``add_parser(sub)`` and ``run(args)``."""
