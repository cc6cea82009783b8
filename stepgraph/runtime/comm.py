"""The ranks of a multi-GPU step: :class:`Communicator` wraps torch.distributed for the
collective providers.

A plan's collectives name a group (``tp``, ``dcp``, ``ep``) and its size (``ways``). Ranks
form groups in contiguous blocks: with ``ways`` w in a world of W, rank r is member
``r % w`` of group ``r // w`` (the weight slicing takes part ``r % w`` of every split tensor,
so the two agree). A group as large as the world is the default process group.

The collectives move rows (dimension 0) of contiguous tensors; the providers arrange the
columns. NCCL's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are used directly;
Gloo (CPU processes: the CI's multi-rank tests) has no ``reduce_scatter``, so there it is an
all-reduce and a slice, and all-gathers go through a list.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from stepgraph.errors import UserError


class Communicator:
    """This process's rank in a world of ``world`` ranks, and the process groups of a plan.

    Build it with :meth:`from_default` once ``torch.distributed`` is initialized (the
    launcher does that); :meth:`add_groups` creates the sub-groups a plan needs (every rank
    must call it with the same list, in the same order).
    """

    def __init__(self, rank: int, world: int, backend: str) -> None:
        self.rank = rank
        self.world = world
        self.backend = backend
        self._groups: dict[int, object] = {}

    @classmethod
    def from_default(cls) -> Communicator:
        """The default process group's rank, world and backend."""
        if not dist.is_available() or not dist.is_initialized():
            raise UserError("torch.distributed is not initialized: start the ranks with the "
                            "launcher (stepgraph ... --nproc N, or stepgraph.runtime.launch)")
        return cls(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))

    @property
    def is_nccl(self) -> bool:
        """Whether the collectives run on NCCL (CUDA tensors, capturable in CUDA graphs)."""
        return self.backend == "nccl"

    def add_groups(self, sizes: Iterable[int]) -> None:
        """Create the process groups of every size in ``sizes`` (collective: every rank calls
        it with the same sizes)."""
        for ways in sorted(set(int(s) for s in sizes)):
            if ways in self._groups or ways == 1:
                continue
            if ways < 1 or self.world % ways:
                raise UserError(f"a group of {ways} ranks does not divide the world of "
                                f"{self.world}")
            if ways == self.world:
                self._groups[ways] = dist.group.WORLD
                continue
            mine = None
            for start in range(0, self.world, ways):
                group = dist.new_group(list(range(start, start + ways)))
                if start <= self.rank < start + ways:
                    mine = group
            self._groups[ways] = mine

    def group(self, ways: int) -> object:
        """This rank's process group of ``ways`` ranks (created by :meth:`add_groups`)."""
        if ways not in self._groups:
            self.add_groups([ways])
        return self._groups[ways]

    def member(self, ways: int) -> int:
        """This rank's index inside its group of ``ways`` ranks."""
        return self.rank % ways

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, ways: int) -> None:
        """Sum ``tensor`` over the group, in place."""
        dist.all_reduce(tensor, group=self.group(ways))

    def all_gather_rows(self, out: torch.Tensor, tensor: torch.Tensor, ways: int) -> None:
        """``out`` [ways * R, ...] = the group's ``tensor`` [R, ...] stacked in member order."""
        group = self.group(ways)
        if self.is_nccl:
            dist.all_gather_into_tensor(out, tensor, group=group)
        else:
            dist.all_gather(list(out.chunk(ways)), tensor.contiguous(), group=group)

    def reduce_scatter_rows(self, out: torch.Tensor, tensor: torch.Tensor, ways: int) -> None:
        """``out`` [R, ...] = this member's block of rows of the group's sum of ``tensor``
        [ways * R, ...]. ``tensor`` may be overwritten (Gloo sums it in place)."""
        group = self.group(ways)
        if self.is_nccl:
            dist.reduce_scatter_tensor(out, tensor, group=group)
            return
        dist.all_reduce(tensor, group=group)
        out.copy_(tensor.chunk(ways)[self.member(ways)])

    def max_int(self, value: int) -> int:
        """The largest ``value`` over the whole world (a host round trip: used before a step,
        never inside a captured graph)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.is_nccl else "cpu"
        box = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.is_nccl:
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
