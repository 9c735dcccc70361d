"""An FSDP2 training job on every GPU (on CPU with gloo where there is none) with a
``CheckpointManager`` (a memory tier per rank with peer replicas, and a durable tier), started
by ``tests/gpu/test_gpu_replica_restart.py`` under torchrun. Not a test module.

``run``: trains and saves every step; before each save every rank writes its local shards of
that step to ``<root>/expected/rank<r>_step<s>.pt``; once step ``KILL_AFTER`` is in memory and
replicated on every rank, rank 0 prints ``KILL-ME`` and training goes on until the test kills
the job. ``resume``: a new model and manager on the same directories load the newest step;
each rank prints ``RESUMED <rank> <step> <same>`` (``same``: the loaded shards equal the ones
written at that step, bit for bit) and the manager's log lines about replicas.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates import CheckpointManager

KILL_AFTER = 4
LAYERS, DIM = 6, 512
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)]).to(DEVICE)
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(step)
    x = torch.randn(32, DIM, device=DEVICE, generator=gen)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def shards(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        return {prefix: local.detach().cpu().clone()}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in shards(val, f"{prefix}.{key}").items()}
    return {}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def manager(root: Path, rank: int) -> CheckpointManager:
    return CheckpointManager(root / "durable", memory_dir=root / f"node_{rank}", keep_memory=2,
                             keep_durable=1, replicate=True)


def run(root: Path, rank: int) -> None:
    model, opt = build(seed=0)
    with manager(root, rank) as tiers:
        for step in range(1, 10_000):
            train(model, opt, step)
            state = state_of(model, opt)
            # before the save: the job may be killed as soon as the step is committed
            torch.save(shards(state), root / "expected" / f"rank{rank}_step{step}.pt")
            tiers.save(step, state).committed.result()
            if step == KILL_AFTER:
                tiers.wait()  # replicas of this step are on the peers too
                dist.barrier()
                if rank == 0:
                    print("KILL-ME", flush=True)


def resume(root: Path, rank: int) -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("dcp_datastates").addHandler(handler)
    logging.getLogger("dcp_datastates").setLevel(logging.INFO)
    model, opt = build(seed=1)
    train(model, opt, 0)  # the optimizer state exists to load into
    with manager(root, rank) as tiers:
        state = state_of(model, opt)
        step = tiers.load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    expected = torch.load(root / "expected" / f"rank{rank}_step{step}.pt")
    ok = same(shards(state_of(model, opt)), expected)
    # one write per line: the ranks share torchrun's stdout, and a line written in two parts
    # (its text, then its newline: print, unbuffered) may be split by the other rank's
    out = [f"LOG {rank} {line}\n" for line in lines if "replica" in line]
    sys.stdout.write("".join(out) + f"RESUMED {rank} {step} {ok}\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "resume"])
    ap.add_argument("root", type=Path)
    args = ap.parse_args()
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    if DEVICE == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    (args.root / "expected").mkdir(parents=True, exist_ok=True)
    (run if args.mode == "run" else resume)(args.root, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
