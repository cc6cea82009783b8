"""Step inputs: what the host gives one step (:class:`StepInputs`, the real rows only) and how
they fill a bin's static input buffers (:class:`InputFiller`), padding included.

The fields mirror what :class:`stepgraph.lower.decode.DecodeRunner` builds for the reference
executor. Padding rows (beyond the real rows, up to the bin) are: token 0, position 0, the
caches' scratch state slot, one accepted token, an all-zero block table, ``seq_lens`` 0 and
``slot_mapping`` -1, so they touch no real slot or block and attend nowhere. A real row with
a negative state index also uses the scratch slot (it reads zeros, as in the reference).
"""

from __future__ import annotations

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


class InputFiller:
    """Writes a step's inputs, padded to a bin, into the static input buffers."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], limits: Limits) -> None:
        self.buffers = dict(buffers)
        self.limits = limits
        unknown = sorted(set(self.buffers) - set(FIELDS))
        if unknown:
            raise UserError(f"the step reads input(s) {', '.join(unknown)}, which this runtime "
                            f"does not know how to fill")

    def padding(self, name: str, rows: int) -> np.ndarray:
        """The host array of input ``name`` for ``rows`` padding rows."""
        buffer = self.buffers[name]
        dtype = torch.empty((), dtype=buffer.dtype).numpy().dtype
        shape = (rows, *buffer.shape[1:])
        fill = {"kda_state_indices": self.limits.slots, "num_accepted_tokens": 1,
                "slot_mapping": -1}.get(name, 0)
        return np.full(shape, fill, dtype=dtype)

    def fill(self, inputs: StepInputs, bin_rows: int) -> None:
        """Check ``inputs`` and write them, padded to ``bin_rows`` rows, into the buffers."""
        rows = inputs.rows
        for name, buffer in self.buffers.items():
            host = self.padding(name, bin_rows)
            given = getattr(inputs, name)
            if given is None:
                if name == "num_accepted_tokens":
                    given = np.ones(rows, dtype=np.int32)
                else:
                    raise UserError(f"step input {name} is missing (this step reads it)")
            array = _host(given)
            self._check(name, array, rows)
            if name == "block_tables":
                host[:rows, : array.shape[1]] = array
            elif name == "kda_state_indices":
                host[:rows] = np.where(array >= 0, array, self.limits.slots)
            else:
                host[:rows] = array.reshape(rows)
            buffer[:bin_rows].copy_(torch.from_numpy(host))

    def fill_padding(self, bin_rows: int) -> None:
        """Make every row of bin ``bin_rows`` a padding row (for warm-up and capture)."""
        for name, buffer in self.buffers.items():
            buffer[:bin_rows].copy_(torch.from_numpy(self.padding(name, bin_rows)))

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
