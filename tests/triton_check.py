"""Helpers of the Triton kernel tests (test_kernels_dense.py, test_kernels_moe.py).

* Interpreter checks run in a subprocess (this machine's Triton runs kernels on CPU tensors
  with ``TRITON_INTERPRET=1``, which must be set before triton is imported, so they never
  share a process with other tests): :func:`run_script`.
* :func:`patch_interpreter` works around Triton 3.6's interpreter under numpy 2 (scalars
  are 1-element arrays, which ``range()`` cannot take).
* :func:`sm90_compiles` compiles the launches a callable makes for an H100/H200 (sm_90)
  without a GPU (a fake driver; tensors on the ``meta`` device) and reports each kernel's
  registers, spills, shared memory and PTX.
* :class:`FakeContext` is a provider's PrepareContext over a dict of bound tensors.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def has_triton() -> bool:
    """Whether triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def run_script(script: Path, *args: str, interpret: bool = True,
               timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` from the repository root (``TRITON_INTERPRET=1`` when
    ``interpret``); the caller asserts on the result."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def explain(result: subprocess.CompletedProcess[str]) -> str:
    """The output of a failed subprocess, for an assertion message."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def patch_interpreter() -> None:
    """Let Triton's interpreter take scalar kernel values as Python ints in ``range()``."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_index_shim", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._index_shim = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched


def rel_err(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN when out has a NaN)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass
class FakeContext:
    """A provider PrepareContext over a dict of bound tensors."""

    node: Any
    rows: int
    bound: dict[str, Any]
    device: Any
    pdl: bool = False
    tactic: dict[str, Any] = field(default_factory=dict)
    pre_wait: frozenset[str] = frozenset()

    def tensor(self, name: str) -> Any:
        """The bound tensor of ``name``."""
        return self.bound[name]

    def inputs(self) -> list[Any]:
        """The node's input tensors in order."""
        return [self.bound[n] for n in self.node.inputs]

    def outputs(self) -> list[Any]:
        """The node's output tensors in order."""
        return [self.bound[n] for n in self.node.outputs]


# ----------------------------------------------------------------------------- sm_90 compiles


@dataclass
class Compiled:
    """One kernel compiled for sm_90: name, registers and spill bytes (ptxas -v), shared
    memory, and its PTX / TTGIR text."""

    name: str
    regs: int
    spills: int
    shared: int
    ptx: str
    ttgir: str

    def loads_before_wait(self) -> bool:
        """Whether the PTX issues a global load before its first ``griddepcontrol.wait``."""
        head = self.ptx.split("griddepcontrol.wait", 1)[0]
        return bool(re.search(r"\b(ld\.global|cp\.async)", head))


def _ptxas_report(ptx: str) -> tuple[int, int]:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    try:
        result = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", handle.name, "-o",
                                 os.devnull], capture_output=True, text=True, check=False)
    finally:
        os.unlink(handle.name)
    text = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if regs is None:
        raise RuntimeError(f"ptxas -v gave no register count:\n{text}")
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def sm90_compiles(launch: Callable[[], None]) -> list[Compiled]:
    """Compile (never run) every kernel ``launch()`` enqueues, for sm_90, with the exact
    arguments, specializations and options it passes; no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from triton.runtime.driver import driver as config

    class _Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    seen: list[tuple[str, Any]] = []
    original = jit.JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append((self.fn.__name__, kernel))
        return kernel

    old_driver = config._active
    config.set_active(_Driver())
    jit.JITFunction.run = run
    try:
        launch()
    finally:
        jit.JITFunction.run = original
        config._active = old_driver
    out = []
    for name, kernel in seen:
        regs, spills = _ptxas_report(kernel.asm["ptx"])
        out.append(Compiled(name, regs, spills, int(kernel.metadata.shared),
                            kernel.asm["ptx"], kernel.asm.get("ttgir", "")))
    return out


def ref_op(op: str, ins: list[Any], attrs: dict[str, Any], out_dtypes: list[Any]) -> list[Any]:
    """The reference executor's function of ``op`` (``stepgraph.lower.reference``) on
    ``ins`` with node ``attrs``."""
    import torch

    from stepgraph.ir.nodes import Node
    from stepgraph.lower.ref_common import OpCall
    from stepgraph.lower.reference import REFERENCE_OPS

    node = Node("check", op, tuple(f"in{i}" for i in range(len(ins))),
                tuple(f"out{i}" for i in range(len(out_dtypes))), dict(attrs))
    call = OpCall(node, list(ins), [None] * len(out_dtypes), list(out_dtypes),
                  torch.float32, ins[0].shape[0])
    return REFERENCE_OPS[op](call)


def node_of(op: str, inputs: int, outputs: int, **attrs: Any) -> Any:
    """An IR node of ``op`` with inputs ``in0..`` and outputs ``out0..``."""
    from stepgraph.ir.nodes import Node

    return Node(f"test.{op}", op, tuple(f"in{i}" for i in range(inputs)),
                tuple(f"out{i}" for i in range(outputs)), attrs)


def context(node: Any, tensors: list[Any], *, pdl: bool = False,
            tactic: dict[str, Any] | None = None) -> FakeContext:
    """A FakeContext binding ``tensors`` to the node's inputs then outputs."""
    names = [*node.inputs, *node.outputs]
    rows = tensors[0].shape[0]
    return FakeContext(node, rows, dict(zip(names, tensors, strict=True)), tensors[0].device,
                       pdl, dict(tactic or {}))


class Replayer:
    """Launches captured in one CUDA graph on a CUDA device (warmed first, outside the
    capture), or run eagerly elsewhere; :meth:`replay` runs them once more."""

    def __init__(self, launches: list[Callable[[], None]], device: Any) -> None:
        import torch

        self.launches = launches
        self.graph = None
        if torch.device(device).type == "cuda":
            for launch in launches:
                launch()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for launch in launches:
                    launch()

    def replay(self) -> None:
        """One more run of every launch, in order (synchronized on CUDA)."""
        import torch

        if self.graph is None:
            for launch in self.launches:
                launch()
            return
        self.graph.replay()
        torch.cuda.synchronize()
