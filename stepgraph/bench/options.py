"""The options of one benchmark run (no torch here: the command checks them before it
imports the protocol)."""

from __future__ import annotations

from dataclasses import dataclass

from stepgraph.bench.table import MODES


@dataclass(frozen=True)
class BenchOptions:
    """What to run: bins (None: every bin of the artifact), replays and untimed warm-up calls
    per mode and bin, the MLA context, input sets, the seed, the modes, steps per check; the
    device (``cpu``: a dry run of the whole protocol on the CPU, times meaningless); a time
    budget in seconds after which no new measurement starts (what is left is reported as
    skipped, so a run ends inside a device-time limit with its tables)."""

    batches: tuple[int, ...] | None = None
    replays: int = 50
    warmup: int = 5
    context: int = 4096
    sets: int = 4
    seed: int = 0
    modes: tuple[str, ...] = MODES
    check_steps: int = 2
    commit: str | None = None
    command: str = ""
    progress: bool = True
    device: str = "cuda"
    budget_s: float | None = None
