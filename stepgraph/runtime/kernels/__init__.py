"""Triton kernels of the runtime and their launch wrappers (provider factories live in
:mod:`stepgraph.runtime.providers`)."""
