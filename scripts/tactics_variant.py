"""Write a variant of a target's tactic table with one tactic field set for every row and bin
of an op: the file to compile the B side of an A/B with (``stepgraph compile ... --tactics
VARIANT``, then ``scripts/ab_replay.py A.sgart B.sgart``).

Usage: python3 scripts/tactics_variant.py OP.FIELD=VALUE [...] -o variant.yaml
       [--target h200 | --table path.yaml]

An op with a table gets FIELD in every bin of every row (appended when the table lists it as
an optional field and a bin leaves it out). An op without one (kda_core, mla_query) gets a
table of its own: one row matching every shape, one bin serving every row count, the op's
first provider. A section of the file instead of an op (``fuse``, ``streams``, ``pdl``)
gets its key set (0 / 1 for a yes-no key). Example (the ninth session's forms, all off by
default):

    python3 scripts/tactics_variant.py routed_experts.combine=1 kda_core.out_norm=1 \\
        mla_query.norm_inside=1 fuse.mix_epilogue=1 streams.join_lead=0 -o fused.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from stepgraph.tactics import table_path

SECTIONS = ("fuse", "streams", "pdl", "prefetch")  # sections whose keys a setting may set


class VariantError(Exception):
    """A setting the table cannot take (printed as one ``error:`` line, exit status 2)."""


def set_field(data: dict[str, Any], op: str, field: str, value: int) -> None:
    """Set ``field`` to ``value`` in every bin of ``op``'s table (made when it has none)."""
    entry = data["ops"].get(op)
    if entry is None:
        raise VariantError(f"the table has no op {op!r} (ops: {', '.join(data['ops'])})")
    name = entry.get("table")
    if name is None:
        name = f"{op}_variant"
        entry["table"] = name
        provider = entry["providers"][0]
        data["tactics"][name] = {
            "provider": provider, "fields": [field], "default": provider,
            "default_source": "scripts/tactics_variant.py",
            # one bin at 1 row: larger bins take the largest tabled bin
            "rows": [{"match": {}, "source": "scripts/tactics_variant.py",
                      "bins": {1: [value]}}]}
        return
    table = data["tactics"][name]
    fields = list(table["fields"])
    if field not in fields:
        raise VariantError(f"table {name} has no field {field!r} (fields: "
                         f"{', '.join(fields)})")
    where = fields.index(field)
    for row in table["rows"]:
        for rows, tactic in row["bins"].items():
            if isinstance(tactic, str):
                continue  # a provider name, no tactic
            if len(tactic) <= where:
                if where != len(tactic) or where < len(fields) - table.get("optional", 0):
                    raise VariantError(f"{name} bin {rows} stops before {field}: set the "
                                     f"fields before it in the table first")
                tactic.append(value)
            else:
                tactic[where] = value


def main() -> int:
    """Parse the settings, write the variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", metavar="OP.FIELD=VALUE")
    parser.add_argument("-o", "--out", required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--target", default="h200")
    source.add_argument("--table")
    args = parser.parse_args()
    try:
        return write_variant(args)
    except (VariantError, OSError, yaml.YAMLError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def write_variant(args: argparse.Namespace) -> int:
    """Read the table, apply the settings, write the variant."""
    path = Path(args.table) if args.table else table_path(args.target)
    data = yaml.safe_load(path.read_text())
    for setting in args.settings:
        key, _, value = setting.partition("=")
        op, _, field = key.partition(".")
        if not (op and field and value.lstrip("-").isdigit()):
            raise VariantError(f"{setting!r} is not OP.FIELD=INTEGER")
        if op in SECTIONS:
            data.setdefault(op, {})[field] = int(value)
        else:
            set_field(data, op, field, int(value))
    data["version"] = f"{data['version']}+{'+'.join(args.settings)}"
    Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {args.out}: {data['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
