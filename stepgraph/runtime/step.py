"""The compiled step: a loaded artifact bound to a device, one prepared launch list (and one
CUDA graph) per bin, and ``step(inputs) -> logits``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from stepgraph.errors import UserError
from stepgraph.ir.graph import Graph
from stepgraph.runtime.binding import Arena, Bindings
from stepgraph.runtime.capture import BinPlan, Choice
from stepgraph.runtime.comm import Communicator
from stepgraph.runtime.inputs import InputFiller, Limits, StepInputs


@dataclass
class CompiledStep:
    """A decode step ready to run: ``step(inputs)`` picks the smallest bin holding the rows,
    fills the static input buffers (padding the rest of the bin), replays the bin's CUDA
    graph (or runs its launches eagerly on CPU or when not captured) and returns the logits
    of the real rows.

    ``caches`` are the step's state tensors (one extra scratch slot and block each, see
    :mod:`stepgraph.runtime.inputs`); ``plan_sets`` hold each bin's launches and provider
    choices once per device block of input buffers (see
    :class:`~stepgraph.runtime.inputs.InputFiller`; :attr:`plans` is the first block's);
    ``report()`` says what runs where and why.
    """

    graph: Graph
    device: torch.device
    dtype: torch.dtype
    bins: list[int]
    q: int
    plan_sets: list[dict[int, BinPlan]]
    bindings: Bindings
    arena: Arena
    filler: InputFiller
    caches: dict[str, torch.Tensor]
    target: str
    notes: list[str] = field(default_factory=list)
    document: dict[str, Any] | None = None
    pool: Any = None
    comm: Communicator | None = None
    kept: dict[str, torch.Tensor] = field(default_factory=dict)

    # ------------------------------------------------------------------ sizes

    @property
    def limits(self) -> Limits:
        """What the caches and block tables hold."""
        return self.filler.limits

    @property
    def max_rows(self) -> int:
        """The largest bin."""
        return self.bins[-1]

    @property
    def max_requests(self) -> int:
        """Requests the state slots hold."""
        return self.limits.slots // self.q

    @property
    def block_size(self) -> int:
        """Tokens per cache block."""
        return self.limits.block_size

    @property
    def plans(self) -> dict[int, BinPlan]:
        """Each bin's plan bound to the first device block of input buffers (the choices
        are the same for every block)."""
        return self.plan_sets[0]

    @property
    def captured(self) -> bool:
        """Whether every bin replays a CUDA graph (in every block's plans)."""
        return all(plan.graph is not None for plans in self.plan_sets
                   for plan in plans.values())

    @property
    def output_name(self) -> str:
        """The output the step returns (``logits``)."""
        names = list(self.bindings.outputs)
        return "logits" if "logits" in names else names[0]

    def bin_for(self, rows: int) -> int:
        """The smallest bin holding ``rows`` rows; a UserError above the largest bin."""
        if rows < 1:
            raise UserError("a step needs at least one row")
        if rows % self.q:
            raise UserError(f"{rows} rows are not whole requests of q={self.q} tokens")
        for size in self.bins:
            if size >= rows:
                return size
        raise UserError(
            f"{rows} rows exceed the largest bin {self.max_rows} of this artifact, and the "
            f"runtime has no eager path past it: compile with --batches including a bin of "
            f"at least {rows} rows, or split the step into steps of at most {self.max_rows} "
            f"rows")

    # ------------------------------------------------------------------ running

    def step(self, inputs: StepInputs, clone: bool = True) -> torch.Tensor:
        """Run one step; returns the logits [rows, vocab] (float32) of the real rows: a copy,
        or with ``clone=False`` a view of the static output buffer that the next step
        overwrites."""
        rows = inputs.rows
        size = self.bin_for(self.agreed_rows(rows))
        self.filler.fill(inputs, size)
        self.replay(size)
        logits = self.bindings.outputs[self.output_name][:rows]
        return logits.clone() if clone else logits

    @property
    def data_parallel(self) -> int:
        """How many ranks run their own requests (DEP; 1 otherwise)."""
        return int(self.graph.meta.get("deployment", {}).get("dep", 1))

    def agreed_rows(self, rows: int) -> int:
        """The rows every rank's bin must hold: with data-parallel ranks (DEP) the largest
        count over the ranks (a rank with no requests still steps, all padding), since the
        expert dispatch exchanges whole bins; otherwise ``rows``."""
        if self.data_parallel == 1 or self.comm is None:
            return rows
        return self.comm.max_int(rows)

    def plan(self, size: int) -> BinPlan:
        """Bin ``size``'s plan bound to the input buffers the last fill wrote."""
        return self.plan_sets[self.filler.current][size]

    def replay(self, size: int) -> None:
        """Run bin ``size`` on whatever the last fill wrote into the input buffers (a
        benchmark's inner loop)."""
        plan = self.plan(size)
        with torch.no_grad():
            if plan.graph is not None:
                plan.graph.replay()
            else:
                plan.run_eager()

    def poison_arena(self) -> None:
        """Fill the arena with NaN bytes (a test: no launch may read a temp it did not
        write this step)."""
        self.arena.poison()

    def temps(self, size: int) -> dict[str, torch.Tensor]:
        """The bound temps of bin ``size``."""
        return self.bindings.temps[size]

    # ------------------------------------------------------------------ report

    def choices(self) -> list[Choice]:
        """Every (node, bin) provider choice."""
        return [c for size in self.bins for c in self.plans[size].choices]

    def report(self) -> str:
        """What runs where: device, target, bins, arena, providers per op, fallbacks."""
        lim = self.limits
        mode = "one CUDA graph per bin" if self.captured else "eager launches"
        lines = [
            f"stepgraph runtime: {self.graph.name} on {self._device_name()} (target "
            f"{self.target}), {str(self.dtype).removeprefix('torch.')}, {mode}",
            f"  bins {', '.join(map(str, self.bins))} (q={self.q}); arena {self.arena.nbytes} "
            f"bytes (plan x{self.arena.scale}); {lim.slots} state slots + 1 scratch; "
            f"{lim.blocks} cache blocks of {lim.block_size} + 1 scratch; context "
            f"{lim.max_context}",
        ]
        for note in self.notes:
            lines.append(f"  note: {note}")
        groups: dict[tuple[str, ...], list[int]] = {}
        for size in self.bins:
            groups.setdefault(self._bin_lines(size), []).append(size)
        for body, sizes in groups.items():
            label = "bin" if len(sizes) == 1 else "bins"
            lines.append(f"  {label} {', '.join(map(str, sizes))}: {body[0]}")
            lines.extend(body[1:])
        return "\n".join(lines)

    def _bin_lines(self, size: int) -> tuple[str, ...]:
        chosen = self.plans[size].choices
        used = Counter((c.op, c.provider) for c in chosen)
        text = ", ".join(f"{op}:{p} x{n}" for (op, p), n in sorted(used.items()))
        pdl = sum(c.pdl and c.provider == c.wanted for c in chosen)
        lines = [f"{len(chosen)} launches ({pdl} with PDL): {text}"]
        reasons = Counter((c.op, c.reason) for c in chosen if c.reason)
        for (op, reason), n in sorted(reasons.items()):
            lines.append(f"    fallback {op} x{n}: {reason}")
        return tuple(lines)

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)
