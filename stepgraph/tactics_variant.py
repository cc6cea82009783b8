"""Tactic table variants: one tactic field of an op set in the bins of its table (the table
made when the op has none), or a key of a section (``streams``, ``pdl``, ``prefetch``) set.
Used by ``stepgraph tune --step`` and by ``scripts/tactics_variant.py``. No torch here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stepgraph.tactics import TableFile

SECTIONS = ("streams", "pdl", "prefetch")  # sections whose keys a setting may set
MADE = "scripts/tactics_variant.py"  # the source of a table made for an op without one


class VariantError(Exception):
    """A setting the table cannot take (printed as one ``error:`` line, exit status 2)."""


def check_section_key(section: str, key: str, values: Iterable[int]) -> type:
    """The type (``int`` or ``bool``) the table file's schema gives ``key`` of ``section``;
    a VariantError for a key it lacks or holds otherwise, or a yes/no key given other values
    than 0 and 1."""
    model = TableFile.model_fields[section].annotation
    fields = model.model_fields  # type: ignore[union-attr]
    keys = [k for k, f in fields.items() if f.annotation in (int, bool)]
    if key not in keys:
        raise VariantError(f"the table's {section} section has no integer or yes/no key "
                           f"{key!r} (keys: {', '.join(keys) or 'none'})")
    kind = fields[key].annotation
    if kind is bool and not set(values) <= {0, 1}:
        raise VariantError(f"{key} of {section} is yes/no: a yes/no key takes 0 and 1, not "
                           f"{sorted(set(values) - {0, 1})}")
    return kind


def set_section_key(data: dict[str, Any], section: str, key: str, value: int) -> None:
    """Set ``key`` of ``section`` in the file's data, typed as the schema types it (a
    yes/no key from 0 / 1); see :func:`check_section_key` for what is refused."""
    kind = check_section_key(section, key, (value,))
    data.setdefault(section, {})[key] = bool(value) if kind is bool else value


def set_field(data: dict[str, Any], op: str, field: str, value: int,
              only_bin: int | None = None, shapes: frozenset[tuple[int, int]] = frozenset()
              ) -> None:
    """Set ``field`` to ``value`` in every bin of ``op``'s table (made when it has none);
    ``only_bin``: in that bin only; ``shapes``: only in rows matching one of these (n, k)."""
    entry = data["ops"].get(op)
    if entry is None:
        raise VariantError(f"the table has no op {op!r} (ops: {', '.join(data['ops'])})")
    name = entry.get("table")
    if name is None:
        name = f"{op}_variant"
        entry["table"] = name
        provider = entry["providers"][0]
        data["tactics"][name] = {
            "provider": provider, "fields": [], "default": provider, "default_source": MADE,
            # one bin at 1 row: larger bins take the largest tabled bin
            "rows": [{"match": {}, "source": MADE, "bins": {1: []}}]}
    table = data["tactics"][name]
    fields = list(table["fields"])
    if field not in fields and table["default_source"] == MADE:  # a table made here grows
        table["fields"].append(field)
        table["rows"][0]["bins"][1].append(value)
        return
    if field not in fields:
        raise VariantError(f"table {name} has no field {field!r} (fields: "
                         f"{', '.join(fields)})")
    where = fields.index(field)
    changed = 0
    for row in table["rows"]:
        match = row.get("match", {})
        if shapes and (match.get("n"), match.get("k")) not in shapes:
            continue
        for rows, tactic in row["bins"].items():
            if isinstance(tactic, str) or (only_bin is not None and int(rows) != only_bin):
                continue  # a provider name (no tactic), or another bin
            if len(tactic) <= where:
                if where != len(tactic) or where < len(fields) - table.get("optional", 0):
                    missing = ", ".join(fields[len(tactic):where])
                    raise VariantError(f"{name} bin {rows} stops before {field}: set "
                                       f"{missing} first (settings apply in order, e.g. "
                                       f"{op}.{fields[len(tactic)]}=VALUE before "
                                       f"{op}.{field}=...)")
                tactic.append(value)
            else:
                tactic[where] = value
            changed += 1
    if not changed:
        raise VariantError(f"table {name} has no bin{f' {only_bin}' if only_bin else ''} in "
                           f"a row{' of those shapes' if shapes else ''} to set {field} in")
