"""FSDP2 on every GPU of one host: aggregate checkpoint throughput, ours vs DCP's FileSystemWriter.

Launch one process per GPU::

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_multi_gpu.py --layers 24

Each rank holds its FSDP2 shard of a stack of bf16 linear layers plus AdamW state (after one
optimizer step). Per repetition: ``dcp.save`` with FileSystemWriter, and ``dcp.async_save`` with
DataStatesWriter (one writer per rank, reused; a gloo group for the checkpoint collectives).
Each checkpoint is loaded back into a fresh FSDP2 model and optimizer, cold (page cache
dropped), and every local shard is compared bit for bit. Aggregate GiB/s = total state bytes /
the slowest rank's time. Rank 0 prints the table and writes JSON next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import GiB, drop_cache, log, machine, median
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, guard


def build(layers: int, dim: int, device: torch.device, seed: int) -> tuple[nn.Module, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model: nn.Module, opt: object, dim: int, device: torch.device) -> None:
    x = torch.randn(8, dim, device=device, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def local_tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in local_tensors(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in local_tensors(v)]
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    return [obj] if isinstance(obj, torch.Tensor) else []


def state_of(model: nn.Module, opt: object) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def timed_all(fn) -> float:
    """Seconds until every rank has finished ``fn`` (the slowest rank's time)."""
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_multi_gpu"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()

    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    ckpt_group = dist.new_group(backend="gloo")

    model, opt = build(args.layers, args.dim, device, seed=0)
    train_step(model, opt, args.dim, device)
    state = state_of(model, opt)
    saved = [t.detach().clone() for t in local_tensors(state)]
    local_bytes = sum(t.numel() * t.element_size() for t in saved)
    sizes = [torch.tensor(local_bytes, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(local_bytes, dtype=torch.int64), group=ckpt_group)
    total = sum(int(s) for s in sizes)
    if rank == 0:
        log(f"{world} ranks, {total / GiB:.2f} GiB of FSDP2 model + AdamW state "
            f"({local_bytes / GiB:.2f} GiB per rank)")

    engine = Engine(host_cache_size=local_bytes + (512 << 20))
    engine.reserve(local_bytes).release()  # map and pin the cache before timing anything
    writer = DataStatesWriter(engine=engine, overwrite=True)
    handle = guard(opt, writer)
    reader = DataStatesReader(engine=engine)
    results: dict[str, dict[str, list[float]]] = {"dcp": {}, "ours": {}}

    def record(side: str, key: str, value: float) -> None:
        results[side].setdefault(key, []).append(value)

    for rep in range(args.reps):
        for side in (("dcp", "ours") if rep % 2 == 0 else ("ours", "dcp")):
            path = args.dir / f"{side}_{rep}"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            if side == "dcp":
                t = timed_all(lambda p=path: dcp.save(
                    state, checkpoint_id=p, storage_writer=FileSystemWriter(p),
                    process_group=ckpt_group))
                record(side, "block_s", t)
                record(side, "durable_s", t)
            else:
                box: dict = {}

                def start(p: Path = path, box: dict = box) -> None:
                    box["resp"] = dcp.async_save(state, checkpoint_id=p, storage_writer=writer,
                                                 process_group=ckpt_group)

                record(side, "block_s", timed_all(start))
                t0 = time.perf_counter()
                box["resp"].staging_completion.result()
                record(side, "snapshot_s", time.perf_counter() - t0)
                box["resp"].upload_completion.result()
                dist.barrier()
                record(side, "durable_s", time.perf_counter() - t0 + results[side]["block_s"][-1])
            if rank == 0:
                drop_cache(list(path.iterdir()))
            model2, opt2 = build(args.layers, args.dim, device, seed=1)
            train_step(model2, opt2, args.dim, device)  # allocate optimizer state to load into
            target = state_of(model2, opt2)
            rd = FileSystemReader(path) if side == "dcp" else reader
            record(side, "load_cold_s", timed_all(lambda p=path, rd=rd, t=target: dcp.load(
                t, checkpoint_id=p, storage_reader=rd, process_group=ckpt_group)))
            set_state_dict(model2, opt2, model_state_dict=target["model"],
                           optim_state_dict=target["optim"])
            got = local_tensors(state_of(model2, opt2))
            same = len(got) == len(saved) and all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(got, saved, strict=True))
            flag = torch.tensor(int(same))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ckpt_group)
            if not flag.item():
                raise SystemExit(f"{side} rep {rep}: loaded state differs from the saved state")
            del model2, opt2, target, got
            if rank == 0:
                log(f"rep {rep} {side}: " + ", ".join(
                    f"{k} {v[-1]:.3f}" for k, v in results[side].items()) + "  (bit-exact)")
                shutil.rmtree(path, ignore_errors=True)

    handle.remove()
    engine.close()
    if rank == 0:
        rows = []
        for side, label in (("dcp", "dcp.save FileSystemWriter"),
                            ("ours", "async_save DataStatesWriter")):
            m = {k: median(v) for k, v in results[side].items()}
            rows.append((label, m))
        log(f"\n=== bench_multi_gpu: {world} GPUs, FSDP2, {total / GiB:.2f} GiB state, "
            f"{args.reps} reps (medians) ===")
        log(f"machine: {machine(torch)}")
        log(f"{'variant':30s} {'block s':>8s} {'snap s':>7s} {'durable s':>9s} "
            f"{'agg GiB/s':>9s} {'cold load s':>11s} {'agg GiB/s':>9s}")
        for label, m in rows:
            snap = m.get("snapshot_s")
            log(f"{label:30s} {m['block_s']:8.3f} {'-' if snap is None else f'{snap:7.3f}':>7s} "
                f"{m['durable_s']:9.2f} {total / GiB / m['durable_s']:9.2f} "
                f"{m['load_cold_s']:11.2f} {total / GiB / m['load_cold_s']:9.2f}")
        d, o = rows[0][1], rows[1][1]
        log(f"speedup ours vs DCP: durable {d['durable_s'] / o['durable_s']:.2f}x, "
            f"cold load {d['load_cold_s'] / o['load_cold_s']:.2f}x, "
            f"training blocked {d['block_s'] / o['block_s']:.0f}x less")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_multi_gpu.json").write_text(
            json.dumps({"world": world, "total_bytes": total, "results": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
