"""Read a spec file: YAML -> :class:`stepgraph.spec.Spec`; errors name file, line and key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from stepgraph.errors import SpecError
from stepgraph.spec import Deployment, Spec


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate mapping keys."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.MarkedYAMLError(
                problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)
# YAML 1.1 reads 1e-5 as a string; accept the plain scientific form as a float.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based line of the YAML node at pydantic location ``loc`` (or its nearest parent)."""
    node, line = root, None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            match = None
            for key, value in node.value:
                if key.value == part:
                    match = (key, value)
                    break
            if match is None:
                break
            line = match[0].start_mark.line + 1
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


_UNION_TAGS = {"situ", "silu", "attn_res", "plain"}


def first_error(error: ValidationError,
                unknown_key: str = "unknown key") -> tuple[tuple[int | str, ...], str]:
    """The location (without pydantic's union tags) and a plain message of the first error
    of ``error``, with a count of the others appended; shared by every validated file."""
    first = error.errors()[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p in _UNION_TAGS))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = unknown_key
    elif first["type"] == "missing":
        message = "required key is missing"
    if error.error_count() > 1:
        message += f" (and {error.error_count() - 1} more)"
    return loc, message


def _format_validation(path: str, root: yaml.Node | None, error: ValidationError) -> str:
    loc, message = first_error(
        error, "unknown key (see `stepgraph schema` for the accepted keys)")
    line = _line_of(root, loc)
    key = ".".join(str(p) for p in loc) or "(top level)"
    where = f"{path}:{line}" if line else path
    return f"{where}: {key}: {message}"


def parse_spec_text(text: str, path: str = "<spec>") -> Spec:
    """Parse and validate spec YAML text; raise :class:`SpecError` with file:line: key: why."""
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{path}{line}: YAML error: {error.problem}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: YAML error: {error}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec is a mapping with `model:` (and optional `deployment:`)")
    try:
        return Spec.model_validate(data)
    except ValidationError as error:
        raise SpecError(_format_validation(path, root, error)) from None


def load_spec(path: str | Path) -> Spec:
    """Read and validate the spec file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read the spec ({type(error).__name__})") from None
    return parse_spec_text(text, str(path))


def override_deployment(base: Deployment, **changes: object) -> Deployment:
    """``base`` with the given fields replaced (None means keep); validated again."""
    data = base.model_dump()
    data.update({key: value for key, value in changes.items() if value is not None})
    try:
        return Deployment.model_validate(data)
    except ValidationError as error:
        loc, message = first_error(error)
        key = ".".join(str(p) for p in loc)
        raise SpecError(f"deployment: {key}: {message}" if key else f"deployment: {message}"
                        ) from None
