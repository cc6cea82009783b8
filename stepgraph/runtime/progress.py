"""A progress bar for the runtime's preparation and capture: rich's when rich is importable,
else a one-line counter on stderr; nothing when disabled."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[int, str], None]


@contextmanager
def progress(total: int, label: str, enabled: bool = True) -> Iterator[Advance]:
    """A context whose value ``advance(n, what)`` moves the bar by ``n`` of ``total`` steps
    and names the current work ``what``."""
    if not enabled or total <= 0:
        yield lambda n, what: None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ImportError:
        yield from _counter(total, label)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[what]}"))
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=total, what="")

        def advance(n: int, what: str) -> None:
            bar.update(task, advance=n, what=what)

        yield advance


def _counter(total: int, label: str) -> Iterator[Advance]:
    done = 0

    def advance(n: int, what: str) -> None:
        nonlocal done
        done += n
        sys.stderr.write(f"\r{label}: {done}/{total} {what[:40]:<40}")
        sys.stderr.flush()

    try:
        yield advance
    finally:
        sys.stderr.write("\n")
        sys.stderr.flush()
