"""A two-rank job that starts async saves and destroys the process group at once, as the last
lines of a torchrun script do; started by ``tests/jobs/test_teardown.py``. Not a test module.

``shared`` (default): each rank saves items of its own (``rank<r>``) and a tensor both hold
alike into ``<root>/ckpt`` with a fresh ``DataStatesWriter()``, does not wait, then calls
``dist.destroy_process_group()`` and exits.

``own``: each rank saves a checkpoint of its own, ``dcp.async_save(no_dist=True)`` into
``<root>/own<r>`` and a ``CheckpointManager``'s step 1 into its memory tier ``<root>/mem<r>``;
their snapshots are handed out only once the group is destroyed (a held settle thread), so
both saves are in flight then. It waits for both and prints ``rank <r>: saved``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.fakes import HeldSettles

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine


def shared(root: Path, rank: int) -> None:
    state = {f"rank{rank}": torch.full((8 << 20,), float(rank)), "both": torch.arange(1000)}
    dcp.async_save(state, checkpoint_id=root / "ckpt", storage_writer=DataStatesWriter())
    dist.destroy_process_group()


def own(root: Path, rank: int) -> None:
    held = HeldSettles()
    with Engine(io_backend="threads", settle_pool=held) as engine:
        state = {"w": torch.full((1 << 16,), float(rank))}
        manager = CheckpointManager(None, memory_dir=root / f"mem{rank}", persist=None,
                                    engine=engine)
        response = dcp.async_save(state, checkpoint_id=root / f"own{rank}", no_dist=True,
                                  storage_writer=DataStatesWriter(engine=engine))
        handle = manager.save(1, state)
        dist.destroy_process_group()
        held.gate.set()
        response.upload_completion.result(timeout=60)
        handle.result(timeout=60)
        manager.close()
    print(f"rank {rank}: saved", flush=True)


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "shared"
    dist.init_process_group("gloo")
    {"shared": shared, "own": own}[mode](root, dist.get_rank())


if __name__ == "__main__":
    main()
