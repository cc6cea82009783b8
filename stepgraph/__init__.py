"""stepgraph: a declarative step-graph compiler for the decode step of large hybrid LLMs."""

__version__ = "0.1.0"
