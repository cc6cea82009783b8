"""The compiled artifact: a versioned, deterministic, hash-checked file.

Layout: gzip (mtime 0, so identical inputs give identical bytes) of two lines of canonical
JSON (sorted keys, no spaces):

1. the header: ``format`` ("stepgraph-artifact"), ``format_version`` and ``hash`` (sha256 of
   the body line's bytes: what :func:`load_artifact` checks before parsing the body);
2. the body: ``format``, ``format_version``, ``compiler_version``, ``spec`` (the model),
   ``deployment``, ``options`` (compile options), ``tables`` (tactic tables' target, version
   and digest), ``input_hash`` (sha256 over spec, deployment, options, tables and compiler
   version: the identity of what was compiled) and ``graph`` (values, nodes, meta).

In memory a document is the body with ``hash`` added.

Files are written atomically: a temporary file in the same folder, fsync, then rename.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepgraph import __version__
from stepgraph.atomic_file import writable_path, write_atomically
from stepgraph.errors import ArtifactError
from stepgraph.ir.graph import Graph
from stepgraph.ir.serialize import graph_from_json, graph_to_json

FORMAT = "stepgraph-artifact"
FORMAT_VERSION = 1


def canonical_json(data: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, compact separators, no NaN)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sha256(data: Any) -> str:
    """Hex sha256 of the canonical JSON of ``data``."""
    return hashlib.sha256(canonical_json(data)).hexdigest()


def input_hash(spec: dict[str, Any], deployment: dict[str, Any], options: dict[str, Any],
               tables: dict[str, Any]) -> str:
    """The identity of a compilation's inputs (changes with any spec/deployment field)."""
    return sha256({"spec": spec, "deployment": deployment, "options": options,
                   "tables": tables, "compiler_version": __version__})


@dataclass
class Artifact:
    """A loaded (or freshly compiled) artifact: its document and the graph it holds."""

    document: dict[str, Any]
    graph: Graph

    @property
    def hash(self) -> str:
        """The content hash."""
        return self.document["hash"]

    @property
    def deployment(self) -> dict[str, Any]:
        """The deployment it was compiled for."""
        return self.document["deployment"]

    @property
    def spec(self) -> dict[str, Any]:
        """The model spec it was compiled from."""
        return self.document["spec"]


def build_document(graph: Graph, spec: dict[str, Any], deployment: dict[str, Any],
                   options: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """The artifact document of a compiled graph (its ``hash`` is set by :func:`encode`)."""
    document = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "compiler_version": __version__,
        "spec": spec,
        "deployment": deployment,
        "options": options,
        "tables": tables,
        "input_hash": input_hash(spec, deployment, options, tables),
        "graph": graph_to_json(graph),
    }
    return document


def encode(document: dict[str, Any]) -> bytes:
    """The file bytes of a document (deterministic); sets ``document["hash"]``."""
    body = canonical_json({k: v for k, v in document.items() if k != "hash"})
    document["hash"] = hashlib.sha256(body).hexdigest()
    header = canonical_json({"format": FORMAT, "format_version": FORMAT_VERSION,
                             "hash": document["hash"]})
    return gzip.compress(header + b"\n" + body, compresslevel=6, mtime=0)


def write_artifact(document: dict[str, Any], path: str | Path) -> int:
    """Write atomically (no partial file is left if the process dies midway); returns the
    file's size in bytes."""
    path = writable_path(path)
    data = encode(document)
    write_atomically(path, data)
    return len(data)


def read_document(path: str | Path) -> dict[str, Any]:
    """Read and check an artifact file: format, version, compiler version and hash."""
    path = Path(path)
    recompile = "recompile it with `stepgraph compile`"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a folder, not an artifact") from None
    corrupt = ArtifactError(f"{path}: not a stepgraph artifact or corrupted ({recompile})")
    try:
        header_line, _, body = gzip.decompress(raw).partition(b"\n")
        header = json.loads(header_line)
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError):
        raise corrupt from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a stepgraph artifact ({recompile})")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {version}, this stepgraph reads version "
            f"{FORMAT_VERSION}: {recompile}"
        )
    if header.get("hash") != hashlib.sha256(body).hexdigest():
        raise ArtifactError(
            f"{path}: content hash mismatch (the file was modified or corrupted): {recompile}"
        )
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise corrupt from None
    if (document.get("format"), document.get("format_version")) != (FORMAT, FORMAT_VERSION):
        raise corrupt
    compiler = document.get("compiler_version")
    if compiler != __version__:
        raise ArtifactError(
            f"{path}: compiled by stepgraph {compiler}, this is stepgraph {__version__}: "
            f"{recompile}"
        )
    document["hash"] = header["hash"]
    return document


def load_artifact(path: str | Path) -> Artifact:
    """Read, check and rebuild the graph of an artifact file."""
    document = read_document(path)
    try:
        graph = graph_from_json(document["graph"])
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactError(f"{path}: malformed graph section ({error})") from None
    return Artifact(document, graph)
