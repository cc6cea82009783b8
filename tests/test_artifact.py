"""The artifact: byte-identical for identical inputs, hash sensitive to every input, tampered or
older files refused, written atomically."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import pytest

from stepgraph import atomic_file
from stepgraph.artifact import encode, load_artifact, write_artifact
from stepgraph.compiler import compile_document
from stepgraph.errors import ArtifactError
from stepgraph.spec import Spec
from stepgraph.spec_loader import load_spec, override_deployment


@pytest.fixture(scope="module")
def tiny() -> Spec:
    return load_spec(Path(__file__).resolve().parent.parent / "models" / "tiny_k3.yaml")


def _compile(spec: Spec, **deployment: object) -> dict:
    document, _ = compile_document(spec, override_deployment(spec.deployment, **deployment))
    return document


def test_identical_inputs_identical_bytes(tiny: Spec, tmp_path: Path) -> None:
    first, second = tmp_path / "a.sgart", tmp_path / "b.sgart"
    write_artifact(_compile(tiny), first)
    write_artifact(_compile(tiny), second)
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize(
    "change",
    [{"tp": 2}, {"batches": (1, 2)}, {"q": 2, "batches": (2, 4)}, {"target": "h100"},
     {"dep": 2}],
)
def test_deployment_fields_change_the_hash(tiny: Spec, change: dict) -> None:
    assert _compile(tiny)["input_hash"] != _compile(tiny, **change)["input_hash"]


@pytest.mark.parametrize(
    ("old", "new"),
    [("hidden_size: 64", "hidden_size: 128"), ("beta: 4.0", "beta: 3.0"),
     ("block_size: 2", "block_size: 3"), ("top_k: 2", "top_k: 3"),
     ("norm_eps: 1.0e-5", "norm_eps: 1.0e-6")],
)
def test_spec_fields_change_the_hash(tiny: Spec, old: str, new: str) -> None:
    from stepgraph.spec_loader import parse_spec_text

    path = Path(__file__).resolve().parent.parent / "models" / "tiny_k3.yaml"
    text = path.read_text()
    assert old in text
    changed = parse_spec_text(text.replace(old, new, 1))
    first, second = _compile(tiny), _compile(changed)
    encode(first), encode(second)
    assert first["hash"] != second["hash"]
    assert _compile(tiny)["input_hash"] != _compile(changed)["input_hash"]


def test_round_trip(tiny: Spec, tmp_path: Path) -> None:
    path = tmp_path / "t.sgart"
    document = _compile(tiny)
    write_artifact(document, path)
    loaded = load_artifact(path)
    assert loaded.hash == document["hash"]
    assert len(loaded.graph) == len(document["graph"]["nodes"])


def _rewrite(path: Path, edit_body=None, edit_header=None, rehash: bool = False) -> None:
    """Edit an artifact file's body and/or header; ``rehash`` keeps the header's hash true."""
    header_line, _, body_line = gzip.decompress(path.read_bytes()).partition(b"\n")
    header, body = json.loads(header_line), json.loads(body_line)
    if edit_body:
        edit_body(body)
    body_bytes = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if rehash:
        header["hash"] = hashlib.sha256(body_bytes).hexdigest()
    if edit_header:
        edit_header(header)
    path.write_bytes(gzip.compress(json.dumps(header).encode() + b"\n" + body_bytes))


def test_unchanged_rewrite_still_loads(tiny: Spec, tmp_path: Path) -> None:
    """The helper above round-trips: the refusals below come from the edits alone."""
    path = tmp_path / "t.sgart"
    write_artifact(_compile(tiny), path)
    _rewrite(path)
    assert load_artifact(path).document["deployment"]["tp"] == 1


def test_tampered_artifact_is_refused(tiny: Spec, tmp_path: Path) -> None:
    path = tmp_path / "t.sgart"
    write_artifact(_compile(tiny), path)

    def edit(document: dict) -> None:
        document["deployment"]["tp"] = 4

    _rewrite(path, edit_body=edit)
    with pytest.raises(ArtifactError, match=r"content hash mismatch.*recompile"):
        load_artifact(path)


def test_older_format_is_refused(tiny: Spec, tmp_path: Path) -> None:
    path = tmp_path / "t.sgart"
    write_artifact(_compile(tiny), path)

    def edit(document: dict) -> None:
        document["format_version"] = 0

    _rewrite(path, edit_header=edit)
    with pytest.raises(ArtifactError, match="format version 0, this stepgraph reads version 1"):
        load_artifact(path)


def test_other_compiler_version_is_refused(tiny: Spec, tmp_path: Path) -> None:
    path = tmp_path / "t.sgart"
    write_artifact(_compile(tiny), path)

    def edit(document: dict) -> None:
        document["compiler_version"] = "0.0.1"

    _rewrite(path, edit_body=edit, rehash=True)
    with pytest.raises(ArtifactError, match=r"compiled by stepgraph 0\.0\.1"):
        load_artifact(path)


def test_garbage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.sgart"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(ArtifactError, match="not a stepgraph artifact"):
        load_artifact(path)
    with pytest.raises(ArtifactError, match="no such artifact"):
        load_artifact(tmp_path / "missing.sgart")


def test_atomic_write_leaves_no_partial_file(tiny: Spec, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.sgart"
    write_artifact(_compile(tiny), path)
    before = path.read_bytes()

    def crash(fd: int) -> None:
        raise OSError("disk died")

    monkeypatch.setattr(atomic_file.os, "fsync", crash)  # where the artifact's write syncs
    with pytest.raises(OSError, match="disk died"):
        write_artifact(_compile(tiny, tp=2), path)
    assert path.read_bytes() == before  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["t.sgart"]  # no temporary left behind


def test_encoding_is_deterministic(tiny: Spec) -> None:
    document = _compile(tiny)
    assert encode(document) == encode(json.loads(json.dumps(document)))
    assert len(document["hash"]) == 64
