#!/usr/bin/env bash
# Fetch, on this CPU machine, the wheels the GPU machine lacks into .whl/ (git-ignored; pass
# `carry: [".whl"]` to the device tool's run). The GPU machine has torch, Triton and CUDA but
# no network: fla-core and the test dependencies travel as wheels for its CPython 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  fla-core==0.6.0 einops==0.8.2 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types \
  typing-inspection typing_extensions networkx==3.6.1 hypothesis==6.155.2 sortedcontainers \
  pytest==9.0.3 pluggy iniconfig
du -sh .whl
