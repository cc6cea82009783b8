"""The memory picture: the ASCII map, the PNG/SVG drawing and the per-bin summary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.ir.nodes import Node
from stepgraph.ir.types import Storage, TensorType
from stepgraph.ir.values import Value
from stepgraph.memory.picture import memory_summary, render_memory
from stepgraph.passes.alias import Alias
from stepgraph.passes.manager import CompileContext
from stepgraph.spec import Deployment
from stepgraph.spec_loader import load_spec

MODELS = Path(__file__).resolve().parent.parent / "models"


def chain_graph() -> Graph:
    """embed -> x (128 B a row); a = proj(x) 64 B; b = proj(a) 192 B; c = proj(b) 32 B.

    Live sets by launch: {x} {x,a} {a,b} {b,c}: 128, 192, 256, 224 bytes a row.
    """
    g = Graph("chain")
    bf16 = "bfloat16"
    g.add_value(Value("tokens", TensorType(("B",), "int32"), Storage.INPUT))
    g.add_value(Value("table", TensorType((10, 64), bf16), Storage.WEIGHT))
    g.add_value(Value("wa", TensorType((32, 64), bf16), Storage.WEIGHT))
    g.add_value(Value("wb", TensorType((96, 32), bf16), Storage.WEIGHT))
    g.add_value(Value("wc", TensorType((16, 96), bf16), Storage.WEIGHT))
    for name, width in (("x", 64), ("a", 32), ("b", 96), ("c", 16)):
        g.add_value(Value(name, TensorType(("B", width), bf16), Storage.TEMP))
    g.add_node(Node("embed", "embed", ("tokens", "table"), ("x",)))
    g.add_node(Node("pa", "projection", ("x", "wa"), ("a",), layer=0))
    g.add_node(Node("pb", "projection", ("a", "wb"), ("b",), layer=0))
    g.add_node(Node("pc", "projection", ("b", "wc"), ("c",), layer=1))
    return g


def planned(batches: tuple[int, ...] = (2, 8)) -> Graph:
    spec = load_spec(MODELS / "tiny_k3.yaml")
    ctx = CompileContext(spec.model, Deployment(batches=batches))
    return Alias().run(chain_graph(), ctx).graph


def test_ascii_map_has_a_line_per_launch_with_live_bytes() -> None:
    text = render_memory(planned(), 2)
    lines = text.splitlines()
    assert lines[0].startswith("bin 2 rows: 4 temps")
    assert "lower bound 512 B" in lines[0]
    launches = lines[3:]
    assert len(launches) == 4
    live = [int(line.split("|")[2].split()[0]) for line in launches]
    assert live == [256, 384, 512, 448]
    assert [line.split()[-1] for line in launches] == ["0=x", "1=a", "2=b", "3=c"]
    assert "v" in lines[2]  # the lower bound marker


def test_ascii_map_columns_cover_live_temps_without_sharing() -> None:
    text = render_memory(planned(), 8, width=32)
    for line in text.splitlines()[3:]:
        row = line.split("|")[1]
        assert len(row) == 32
    # launch 2 holds a and b, which must not share a column
    row = text.splitlines()[3 + 2].split("|")[1]
    assert set(row) - {"."} == {"1", "2"}


def test_unknown_bin_is_a_user_error() -> None:
    with pytest.raises(UserError, match="no bin of 3 rows; the plan has bins of 2, 8"):
        render_memory(planned(), 3)


def test_unplanned_graph_is_planned_on_the_fly() -> None:
    text = render_memory(chain_graph(), 2)
    assert "lower bound 512 B" in text.splitlines()[0]


def test_summary_per_bin() -> None:
    rows = memory_summary(planned())
    assert [r["rows"] for r in rows] == [2, 8]
    eight = rows[1]
    assert eight["lower_bound_bytes"] == 8 * 256
    assert eight["naive_bytes"] == 8 * (128 + 64 + 192 + 32)
    assert eight["arena_over_lower_bound"] == round(eight["arena_bytes"] / 2048, 4)
    assert eight["naive_over_arena"] == round(eight["naive_bytes"] / eight["arena_bytes"], 4)


def test_image_falls_back_to_ascii_without_matplotlib(monkeypatch, tmp_path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    target = tmp_path / "plan.png"
    text = render_memory(planned(), 2, str(target))
    assert text.startswith("matplotlib is not installed")
    assert not target.exists()


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_image_is_drawn_with_matplotlib(tmp_path, suffix: str, magic: bytes) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / f"plan{suffix}"
    line = render_memory(planned(), 8, str(target))
    assert line.startswith(f"wrote {target}") and "\n" not in line
    assert magic in target.read_bytes()[:400]
