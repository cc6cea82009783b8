"""Step inputs: what the host gives one step (:class:`StepInputs`, the real rows only) and how
they fill a bin's static input buffers (:class:`InputFiller`), padding included.

The fields mirror what :class:`stepgraph.lower.decode.DecodeRunner` builds for the reference
executor. Padding rows (beyond the real rows, up to the bin) are: token 0, position 0, the
caches' scratch state slot, one accepted token, an all-zero block table, ``seq_lens`` 0 and
``slot_mapping`` -1, so they touch no real slot or block and attend nowhere. A real row with
a negative state index also uses the scratch slot (it reads zeros, as in the reference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from stepgraph.errors import UserError

FIELDS = ("tokens", "positions", "kda_state_indices", "num_accepted_tokens", "block_tables",
          "seq_lens", "slot_mapping")


@dataclass
class StepInputs:
    """The real rows of one step (array-likes: lists, numpy arrays or CPU tensors).

    ``tokens`` [R]; ``positions`` [R]; ``kda_state_indices`` [R] (state slot of each row);
    ``num_accepted_tokens`` [R] (verify steps); ``block_tables`` [R, width] (cache blocks of
    each row's request); ``seq_lens`` [R] (tokens each row attends over, its own included);
    ``slot_mapping`` [R] (flat cache slot ``block * block_size + offset`` of the row's new
    token, -1 for none). Fields the step's graph does not read may be left out.
    """

    tokens: Any
    positions: Any = None
    kda_state_indices: Any = None
    num_accepted_tokens: Any = None
    block_tables: Any = None
    seq_lens: Any = None
    slot_mapping: Any = None

    @property
    def rows(self) -> int:
        """The number of real rows."""
        return len(np.asarray(self.tokens).reshape(-1))

    @classmethod
    def from_feed(cls, feed: Mapping[str, Any], rows: int | None = None) -> StepInputs:
        """StepInputs from a reference-executor feed (name -> array); ``rows`` keeps only
        the first rows."""
        picked = {f.name: feed.get(f.name) for f in fields(cls)}
        if rows is not None:
            picked = {k: (None if v is None else _host(v)[:rows]) for k, v in picked.items()}
        return cls(**picked)


def _host(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


@dataclass(frozen=True)
class Limits:
    """What the bound caches hold: ``slots`` real state slots (the scratch slot is index
    ``slots``), ``blocks`` real cache blocks of ``block_size`` tokens (the scratch block is
    index ``blocks``), block tables of ``width`` blocks, a vocabulary of ``vocab`` tokens,
    ``q`` tokens a request."""

    slots: int
    blocks: int
    block_size: int
    width: int
    vocab: int
    q: int

    @property
    def max_context(self) -> int:
        """The most tokens a row attends over."""
        return self.width * self.block_size


MIRRORS = 4  # pinned host mirrors: how many steps the host may run ahead of the GPU
ALIGN = 256  # byte alignment of each input buffer in the packed block


@dataclass(frozen=True)
class Placement:
    """Where one input buffer lies in the packed block: byte ``offset``, ``shape``, dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of the buffer's elements."""
        return torch.empty((), dtype=self.dtype).numpy().dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the leading dim)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.shape[0] * self.row_bytes

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """The buffer as a typed view of the device ``block``."""
        raw = block[self.offset: self.offset + self.nbytes]
        return raw.view(self.dtype).view(self.shape)

    def host_view(self, mirror: np.ndarray) -> np.ndarray:
        """The buffer as a typed view of a host mirror (numpy bytes)."""
        raw = mirror[self.offset: self.offset + self.nbytes]
        return raw.view(self.np_dtype).reshape(self.shape)


def packed_layout(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                  ) -> dict[str, Placement]:
    """Byte placements of the input buffers in one block, smallest first (a bin then copies
    every small buffer whole and the largest, the block tables, up to its rows), each
    aligned to :data:`ALIGN` bytes."""
    places: dict[str, Placement] = {}
    offset = 0
    by_size = sorted(shapes.items(), key=lambda item: math.prod(item[1][0]) * item[1][1].itemsize)
    for name, (shape, dtype) in by_size:
        place = Placement(offset, tuple(shape), dtype)
        places[name] = place
        offset += -(-place.nbytes // ALIGN) * ALIGN
    return places


class InputFiller:
    """Writes a step's inputs, padded to a bin, into the static input buffers.

    Every input buffer is a view of one device block (:attr:`buffers`, of :attr:`block`); a
    step writes the bin's rows into a host mirror of that block and copies the used span to
    the GPU in one copy. On a GPU the mirrors are pinned and the copy asynchronous, so the
    host never waits for the GPU: it may run up to :data:`MIRRORS` steps ahead (a mirror is
    rewritten only after its last copy has run). Inputs are checked before anything is
    written, so a bad step leaves the buffers as they were.

    With ``blocks`` > 1 (the runtime's CUDA graphs: one graph per bin and block) the steps
    take the device blocks in turn (:attr:`current` is the one the last fill wrote), and on
    a GPU a step's copy runs on a copy stream of its own once the last work that read its
    block has run: it overlaps the step before, instead of sitting between two steps'
    graphs on the compute stream (which then only waits for the copy's event).
    """

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 limits: Limits, device: torch.device, blocks: int = 1) -> None:
        unknown = sorted(set(shapes) - set(FIELDS))
        if unknown:
            raise UserError(f"the step reads input(s) {', '.join(unknown)}, which this runtime "
                            f"does not know how to fill")
        if blocks < 1:
            raise UserError(f"input blocks must be at least 1, got {blocks}")
        self.limits = limits
        self.device = device
        self.layout = packed_layout(shapes)
        total = max(max((p.offset + p.nbytes for p in self.layout.values()), default=0), 1)
        self.blocks = [torch.zeros(total, dtype=torch.uint8, device=device)
                       for _ in range(blocks)]
        self.buffer_sets = [{name: p.view(block) for name, p in self.layout.items()}
                            for block in self.blocks]
        self.current = 0  # the block the last fill wrote
        self.filled = 0  # fills so far: the next fill takes block filled % blocks
        pinned = device.type == "cuda"
        count = MIRRORS if pinned else 1
        self.mirrors = [torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
                        for _ in range(count)]
        self.host_views = [{name: p.host_view(mirror.numpy()) for name, p in self.layout.items()}
                           for mirror in self.mirrors]
        self.copied = [torch.cuda.Event() if pinned else None for _ in range(count)]
        self.turn = 0
        overlap = pinned and blocks > 1
        self.copy_stream = torch.cuda.Stream(device=device) if overlap else None
        self.released = [torch.cuda.Event() if overlap else None for _ in range(blocks)]

    @property
    def block(self) -> torch.Tensor:
        """The device block the last fill wrote."""
        return self.blocks[self.current]

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The input buffers (views of :attr:`block`) the last fill wrote."""
        return self.buffer_sets[self.current]

    def _fill_value(self, name: str) -> int:
        return {"kda_state_indices": self.limits.slots, "num_accepted_tokens": 1,
                "slot_mapping": -1}.get(name, 0)

    def fill(self, inputs: StepInputs, bin_rows: int) -> None:
        """Check ``inputs`` and write them, padded to ``bin_rows`` rows, into the buffers."""
        rows = inputs.rows
        arrays: dict[str, np.ndarray] = {}
        for name in self.layout:
            given = getattr(inputs, name)
            if given is None:
                if name != "num_accepted_tokens":
                    raise UserError(f"step input {name} is missing (this step reads it)")
                given = np.ones(rows, dtype=np.int32)
            array = _host(given)
            self._check(name, array, rows)
            arrays[name] = array
        index = self.filled % len(self.blocks)
        self.filled += 1
        self._write(arrays, rows, bin_rows, index)

    def fill_padding(self, bin_rows: int, block: int = 0) -> None:
        """Make every row of bin ``bin_rows`` of device block ``block`` a padding row (for
        warm-up and capture)."""
        self._write({}, 0, bin_rows, block)

    def _write(self, arrays: Mapping[str, np.ndarray], rows: int, bin_rows: int,
               index: int) -> None:
        """Write ``arrays`` (``rows`` real rows) padded to ``bin_rows`` into the next host
        mirror and copy the span the bin reads to device block ``index``."""
        turn = self.turn % len(self.mirrors)
        self.turn += 1
        event = self.copied[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this mirror has run
        span = 0
        for name, place in self.layout.items():
            host = self.host_views[turn][name][:bin_rows]
            host[...] = self._fill_value(name)
            array = arrays.get(name)
            if array is not None:
                if name == "block_tables":
                    host[:rows, : array.shape[1]] = array
                elif name == "kda_state_indices":
                    host[:rows] = np.where(array >= 0, array, self.limits.slots)
                else:
                    host[:rows] = array.reshape(rows)
            span = max(span, place.offset + bin_rows * place.row_bytes)
        block, mirror = self.blocks[index], self.mirrors[turn][:span]
        if self.copy_stream is None:
            block[:span].copy_(mirror, non_blocking=event is not None)
            if event is not None:
                event.record()
        else:
            self._copy_beside(block[:span], mirror, index, event)
        self.current = index

    def _copy_beside(self, dst: torch.Tensor, src: torch.Tensor, index: int,
                     event: torch.cuda.Event) -> None:
        """Copy ``src`` into block ``index`` on the copy stream, after the last work of the
        compute stream that may read that block, and make the compute stream wait for it."""
        compute = torch.cuda.current_stream(self.device)
        released = self.released
        released[self.current].record(compute)  # all work so far that reads the current block
        self.copy_stream.wait_event(released[index])
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event.record()
        compute.wait_event(event)

    def _check(self, name: str, array: np.ndarray, rows: int) -> None:
        lim = self.limits
        if name == "block_tables":
            if array.ndim != 2 or array.shape[0] != rows:
                raise UserError(f"block_tables is {list(array.shape)}, expected [{rows}, width]")
            if array.shape[1] > lim.width:
                raise UserError(f"block_tables has {array.shape[1]} columns; this runtime was "
                                f"loaded for {lim.width} (max_context {lim.max_context} / "
                                f"block_size {lim.block_size})")
            bad = array[array >= lim.blocks]  # negative entries are masked (no block)
            if bad.size:
                raise UserError(f"block_tables: block {int(bad[0])} is outside the cache's "
                                f"blocks 0..{lim.blocks - 1}")
            return
        if array.reshape(-1).shape[0] != rows:
            raise UserError(f"step input {name} has {array.reshape(-1).shape[0]} values, "
                            f"expected {rows} (one per row)")
        array = array.reshape(-1)
        if name == "tokens" and ((array < 0) | (array >= lim.vocab)).any():
            raise UserError(f"tokens: a token is outside the vocabulary 0..{lim.vocab - 1}")
        if name == "kda_state_indices" and (array >= lim.slots).any():
            raise UserError(f"kda_state_indices: slot {int(array.max())} is outside the "
                            f"{lim.slots} state slots (max_requests x q)")
        if name == "seq_lens" and ((array < 0) | (array > lim.max_context)).any():
            raise UserError(f"seq_lens: {int(array.max())} tokens exceed max_context "
                            f"{lim.max_context} (load with a larger max_context)")
        if name == "slot_mapping" and (array >= lim.blocks * lim.block_size).any():
            raise UserError(f"slot_mapping: slot {int(array.max())} is outside the cache's "
                            f"{lim.blocks * lim.block_size} slots")
        if name == "num_accepted_tokens" and ((array < 1) | (array > lim.q)).any():
            raise UserError(f"num_accepted_tokens must be within 1..q={lim.q}")
