"""Write the inputs of the H200 checks owed by issue 5 (docs/perf.md) into a folder:

* ``l4.yaml``: k3-rank-tp8's first four layers (``models/k3_rank_tp8.yaml`` at 4 layers, its
  MLA layer at 2), the stand-in for a whole rank in A/Bs;
* ``h200-seeds.yaml``: the H200 table with the measured no-TP projection rows of K3 TP8's
  in_proj (6288 x 7168) and MLA qkv_a (3648 x 7168) per-rank shapes given the bins of the
  seeds' TP8 rows of the same shape: compiled against ``h200.yaml`` it runs the seeds'
  tactics where the measured rows run theirs (check with ``stepgraph diff``).

Usage: python3 scripts/device/owed_inputs.py FOLDER
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SEEDED_SHAPES = ((6288, 7168), (3648, 7168))


def l4_spec() -> str:
    """k3_rank_tp8.yaml cut to four layers (MLA at layer 2)."""
    text = (ROOT / "models/k3_rank_tp8.yaml").read_text()
    for old, new in (("count: 12", "count: 4"), ("name: k3_rank_tp8", "name: k3_rank_tp8_l4"),
                     ('at: "2-10/4"', 'at: "2"')):
        if old not in text:
            raise SystemExit(f"models/k3_rank_tp8.yaml has no {old!r}: update owed_inputs.py")
        text = text.replace(old, new)
    return text


def seeds_table() -> dict:
    """h200.yaml with the measured rows of SEEDED_SHAPES given the seeds' TP8 bins."""
    table = yaml.safe_load((ROOT / "stepgraph/data/tactics/h200.yaml").read_text())
    rows = table["tactics"]["projection"]["rows"]
    for n, k in SEEDED_SHAPES:
        seeds = next(r for r in rows if r["match"] == {"n": n, "k": k, "tp": 8})
        measured = next(r for r in rows if r["match"] == {"n": n, "k": k})
        measured["bins"] = copy.deepcopy(seeds["bins"])
        measured["source"] = f"seeds A/B: the tp-8 row's bins ({measured['source']})"
    table["version"] = f"{table['version']}-seedsab"
    return table


def main() -> int:
    """Write both files into the folder named on the command line."""
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "l4.yaml").write_text(l4_spec())
    (folder / "h200-seeds.yaml").write_text(yaml.safe_dump(seeds_table(), sort_keys=False))
    print(f"wrote {folder}/l4.yaml and {folder}/h200-seeds.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
