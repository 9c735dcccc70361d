"""A job of sharded DTensors (on a gloo CPU mesh over every rank) with a ``CheckpointManager``,
started under torchrun by ``tests/tiers/test_tiers_restart.py``. Not a test module.

``save MEMORY DURABLE``: saves step 20 (persisted) and closes, then a manager with
``persist=None`` saves step 30 (in the memory tiers only). ``load MEMORY DURABLE``: a new
manager on the same directories (each rank's memory tier ``MEMORY/rank_<r>``) loads the newest
step it can into zeroed tensors; rank 0 prints ``LOADED <step> <same>`` (``same``: the full
tensors equal the ones saved at that step, bit for bit) or ``REFUSED <error>``. The manager's
warnings go to stderr.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dcp_datastates import CheckpointError, CheckpointManager, Engine


def values(step: int) -> dict:
    """The full state of ``step``: shapes that 1, 2 and 4 ranks shard evenly and unevenly."""
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 6, generator=gen),
            "ids": torch.randint(0, 1 << 40, (5, 3), generator=gen), "step": step}


def sharded(state: dict, mesh: DeviceMesh) -> dict:
    return {k: distribute_tensor(v, mesh, [Shard(0)]) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def same(state: dict, step: int) -> bool:
    want = values(step)
    return all((v.full_tensor() if isinstance(v, DTensor) else v).equal(want[k])
               if isinstance(want[k], torch.Tensor) else v == want[k] for k, v in state.items())


def main() -> None:
    mode, memory, durable = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    engine = Engine(host_cache_size="8MiB", io_backend="threads")
    tier = memory / f"rank_{rank}"
    try:
        if mode == "save":
            with CheckpointManager(durable, memory_dir=tier, engine=engine) as manager:
                manager.save(20, sharded(values(20), mesh)).result(timeout=60)
            with CheckpointManager(durable, memory_dir=tier, persist=None,
                                   engine=engine) as manager:
                manager.save(30, sharded(values(30), mesh)).result(timeout=60)
            return
        state = sharded({k: v.zero_() if isinstance(v, torch.Tensor) else -1
                         for k, v in values(0).items()}, mesh)
        try:
            with CheckpointManager(durable, memory_dir=tier, engine=engine) as manager:
                step = manager.load(state)
        except CheckpointError as exc:
            if rank == 0:
                print(f"REFUSED {exc}", flush=True)
            return
        ok = same(state, step)
        if rank == 0:
            print(f"LOADED {step} {ok}", flush=True)
    finally:
        engine.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
