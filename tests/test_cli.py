"""The CLI as a user meets it: compile K3, inspect it, and one-line errors with exit status 2."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, run_cli

K3 = "models/kimi_k3.yaml"
TINY = "models/tiny_k3.yaml"


@pytest.fixture(scope="module")
def k3_tp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k3") / "k3-tp8.sgart"
    result = run_cli("compile", K3, "--tp", "8", "-o", str(path))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout
    return path


@pytest.fixture(scope="module")
def k3_tp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("k3") / "k3-tp1.sgart"
    result = run_cli("compile", K3, "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


def test_compile_path_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from stepgraph.cli import main\n"
        f"assert main(['compile', {K3!r}, '--tp', '8', '-o', {str(tmp_path / 'a.sgart')!r}]) == 0\n"
        f"assert main(['inspect', {str(tmp_path / 'a.sgart')!r}, '--summary']) == 0\n"
        f"assert main(['diff'] + [{str(tmp_path / 'a.sgart')!r}] * 2) == 0\n"
        f"assert main(['inspect', {str(tmp_path / 'a.sgart')!r}, '--floor']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('NO_TORCH')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "NO_TORCH" in result.stdout


def test_inspect_json_counts_and_tp1_shapes(k3_tp1: Path) -> None:
    result = run_cli("inspect", str(k3_tp1), "--format", "json", "--summary")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    layers = data["layers"]
    assert len(layers) == 93
    assert sum(x["attention"] == "kda" for x in layers) == 69
    assert sum(x["attention"] == "mla" for x in layers) == 24
    assert [x["index"] for x in layers if x["mlp"] == "dense"] == [0]
    assert sum(x["mlp"] == "moe" for x in layers) == 92
    weights = {w["name"]: w for w in data["weights"]}
    in_proj = weights["layers.1.self_attn.in_proj_qkvgfab"]
    assert in_proj["shape"] == [49376, 7168]
    assert in_proj["dtype"] == "bfloat16" and in_proj["bytes"] == 49376 * 7168 * 2
    assert weights["layers.1.self_attn.o_proj"]["shape"] == [7168, 12288]
    assert {b["rows"] for b in data["bins"]} == {1, 2, 4, 8, 16, 32, 64}
    for entry in data["bins"]:
        memory = entry["memory"]
        assert memory["lower_bound_bytes"] <= memory["arena_bytes"] <= memory["naive_bytes"]


def test_inspect_text_summary(k3_tp1: Path) -> None:
    result = run_cli("inspect", str(k3_tp1), "--layer", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "attention 69 kda + 24 mla; mlp 1 dense + 92 moe" in out
    assert "layers.3.self_attn" in out and "// layer 3: attention" in out
    assert "// layer 4:" not in out


def test_inspect_tp8_per_rank_shapes(k3_tp8: Path) -> None:
    data = json.loads(run_cli("inspect", str(k3_tp8), "--format", "json", "--summary").stdout)
    weights = {w["name"]: w["shape"] for w in data["weights"]}
    assert weights["layers.1.self_attn.in_proj_qkvgfab"] == [6288, 7168]
    assert weights["layers.1.self_attn.o_proj"] == [7168, 1536]
    assert data["world"] == 8


def test_inspect_says_which_launches_stand_outside_the_pdl_chain(k3_tp8: Path,
                                                                 tmp_path: Path) -> None:
    """At TP8 every collective stands outside the PDL chain (NCCL launches it without the
    attribute), so does the launch after one and the step's first launch; the o-projections
    (7168 x 1536 a rank, split-K from the row measured at that per-rank shape) wait in it.
    The text summary counts them per bin; a --no-pdl compile says PDL is off."""
    data = json.loads(run_cli("inspect", str(k3_tp8), "--format", "json", "--summary").stdout)
    chain = data["pdl"]
    assert chain["enabled"] and chain["launches"] == data["launches"]
    collectives = sum(data["collectives"].values())
    assert collectives == 187 + 93 + 92
    for rows, entry in chain["bins"].items():
        off = entry["off_chain"]
        assert entry["in_chain"] + len(off) == data["launches"]
        assert sum(op in data["collectives"] for op in off.values()) == collectives, rows
        assert {"embed", "embedded.all_reduce", "l0.in_proj"} <= set(off), rows
        assert not any(op == "o_proj" for op in off.values()), rows
    text = run_cli("inspect", str(k3_tp8), "--summary").stdout
    first = next(line for line in text.splitlines() if line.startswith("pdl "))
    assert f"rows 1: {chain['bins']['1']['in_chain']} of {data['launches']} launches" in first
    assert "187 all_reduce" in first
    plain = tmp_path / "plain.sgart"
    assert run_cli("compile", K3, "--tp", "8", "--no-pdl", "-o", str(plain)).returncode == 0
    assert "pdl        off (compiled with --no-pdl)" in run_cli("inspect", str(plain),
                                                             "--summary").stdout


@pytest.mark.parametrize("form", ["dot", "mermaid"])
def test_inspect_graph_forms(k3_tp8: Path, form: str) -> None:
    result = run_cli("inspect", str(k3_tp8), "--format", form, "--layer", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("digraph" if form == "dot" else "flowchart")


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_compile_line_names_the_tactic_tables(tmp_path: Path, target: str) -> None:
    """The line `compile` prints names the tables it compiled with, and says so where the
    target has none of its own (a typo or a new GPU gets the portable path, not a silent
    slow step)."""
    result = run_cli("compile", TINY, "--target", target, "-o", str(tmp_path / "t.sgart"))
    assert result.returncode == 0, result.stderr
    if target == "h200":
        version = yaml.safe_load((ROOT / "stepgraph/data/tactics/h200.yaml").read_text())[
            "version"]
        assert f"target h200 (tables {version})" in result.stdout
        assert "no tactic table" not in result.stdout
    else:
        version = yaml.safe_load((ROOT / "stepgraph/data/tactics/default.yaml").read_text())[
            "version"]
        assert (f"target b200 (no tactic table of its own: the portable {version} tables"
                in result.stdout)
    summary = run_cli("inspect", str(tmp_path / "t.sgart"), "--summary").stdout
    assert f"target {target} (" in summary and version in summary
    data = json.loads(run_cli("inspect", str(tmp_path / "t.sgart"), "--format", "json",
                              "--summary").stdout)
    assert data["tables"]["version"] == version
    assert data["tables"]["target"] == ("h200" if target == "h200" else "default")


def test_schema_command() -> None:
    result = run_cli("schema")
    assert result.returncode == 0
    assert json.loads(result.stdout)["title"] == "Spec"


def test_top_level_help_names_every_command_and_its_examples_parse(
        capsys: pytest.CaptureFixture[str]) -> None:
    from stepgraph.cli import COMMANDS, build_parser

    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("compile", "inspect", "dump", "schema", "run", "import-hf", "bench", "tune"):
        assert f"    {command} " in result.stdout, command
    assert "``" not in result.stdout and ":mod:" not in result.stdout
    examples = [line.split("(")[0].split()[1:] for line in result.stdout.splitlines()
                if line.startswith("  stepgraph ")]
    assert len(examples) >= 3
    for argv in examples:
        assert build_parser().parse_args(argv).command == argv[0]
    for name in (command.replace("_", "-") for command in COMMANDS):
        with pytest.raises(SystemExit):
            build_parser().parse_args([name, "--help"])
        opening = capsys.readouterr().out.split("\n\n")[1]
        assert not opening.startswith(("positional", "options")), name
        assert len(opening.split()) >= 4, (name, opening)


def _error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_error_missing_spec(tmp_path: Path) -> None:
    line = _error(run_cli("compile", "nope.yaml", "-o", str(tmp_path / "x")))
    assert line == "error: nope.yaml: no such spec file"


def test_error_unknown_key_has_line(tmp_path: Path) -> None:
    text = (ROOT / TINY).read_text().replace("  hidden_size: 64\n", "  hidden_size: 64\n  foo: 1\n")
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    line_no = text.splitlines().index("  foo: 1") + 1
    line = _error(run_cli("compile", str(spec), "-o", str(tmp_path / "x")))
    assert line.startswith(f"error: {spec}:{line_no}: model.foo: unknown key")
    assert not (tmp_path / "x").exists()


def test_error_heads_not_divisible(tmp_path: Path) -> None:
    out = tmp_path / "x.sgart"
    line = _error(run_cli("compile", K3, "--tp", "7", "-o", str(out)))
    assert "tp=7" in line and "96" in line and "heads" in line
    assert not out.exists()


def test_error_dcp_without_tp(tmp_path: Path) -> None:
    line = _error(run_cli("compile", K3, "--dcp", "8", "-o", str(tmp_path / "x")))
    assert "dcp" in line


def test_error_bad_batches(tmp_path: Path) -> None:
    line = _error(run_cli("compile", TINY, "--batches", "1,two", "-o", str(tmp_path / "x")))
    assert "--batches" in line


def test_error_bad_flag_value(tmp_path: Path) -> None:
    line = _error(run_cli("compile", TINY, "--tp", "x", "-o", str(tmp_path / "x")))
    assert "--tp" in line


def test_error_missing_output_folder(tmp_path: Path) -> None:
    line = _error(run_cli("compile", TINY, "-o", str(tmp_path / "no" / "x.sgart")))
    assert "does not exist" in line


def test_error_missing_tactics_file(tmp_path: Path) -> None:
    missing = tmp_path / "mine.yaml"
    line = _error(run_cli("compile", TINY, "--tactics", str(missing), "-o",
                          str(tmp_path / "x.sgart")))
    assert line == f"error: {missing}: no such tactic table file"
    assert not (tmp_path / "x.sgart").exists()


def test_error_bad_artifact(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sgart"
    junk.write_text("hello")
    assert "not a stepgraph artifact" in _error(run_cli("inspect", str(junk)))


def test_error_bad_layer_and_bin(k3_tp8: Path) -> None:
    assert "--layer 93" in _error(run_cli("inspect", str(k3_tp8), "--layer", "93"))
    assert "--bin 3" in _error(run_cli("inspect", str(k3_tp8), "--bin", "3", "--memory"))


def test_inspect_checks_every_flag_before_it_prints(k3_tp8: Path, tmp_path: Path) -> None:
    """A bad --layer, --bin or output path is refused before any line reaches stdout, and no
    file is left where the path pointed."""
    missing = tmp_path / "nope"
    cases = {
        ("--layer", "93"): "--layer 93: the model has layers 0..92",
        ("--layer", "3", "--bin", "3"): "--bin 3: the artifact's bins are",
        ("--trace", str(missing / "t.json")): f"folder {missing} does not exist",
        ("--trace", str(tmp_path)): "is a folder",
        ("--memory", str(missing / "a.png")): f"folder {missing} does not exist",
        ("--memory", str(tmp_path / "a.txt")): "drawn as .png or .svg",
    }
    for flags, expected in cases.items():
        result = run_cli("inspect", str(k3_tp8), *flags)
        assert expected in _error(result), flags
        assert result.stdout == "", flags
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_output_folders_are_checked_before_the_work(k3_tp8: Path, tmp_path: Path) -> None:
    """run, bench, tune and import-hf refuse an output path in a missing folder up front (tune
    and bench would otherwise fail only after minutes of GPU work)."""
    missing = tmp_path / "nope"
    cases = [
        ("run", TINY, "--weights", "random", "--tokens", "1", "--logits-out",
         str(missing / "l.npy")),
        ("bench", str(k3_tp8), "--weights", "random", "--json", str(missing / "b.json")),
        ("tune", str(k3_tp8), "--out", str(missing / "t.yaml")),
    ]
    for args in cases:
        assert f"folder {missing} does not exist" in _error(run_cli(*args)), args[0]


def test_a_deployment_flag_that_breaks_a_rule_names_it_once(tmp_path: Path) -> None:
    line = _error(run_cli("compile", TINY, "--q", "3", "-o", str(tmp_path / "x.sgart")))
    assert line.startswith("error: deployment: batch bins") and line.count("deployment:") == 1
    assert "not multiples of q=3" in line


def test_inspect_floor_counts_the_bytes_a_rank_step_moves(k3_tp8: Path) -> None:
    """K3 at TP8, one rank: each of the 92 MoE layers holds 112 of the 896 experts, so one row
    (top 16 of 896) is expected to touch 2 of them, each expert whole (gate_up 6144 x 3584 and
    down 3584 x 3072 on the 3584-wide latent, bf16). The floor is the bytes over the h200
    table's 4.8 TB/s, or over --bandwidth."""
    result = run_cli("inspect", str(k3_tp8), "--floor", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["bandwidth_bytes_per_s"] == 4.8e12 and data["context"] == 4096
    one = data["bins"][0]
    per_expert = (6144 * 3584 + 3584 * 3072) * 2
    assert one["rows"] == 1 and one["local_experts"] == 112
    assert one["experts_touched"] == pytest.approx(2.0)
    assert one["experts"] == 92 * 2 * per_expert
    assert one["total"] == one["weights"] + one["experts"] + one["cache"] + one["activations"]
    assert one["floor_us"] == pytest.approx(one["total"] / 4.8e12 * 1e6, abs=0.01)
    assert [b["rows"] for b in data["bins"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(a["total"] < b["total"] for a, b in itertools.pairwise(data["bins"]))
    assert sum(op["bytes"] for op in data["by_op"]["ops"]) == one["total"]
    slower = json.loads(run_cli("inspect", str(k3_tp8), "--floor", "--format", "json",
                                "--bandwidth", "2.4", "--context", "8192").stdout)
    # the 24 MLA layers each read 4096 more cached tokens of 512 + 64 BF16 latent values
    assert slower["bins"][0]["cache"] > one["cache"]
    assert slower["bins"][0]["cache"] - one["cache"] == 24 * 4096 * 576 * 2
    assert slower["bins"][0]["floor_us"] == pytest.approx(
        slower["bins"][0]["total"] / 2.4e12 * 1e6, abs=0.01)
    summary = json.loads(run_cli("inspect", str(k3_tp8), "--summary", "--format", "json").stdout)
    assert [b["rows"] for b in summary["floor"]["bins"]] == [1, 64]
    assert summary["floor"]["bins"][0]["bytes"] == one["total"]
    assert "floor      rows 1: " in run_cli("inspect", str(k3_tp8), "--summary").stdout
    text = run_cli("inspect", str(k3_tp8), "--floor", "--bin", "64").stdout
    assert "bin 64: where the floor goes" in text and "routed_experts     92 x" in text
    for flags, expected in ((("--bandwidth", "0"), "--bandwidth 0: give the bandwidth"),
                            (("--context", "0"), "--context 0: give the cached tokens")):
        assert expected in _error(run_cli("inspect", str(k3_tp8), "--floor", *flags))


def test_error_unknown_pass(tmp_path: Path) -> None:
    line = _error(run_cli("compile", TINY, "-o", str(tmp_path / "x"), "--dump-after", "nope",
                          str(tmp_path)))
    assert "no such pass" in line
    line = _error(run_cli("dump", TINY, "--after", "nope"))
    assert "no such pass" in line


def test_dump_after_all(tmp_path: Path) -> None:
    result = run_cli("compile", TINY, "--tp", "2", "-o", str(tmp_path / "t.sgart"),
                     "--dump-after", "all", str(tmp_path / "dump"), "--verbose")
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == ["00-frontend.txt", "01-shard.txt", "02-pack.txt", "03-fuse.txt",
                     "04-bin.txt", "05-schedule.txt", "06-streams.txt", "07-pdl.txt",
                     "08-alias.txt"]
    assert "shard" in result.stderr and " ms " in result.stderr
    sharded = (tmp_path / "dump" / "01-shard.txt").read_text()
    assert "all_reduce" in sharded


def test_dump_command_prints_ir() -> None:
    result = run_cli("dump", TINY, "--after", "pack", "--layer", "1")
    assert result.returncode == 0, result.stderr
    assert "in_proj_qkvgfab" in result.stdout
