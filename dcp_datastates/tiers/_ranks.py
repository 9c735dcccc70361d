"""The ranks of a managed job, and the decisions they take together on a gloo group of theirs.

Under ``torch.distributed`` the manager makes its groups collectively (every rank, at the same
point); without it, one rank decides alone and nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ranks:
    """This rank, the world size, and a gloo group over every rank (None: one process)."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def here(cls) -> Ranks:
        """The ranks of this process's job, on a new gloo group (collective)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, None)
        return cls(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))

    def another_group(self) -> Ranks:
        """The same ranks on a group of their own (collective), for a thread that decides
        apart from the others."""
        if self.group is None:
            return self
        return Ranks(self.rank, self.world, dist.new_group(backend="gloo"))

    def gather(self, obj: object) -> list:
        """Every rank's ``obj``, by rank."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        if self.group is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def most(self, value: int) -> int:
        """The largest of every rank's ``value``."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
