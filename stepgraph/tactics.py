"""Tactic tables: versioned data files (``stepgraph/data/tactics/<target>.yaml``) that say, per
target GPU, which providers each op may use, the split-K tactics of projections per row bin,
the per-kind row caps, and the hardware figures estimates use.

``load_tables(target)`` reads ``<target>.yaml`` (``default.yaml`` for targets without one),
validates it, and returns :class:`TacticTables` with the file's ``version`` and ``digest``
(the sha256 of its bytes, which the artifact hashes). Lookups follow the seeds' rule: rows
use the NEXT tabled bin at or above them, and the largest bin past the end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stepgraph.atomic_file import write_atomically
from stepgraph.errors import UserError
from stepgraph.ir.ops import OPS
from stepgraph.spec_loader import first_error

TABLES_DIR = Path(__file__).parent / "data" / "tactics"
MATCH_KEYS = ("n", "k", "tp", "q", "verify", "top_k")


class TacticsError(UserError):
    """A tactic table file that is missing, malformed or inconsistent."""


# ----------------------------------------------------------------------------- file schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hardware(_Strict):
    """Hardware figures of the target; used by estimates (traces), never by decisions."""

    hbm_bytes_per_s: float
    link_bytes_per_s: float
    l2_bytes: int
    sms: int
    launch_gap_us: float
    kernel_floor_us: float
    collective_floor_us: float
    source: str


class PdlRule(_Strict):
    """How many weight bytes a launch may load before its PDL wait, and what a launch
    outside the PDL chain (cuBLAS) costs the step beyond its own time."""

    tiles_before_wait: int
    tile_bytes: int
    cublas_break_us: float = Field(default=0.0, ge=0.0)
    source: str


class PrefetchRule(_Strict):
    """Where the pdl pass forks L2 prefetches and how many bytes one warms: ``rule``
    ``seeds`` (the seeds' two fork points a layer, warming the MLP's weights) or
    ``next_weights`` (after each weight-streaming launch followed by small ones, warming the
    next streaming launch's weights; ``stream_min_bytes`` makes a launch streaming)."""

    fork_budget_bytes: int
    rule: Literal["seeds", "next_weights"] = "seeds"
    stream_min_bytes: int = 4194304
    source: str


class StreamRule(_Strict):
    """Ops the streams pass runs on a side stream, beside the main launch chain (none: one
    stream); ``join_lead``: join that many main-stream launches before the first reader
    (the launch carrying the join also waits on the branch's last launch); ``root_fork``: a
    graph with side branches also forks one empty launch onto the side stream at its root
    (before the step's first launch), joined at the step's end; ``signal``: a branch is
    joined at its first reader by a flag its last launch sets and the reader's launch waits
    on (no graph edge; a reader that cannot wait gets the graph join there), instead of at
    ``join_lead``."""

    side_ops: tuple[str, ...] = ()
    join_lead: int = Field(default=0, ge=0)
    root_fork: bool = False
    signal: bool = False
    source: str = "no side stream"


class Cap(_Strict):
    """Rows above which a kind takes the stock path (None: no cap); ``dcp_rows`` under DCP."""

    rows: int | None
    dcp_rows: int | None = None
    source: str


class ProviderInfo(_Strict):
    """What a provider can do: launch with PDL, or perform a host-side operation."""

    pdl: bool
    host: bool = False
    note: str


class OpProviders(_Strict):
    """An op's providers on this target (preferred first) and its tactic table, if any."""

    providers: tuple[str, ...]
    table: str | None = None


class TacticRow(_Strict):
    """One table row: what it matches, where its figures come from, and its bins."""

    match: dict[str, int | bool]
    source: str
    bins: dict[int, list[int] | str]


class TacticTable(_Strict):
    """Tactics of one provider (``fields`` name a tactic's numbers) with a default; a bin may
    leave out the last ``optional`` fields (the provider's defaults then hold)."""

    provider: str
    fields: tuple[str, ...]
    optional: int = 0
    default: str
    default_source: str
    rows: tuple[TacticRow, ...] = ()


class TableFile(_Strict):
    """A whole tactic table file."""

    format: int
    target: str
    version: str
    description: str
    hardware: Hardware
    pdl: PdlRule
    prefetch: PrefetchRule
    streams: StreamRule = StreamRule()
    caps: dict[str, Cap]
    providers: dict[str, ProviderInfo]
    ops: dict[str, OpProviders]
    tactics: dict[str, TacticTable]

    @model_validator(mode="after")
    def _consistent(self) -> TableFile:
        if self.format != 1:
            raise ValueError(f"format {self.format} is not supported (this stepgraph reads 1)")
        missing = sorted(set(OPS) - set(self.ops))
        if missing:
            raise ValueError(f"ops without providers: {', '.join(missing)}")
        for op in self.streams.side_ops:
            if op not in OPS:
                raise ValueError(f"streams.side_ops: unknown op {op!r}")
            if OPS[op].category != "compute":
                raise ValueError(f"streams.side_ops: {op} is not a compute op (only those "
                                 "run on a side stream)")
        for op, entry in self.ops.items():
            if not entry.providers:
                raise ValueError(f"op {op} lists no provider")
            for name in entry.providers:
                if name not in self.providers:
                    raise ValueError(f"op {op}: unknown provider {name!r}")
            if entry.table is None:
                continue
            table = self.tactics.get(entry.table)
            if table is None:
                raise ValueError(f"op {op}: no tactic table {entry.table!r}")
            if table.provider not in entry.providers or table.default not in entry.providers:
                raise ValueError(f"op {op}: table {entry.table} uses providers the op lacks")
            if not 0 <= table.optional <= len(table.fields):
                raise ValueError(f"tactics.{entry.table}: optional {table.optional} must be "
                                 f"0..{len(table.fields)} (the number of trailing fields a bin "
                                 "may leave out)")
            for index, row in enumerate(table.rows):
                where = f"tactics.{entry.table}.rows[{index}]"
                bad = sorted(set(row.match) - set(MATCH_KEYS))
                if bad:
                    raise ValueError(f"{where}: unknown match keys {bad} (use {MATCH_KEYS})")
                if not row.bins or min(row.bins) < 1:
                    raise ValueError(f"{where}: bins must be positive row counts")
                for rows, tactic in row.bins.items():
                    if isinstance(tactic, str):
                        if tactic not in entry.providers:
                            raise ValueError(f"{where}: bin {rows}: provider {tactic!r} not "
                                             f"allowed for op {op}")
                    elif not (len(table.fields) - table.optional <= len(tactic)
                              <= len(table.fields)):
                        raise ValueError(f"{where}: bin {rows}: {len(tactic)} numbers for "
                                         f"fields {list(table.fields)} (the last "
                                         f"{table.optional} optional)")
        return self


# ----------------------------------------------------------------------------- lookups


def row_matches(match: Mapping[str, int | bool], facts: Mapping[str, int | bool]) -> bool:
    """Whether a table row's ``match`` holds for a lookup's ``facts`` (every key it names
    equal; a key it leaves out matches anything)."""
    return all(facts.get(key) == value for key, value in match.items())


def next_bin(rows: int, bins: Iterable[int]) -> int:
    """The seeds' rule: the smallest tabled bin holding ``rows``, else the largest bin."""
    ordered = sorted(bins)
    return next((b for b in ordered if rows <= b), ordered[-1])


@dataclass(frozen=True)
class Choice:
    """A looked-up decision: ``provider``, ``tactic`` (field -> number, empty for none),
    a readable ``reason``, and the table row (``table#index``) and tabled bin it came from."""

    provider: str
    tactic: dict[str, int] = field(default_factory=dict, compare=False)
    reason: str = ""
    row: str | None = None
    bin: int | None = None


@dataclass
class TacticTables:
    """A loaded tactic table file: ``target``, ``version``, ``digest`` (sha256 of the file
    bytes), ``path``, and the validated content in ``data``."""

    target: str
    version: str
    digest: str
    path: str
    data: TableFile
    _cache: dict[tuple[Any, ...], Choice] = field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        """``target tables version`` for messages."""
        return f"{self.data.target} tables {self.version}"

    def providers(self, op: str) -> tuple[str, ...]:
        """The providers ``op`` may use, preferred first."""
        entry = self.data.ops.get(op)
        if entry is None:
            raise TacticsError(f"{self.path}: op {op!r} has no providers in {self.label}")
        return entry.providers

    def provider_info(self, name: str) -> ProviderInfo:
        """What provider ``name`` can do (PDL, host-side)."""
        info = self.data.providers.get(name)
        if info is None:
            raise TacticsError(f"{self.path}: unknown provider {name!r} in {self.label}")
        return info

    def cap(self, kind: str, dcp: bool = False) -> int | None:
        """The most rows ``kind`` takes on the specialized path (None: no cap or no entry)."""
        entry = self.data.caps.get(kind)
        if entry is None:
            return None
        if dcp and entry.dcp_rows is not None:
            return entry.dcp_rows
        return entry.rows

    def cap_source(self, kind: str) -> str:
        """Where ``kind``'s cap comes from."""
        entry = self.data.caps.get(kind)
        return entry.source if entry is not None else "no cap entry"

    def step_cap(self, kinds: Sequence[str], dcp: bool = False) -> int | None:
        """The smallest cap over ``kinds`` (the model's attention kinds); None: uncapped."""
        caps = [c for c in (self.cap(k, dcp) for k in kinds) if c is not None]
        return min(caps) if caps else None

    @property
    def hardware(self) -> Hardware:
        """The target's hardware figures (for estimates)."""
        return self.data.hardware

    @property
    def pre_wait_bytes(self) -> int:
        """The most weight bytes one launch loads before its PDL wait."""
        rule = self.data.pdl
        return self.data.hardware.sms * rule.tiles_before_wait * rule.tile_bytes

    @property
    def prefetch(self) -> PrefetchRule:
        """Where prefetch forks go and how many bytes they warm."""
        return self.data.prefetch

    @property
    def streams(self) -> StreamRule:
        """Which ops run on a side stream."""
        return self.data.streams

    def choose(self, op: str, rows: int, n: int | None = None, k: int | None = None,
               tp: int = 1, q: int = 1, top_k: int | None = None) -> Choice:
        """The provider and tactic of ``op`` at ``rows`` rows (weight ``n`` x ``k``, TP
        degree ``tp``, ``q`` tokens a request, ``top_k`` experts a row for the MoE's ops).
        Results are cached per key."""
        key = (op, rows, n, k, tp, q, top_k)
        found = self._cache.get(key)
        if found is None:
            found = self._choose(op, rows, n, k, tp, q, top_k)
            self._cache[key] = found
        return found

    def _choose(self, op: str, rows: int, n: int | None, k: int | None, tp: int,
                q: int, top_k: int | None) -> Choice:
        providers = self.providers(op)
        entry = self.data.ops[op]
        if entry.table is None:
            listed = "|".join(providers)
            return Choice(providers[0], {}, f"{self.label}: {op} -> {providers[0]} (first of "
                          f"{listed}; no tactic table for {op})")
        table = self.data.tactics[entry.table]
        facts: dict[str, int | bool] = {"tp": tp, "q": q, "verify": q > 1}
        if n is not None:
            facts["n"] = n
        if k is not None:
            facts["k"] = k
        if top_k is not None:
            facts["top_k"] = top_k
        shape = (f"n={n} k={k} tp={tp}" + (f" q={q}" if q > 1 else "")
                 + (f" top_k={top_k}" if top_k is not None else ""))
        for index, row in enumerate(table.rows):
            if row_matches(row.match, facts):
                tabled = next_bin(rows, row.bins)
                value = row.bins[tabled]
                where = f"{entry.table}#{index}"
                rule = ("the largest bin: rows past the last" if rows > tabled
                        else "the next tabled bin at or above the rows")
                head = f"{self.label}: row {where} [{shape}], bin {tabled} ({rule})"
                if isinstance(value, str):
                    return Choice(value, {}, f"{head}: {value} ({row.source})", where, tabled)
                tactic = dict(zip(table.fields, value, strict=False))  # optional: left out
                text = " ".join(f"{f}={v}" for f, v in tactic.items())
                return Choice(table.provider, tactic, f"{head}: {table.provider} {text} "
                              f"({row.source})", where, tabled)
        return Choice(table.default, {}, f"{self.label}: no {entry.table} row for [{shape}]: "
                      f"default {table.default} ({table.default_source})")


# ----------------------------------------------------------------------------- loading

_PARSED: dict[str, TableFile] = {}


def table_path(target: str) -> Path:
    """The file ``load_tables(target)`` reads: ``<target>.yaml`` or ``default.yaml``."""
    own = TABLES_DIR / f"{target}.yaml"
    return own if own.is_file() else TABLES_DIR / "default.yaml"


def _one_line(path: Path, error: ValidationError) -> str:
    loc, message = first_error(error)
    key = ".".join(str(p) for p in loc) or "(top level)"
    return f"{path}: {key}: {message}"


def parse_weight_shape(text: str) -> tuple[int, int] | None:
    """``"560x7168"`` -> ``(560, 7168)``: a per-rank weight shape N x K as table rows match
    it; None unless the text is NxK with positive sizes."""
    n, sep, k = text.strip().lower().partition("x")
    if not (sep and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
        return None
    return int(n), int(k)


# libyaml's safe loader where PyYAML was built with it (the same documents, ~8x faster on
# the H200 table); the pure-Python one otherwise.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_tables(target: str, path: str | Path | None = None) -> TacticTables:
    """The tactic tables of ``target`` (or of the file at ``path``), validated.

    ``digest`` is the sha256 of the file's bytes; parsed content is cached by digest, so a
    changed file is always read again.
    """
    file = Path(path) if path is not None else table_path(target)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise TacticsError(f"{file}: no such tactic table file") from None
    except OSError as error:
        raise TacticsError(f"{file}: cannot read the tactic tables "
                           f"({type(error).__name__})") from None
    digest = hashlib.sha256(raw).hexdigest()
    data = _PARSED.get(digest)
    if data is None:
        try:
            content = yaml.load(raw, Loader=_SAFE_LOADER)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise TacticsError(f"{file}{line}: YAML error in the tactic tables") from None
        if not isinstance(content, dict):
            raise TacticsError(f"{file}: a tactic table file is a mapping")
        try:
            data = TableFile.model_validate(content)
        except ValidationError as error:
            raise TacticsError(_one_line(file, error)) from None
        _PARSED[digest] = data
    return TacticTables(target=target, version=data.version, digest=digest, path=str(file),
                        data=data)


# ----------------------------------------------------------------------------- writing


class _TableDumper(yaml.SafeDumper):
    """YAML with a table's number lists (a bin's tactic, a provider list) inline."""


def _inline_list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.Node:
    flow = all(isinstance(v, int | str) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_TableDumper.add_representer(list, _inline_list)


def write_table_file(data: dict[str, Any], out: str | Path, header: str = "") -> None:
    """Write a table file's data as YAML (``header``: comment lines put first), atomically
    (:func:`stepgraph.atomic_file.write_atomically`)."""
    text = yaml.dump(data, Dumper=_TableDumper, sort_keys=False, width=100,
                     default_flow_style=False)
    write_atomically(out, (header + text).encode("utf-8"))
