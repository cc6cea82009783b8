"""Write a variant of a target's tactic table with one tactic field set for every row and bin
of an op: the file to compile the B side of an A/B with (``stepgraph compile ... --tactics
VARIANT``, then ``scripts/ab_replay.py A.sgart B.sgart``).

Usage: python3 scripts/tactics_variant.py OP.FIELD=VALUE [...] -o variant.yaml
       [--target h200 | --table path.yaml] [--bin ROWS] [--shape NxK ...]

An op with a table gets FIELD in every bin of every row (appended when the table lists it as
an optional field and a bin leaves it out); ``--bin`` and ``--shape`` narrow that to one bin
and to the rows matching those weight shapes (e.g. another GEMV tile for two shapes at
one row: ``projection.m_tile=16 --bin 1 --shape 7168x1536 --shape 7168x3584``). An op without
one (mla_value, the router) gets a table of its own: one row matching every shape, one bin
serving every row count, the op's first provider, a field for each of its settings. A
section of the file instead of an op (``streams``, ``pdl``, ``prefetch``) gets its key set
(0 / 1 for a yes-no key). Example
(forms the H200 table leaves off, docs/perf.md):

    python3 scripts/tactics_variant.py routed_experts.combine=1 kda_core.out_norm=1 \\
        streams.join_lead=0 -o variant.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from stepgraph.tactics import parse_weight_shape, table_path
from stepgraph.tactics_variant import SECTIONS, VariantError, set_field, set_section_key


def main() -> int:
    """Parse the settings, write the variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", metavar="OP.FIELD=VALUE")
    parser.add_argument("-o", "--out", required=True)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--target", default="h200")
    source.add_argument("--table")
    parser.add_argument("--bin", type=int, help="set table fields in this bin only")
    parser.add_argument("--shape", action="append", default=[], metavar="NxK",
                        help="set table fields only in rows matching this weight shape")
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
    shapes = set()
    for shape in args.shape:
        parsed = parse_weight_shape(shape)
        if parsed is None:
            raise VariantError(f"--shape {shape!r} is not NxK (e.g. 7168x1536)")
        shapes.add(parsed)
    for setting in args.settings:
        key, _, value = setting.partition("=")
        op, _, field = key.partition(".")
        if not (op and field and value.lstrip("-").isdigit()):
            raise VariantError(f"{setting!r} is not OP.FIELD=INTEGER")
        if op in SECTIONS:
            set_section_key(data, op, field, int(value))
        else:
            set_field(data, op, field, int(value), args.bin, frozenset(shapes))
    narrowed = "".join([f"@bin{args.bin}" if args.bin else "", *(f"@{s}" for s in args.shape)])
    data["version"] = f"{data['version']}+{'+'.join(args.settings)}{narrowed}"
    Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {args.out}: {data['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
