"""The ranks of a run: one process, or every process torchrun started (one GPU each).

Under torchrun (``WORLD_SIZE`` > 1) the default process group is ``cpu:gloo,cuda:nccl`` (gloo
alone on CPU) and each rank takes the GPU of its ``LOCAL_RANK``. The benchmark's own exchanges
(gathers, barriers) go through a gloo group of their own, so they never interleave with the
collectives that a checkpoint's background thread runs on the default group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """This rank, the world size, the device type its work runs on (``"cuda"``: this rank's
    GPU, made current) and the benchmark's gloo group (None: one process)."""

    rank: int
    world: int
    device: str
    group: dist.ProcessGroup | None = None

    @classmethod
    def start(cls, cpu: bool) -> Ranks:
        """One process, or the process group torchrun's environment describes."""
        device = "cpu" if cpu else "cuda"
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls(0, 1, device)
        dist.init_process_group("gloo" if cpu else "cpu:gloo,cuda:nccl")
        return cls(dist.get_rank(), dist.get_world_size(), device,
                   dist.new_group(backend="gloo"))

    @property
    def lead(self) -> bool:
        """Whether this rank prints and writes the results (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def gather(self, obj: object) -> list:
        """Every rank's ``obj`` (picklable), by rank, on every rank."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def total(self, n: int) -> int:
        return sum(self.gather(n))

    def slowest(self, seconds: float) -> float:
        return max(self.gather(seconds))

    def all(self, flag: bool) -> bool:
        return all(self.gather(flag))

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group()
