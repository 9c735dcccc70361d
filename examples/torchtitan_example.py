"""dcp_datastates in torchtitan: async checkpoints through DataStatesWriter, then a verified resume.

In a real torchtitan job, pick one of the two (they do the same):

1. The config: in your torchtitan Python config, replace ``CheckpointManager.Config`` with
   ``DataStatesCheckpointManager.Config`` (same fields, plus ``host_cache_size`` and a few
   more; a manager whose config sets them makes an engine of its own and closes it)::

       from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

       checkpoint=DataStatesCheckpointManager.Config(
           interval=500,
           async_mode="async",          # "disabled" and "async_with_pinned_mem" work too
           host_cache_size="24GiB",     # about this rank's shard of model + optimizer state
       ),

2. The trainer, without touching the config (saves and loads then go through the process's
   default engine, whose host cache sizes itself from the states it sees)::

       from dcp_datastates.integrations.torchtitan import enable_datastates

       trainer = Trainer(config)
       enable_datastates(trainer.checkpointer)
       trainer.train()

Either way each save takes a fresh ``DataStatesWriter()`` and each load a
``DataStatesReader()``, and the optimizers' step waits for a snapshot still copying
(``dcp_datastates.guard``).

This script runs way 2 with torchtitan's own ``CheckpointManager``, ``OptimizersContainer`` and
``LRSchedulersContainer`` on a toy model (FSDP2 over all ranks), so it needs torchtitan but no
data set or tokenizer; either release (what differs goes through the adapter's
``TORCHTITAN``; packages torchtitan imports that are missing get the stand-ins of
``torchtitan_train.py``)::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro
    #  or: pip install --no-deps torchtitan==0.2.2 torchdata==0.11.0 && pip install tyro
    python examples/torchtitan_example.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_example.py

It trains 8 steps with an async checkpoint every 4 steps, then builds a fresh model, optimizer
and scheduler, resumes from the latest checkpoint and checks every tensor bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_train import stand_ins_for_missing_packages  # noqa: E402

stand_ins_for_missing_packages()
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from dcp_datastates.integrations.torchtitan import (  # noqa: E402
    TORCHTITAN,
    DataStates,
    enable_datastates,
)

STEPS, INTERVAL = 8, 4


class TrainState:
    """What torchtitan's Trainer saves about itself (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


def build(seed: int, device: torch.device) -> tuple[nn.Module, object, object]:
    """The model (FSDP2 over every rank) and torchtitan's optimizer and LR scheduler
    containers (made as the installed release makes them)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizers, schedulers = TORCHTITAN.containers(
        [model], lambda s: min(1.0, (s + 1) / 4), implementation="foreach", lr=1e-3,
        weight_decay=0.1)
    return model, optimizers, schedulers


def make_manager(folder: str, model: nn.Module, optimizers: object, schedulers: object,
                 train_state: TrainState) -> tuple[CheckpointManager, DataStates]:
    """torchtitan's own manager (0.3: ``CheckpointManager.Config(...).build(...)``; 0.2.x:
    ``CheckpointManager(..., checkpoint_config=...)``), routed through dcp_datastates."""
    config = TORCHTITAN.config(enable=True, folder="checkpoint", interval=INTERVAL,
                               async_mode="async", keep_latest_k=2, initial_load_model_only=False)
    manager = TORCHTITAN.build(CheckpointManager, config, dataloader=None, model_parts=[model],
                               optimizers=optimizers, lr_schedulers=schedulers,
                               states={"train_state": train_state}, sd_adapter=None,
                               base_folder=folder)
    return manager, enable_datastates(manager)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="base folder (default: a new temporary directory)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # torchrun
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    folder = args.folder or (tempfile.mkdtemp(prefix="titan_datastates_") if rank == 0 else None)
    box = [folder]
    dist.broadcast_object_list(box)
    folder = box[0]

    model, optimizers, schedulers = build(seed=0, device=device)
    train_state = TrainState()
    manager, datastates = make_manager(folder, model, optimizers, schedulers, train_state)
    for step in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=gen).to(device)
        optimizers.zero_grad()
        loss = F.mse_loss(model(x), x.flip(1))
        loss.backward()
        manager.maybe_wait_for_staging()  # as torchtitan's trainer: the snapshot may still copy
        optimizers.step()
        schedulers.step()
        train_state.step = step
        manager.save(step)  # async every INTERVAL steps: returns while the snapshot copies
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f}", flush=True)
    manager.close()  # waits for the last upload
    stats = datastates.last_stats()
    if rank == 0:
        print(f"last save: {stats.bytes_written} bytes on this rank, snapshot after "
              f"{stats.snapshot_s:.3f} s, durable after {stats.durable_s:.3f} s", flush=True)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    expected = get_model_state_dict(model, options=opts)
    expected_optim = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                      for k, v in optimizers.state_dict().items()}

    model2, optimizers2, schedulers2 = build(seed=1, device=device)
    train_state2 = TrainState()
    manager2, _ = make_manager(folder, model2, optimizers2, schedulers2, train_state2)
    manager2.load()  # the latest step folder
    got = get_model_state_dict(model2, options=opts)
    got_optim = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in optimizers2.state_dict().items()}
    manager2.close()
    if rank == 0:
        same = all(torch.equal(got[k], expected[k]) for k in expected) and all(
            torch.equal(got_optim[k].cpu(), v.cpu()) if isinstance(v, torch.Tensor)
            else got_optim[k] == v for k, v in expected_optim.items())
        print(f"checkpoints in {folder}/checkpoint: {sorted(os.listdir(f'{folder}/checkpoint'))}")
        print(f"resumed at step {train_state2.step} (scheduler epoch "
              f"{schedulers2.schedulers[0].last_epoch}); "
              f"model and optimizer {'match bit for bit' if same else 'DIFFER'}")
        if not same:
            raise SystemExit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
