"""The GPU benchmark of shared/BENCHMARKS.md: workloads (``workloads``), the floor's byte
accounting (``floor``), the measurement protocol (``protocol``, ``weights``, ``session``),
options and the result tables (``options``, ``table``). ``floor``, ``table``, ``options`` and
``workloads`` never import torch; the command is ``stepgraph bench``."""
