"""The fused gated activation kernel (SiTU / SwiGLU) against the reference's
``gated_activation`` on fresh random inputs: in Triton's interpreter on the CPU (a
subprocess with TRITON_INTERPRET=1) and, with ``-m gpu``, on CUDA in BF16."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
CASES = [({"activation": "situ", "beta": 4.0, "beta_linear": 25.0}, 3, 48),
         ({"activation": "situ", "beta": 4.0, "beta_linear": 25.0}, 5, 1500),
         ({"activation": "silu"}, 4, 1100)]


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


CHECK = textwrap.dedent("""
    import torch
    from stepgraph.runtime.kernels.activation import gated_activation
    from stepgraph.lower.ref_common import gated_activation as ref
    torch.manual_seed(0)
    for attrs, rows, width in CASES:
        h = torch.randn(rows, 2 * width) * 6
        out = torch.full((rows, width), float("nan"))
        gated_activation(h, out, attrs)
        want = ref(h[:, :width], h[:, width:], attrs)
        err = ((out - want).norm() / want.norm()).item()
        assert not torch.isnan(out).any(), "unwritten output"
        assert err < 1e-6, (attrs, rows, width, err)
    print("OK")
""")


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_interpreter_matches_the_reference() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    code = f"CASES = {CASES!r}\n{CHECK}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("attrs", "rows", "width"), [
    *CASES, ({"activation": "situ", "beta": 4.0, "beta_linear": 25.0}, 64, 6144)])
def test_gpu_bf16_matches_the_reference(attrs: dict, rows: int, width: int) -> None:
    from stepgraph.lower.ref_common import gated_activation as ref
    from stepgraph.runtime.kernels.activation import gated_activation

    generator = torch.Generator(device="cuda").manual_seed(rows * 7 + width)
    h = (torch.randn(rows, 2 * width, device="cuda", generator=generator) * 6).bfloat16()
    out = torch.full((rows, width), float("nan"), device="cuda", dtype=torch.bfloat16)
    gated_activation(h, out, attrs)
    want = ref(h[:, :width].float(), h[:, width:].float(), attrs)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert not torch.isnan(out).any(), "unwritten output"
    assert err < 1e-2, err
