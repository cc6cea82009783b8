"""Peak-memory-optimal ordering of a small DAG of launches (graph-free).

The schedule pass cuts the program into short runs of launches and asks this module for an
order of each run whose peak of live bytes is minimal. A run is ``n`` tasks (0..n-1, their
program order) with dependence masks, and the buffers its tasks touch:

* a buffer made before the run (``producer`` None) is live from the run's start to its
  last reader in the run (to the end when it is ``kept``: read after the run);
* a buffer made by a task is live from that task to its last reader in the run (to the
  end when ``kept``; during its producer only when nothing reads it).

The bytes live during task v, after the set S of tasks, are ``base(S)`` (buffers made and
still wanted) plus everything v writes, so the best order is a minimax path over the
lattice of dependence-closed sets S, which a breadth-first dynamic program walks
(2^n states at most; runs are about ten launches). Buffers that live through the whole
run add the same bytes to every order and may be left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunBuffer:
    """A buffer a run touches: ``size`` bytes, made by task ``producer`` (None: before the
    run), read by the tasks in the bit mask ``readers``, and ``kept`` past the run."""

    size: int
    producer: int | None
    readers: int
    kept: bool


@dataclass(frozen=True)
class RunOrder:
    """The result for one run: ``order`` (task indices), its ``peak`` bytes, and the
    ``program_peak`` of the order 0..n-1."""

    order: tuple[int, ...]
    peak: int
    program_peak: int


class _Run:
    def __init__(self, preds: Sequence[int], buffers: Sequence[RunBuffer]) -> None:
        self.n = len(preds)
        self.preds = list(preds)
        self.buffers = list(buffers)
        self.writes: list[list[int]] = [[] for _ in range(self.n)]
        self.reads: list[list[int]] = [[] for _ in range(self.n)]
        self.write_bytes = [0] * self.n
        self.base0 = 0
        for b, buffer in enumerate(self.buffers):
            if buffer.producer is None:
                if buffer.readers or buffer.kept:
                    self.base0 += buffer.size
            else:
                self.writes[buffer.producer].append(b)
                self.write_bytes[buffer.producer] += buffer.size
            for task in range(self.n):
                if buffer.readers >> task & 1:
                    self.reads[task].append(b)

    def step(self, done: int, base: int, task: int) -> tuple[int, int]:
        """(bytes live during ``task`` after ``done``, base after it)."""
        during = base + self.write_bytes[task]
        after = done | (1 << task)
        new_base = base
        for b in self.writes[task]:
            buffer = self.buffers[b]
            if buffer.kept or buffer.readers & ~after:
                new_base += buffer.size
        for b in self.reads[task]:
            buffer = self.buffers[b]
            if not buffer.kept and not buffer.readers & ~after:
                new_base -= buffer.size
        return during, new_base

    def peak_of(self, order: Sequence[int]) -> int:
        """The peak of one order."""
        done, base, peak = 0, self.base0, 0
        for task in order:
            during, base = self.step(done, base, task)
            peak = max(peak, during)
            done |= 1 << task
        return peak


def best_order(preds: Sequence[int], buffers: Sequence[RunBuffer],
               max_states: int = 4096) -> RunOrder:
    """The order of the run with the least peak (program order unless one is strictly
    better; program order too when more than ``max_states`` dependence-closed sets
    exist). ``preds[v]`` is the bit mask of tasks that must precede task v, which must hold
    for the program order 0..n-1."""
    run = _Run(preds, buffers)
    program = tuple(range(run.n))
    program_peak = run.peak_of(program)
    floor = _floor(run)
    if program_peak <= floor or run.n < 2:
        return RunOrder(program, program_peak, program_peak)
    # mask -> (peak so far, base, parent mask, last task)
    states: dict[int, tuple[int, int, int, int]] = {0: (0, run.base0, -1, -1)}
    frontier = [0]
    for _ in range(run.n):
        reached: dict[int, tuple[int, int, int, int]] = {}
        for done in frontier:
            peak, base = states[done][0], states[done][1]
            for task in range(run.n):
                if done >> task & 1 or run.preds[task] & ~done:
                    continue
                during, new_base = run.step(done, base, task)
                new_peak = max(peak, during)
                mask = done | (1 << task)
                old = reached.get(mask)
                if old is None or new_peak < old[0]:
                    reached[mask] = (new_peak, new_base, done, task)
        states.update(reached)
        if len(states) > max_states:
            return RunOrder(program, program_peak, program_peak)
        frontier = list(reached)
    full = (1 << run.n) - 1
    best = states[full][0]
    if best >= program_peak:
        return RunOrder(program, program_peak, program_peak)
    order = []
    mask = full
    while mask:
        _, _, parent, task = states[mask]
        order.append(task)
        mask = parent
    return RunOrder(tuple(reversed(order)), best, program_peak)


def _floor(run: _Run) -> int:
    """A peak no order can beat: buffers live through the whole run plus, for the task that
    needs most, everything it reads and writes."""
    always = sum(b.size for b in run.buffers if b.producer is None and b.kept)
    most = 0
    for task in range(run.n):
        touched = set(run.writes[task]) | set(run.reads[task])
        most = max(most, sum(run.buffers[b].size for b in touched
                             if not (run.buffers[b].producer is None and run.buffers[b].kept)))
    return always + most
