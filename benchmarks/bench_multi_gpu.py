"""FSDP2 on every GPU of one host: aggregate checkpoint throughput, ours vs DCP's FileSystemWriter.

Each rank holds its FSDP2 shard of a stack of bf16 linear layers plus AdamW state (after one
optimizer step). Per repetition: ``dcp.save`` with FileSystemWriter, and ``dcp.async_save`` with
DataStatesWriter (one writer per rank, reused; a gloo group for the checkpoint collectives).
Each checkpoint is loaded back into a fresh FSDP2 model and optimizer, cold (page cache
dropped), and every local shard is compared bit for bit. Aggregate GiB/s = total state bytes /
the slowest rank's time. Rank 0 prints the tables and writes the JSON. Launch one process per
GPU:

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_multi_gpu.py --layers 24
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_multi_gpu.py --cpu-smoke
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness.baselines import futures
from harness.ceilings import GiB, drop_cache
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.states import differs, state_bytes, tensors
from harness.tables import Table, ratio_table
from harness.timing import median, sync
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, guard
from dcp_datastates._sizes import format_size

SIDES = {"dcp": "dcp.save FileSystemWriter", "ours": "async_save DataStatesWriter"}
METRICS = {"block_s": "block", "snapshot_s": "snapshot", "durable_s": "durable",
           "load_cold_s": "cold load"}


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


def state_of(model: nn.Module, opt: object) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def timed_all(fn) -> float:
    """Seconds until every rank has finished ``fn`` (the slowest rank's time)."""
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    dist.barrier()
    return time.perf_counter() - t0


def tables(res: dict) -> list[Table]:
    gib = res["total_bytes"] / GiB
    m = {side: {k: median(v) for k, v in res["results"][side].items()} for side in SIDES}
    t = Table(f"{res['world']} ranks, FSDP2, {format_size(res['total_bytes'])} state "
              f"({res['layers']} layers of {res['dim']}x{res['dim']} bf16 + AdamW), "
              f"{res['reps']} reps, medians",
              [("variant", ""), ("block s", ".3f"), ("snapshot s", ".3f"), ("durable s", ".2f"),
               ("agg GiB/s", ".2f"), ("cold load s", ".2f"), ("agg GiB/s", ".2f")])
    for side, label in SIDES.items():
        r = m[side]
        t.add(label, r["block_s"], r.get("snapshot_s"), r["durable_s"], gib / r["durable_s"],
              r["load_cold_s"], gib / r["load_cold_s"])
    return [t, ratio_table("ratios of times (> 1: ours is faster)",
                           {f"{SIDES['dcp']} / ours": (m["dcp"], m["ours"])}, METRICS)]


def plot(res: dict, png: Path) -> None:
    fig, (ax,) = figure(size=(8, 4.4))
    bars(ax, list(METRICS.values()), {label: [median(res["results"][side].get(k, []))
                                              for k in METRICS] for side, label in SIDES.items()},
         spec=".3g", log=True, ylabel="seconds (median, slowest rank; log scale)")
    save(fig, png, f"FSDP2, {res['world']} ranks, {format_size(res['total_bytes'])}; "
                   f"{res['machine'].get('gpu', 'CPU')}")


def main() -> None:
    ap = parser(__doc__, smoke="gloo on CPU, 2 layers of 256")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_multi_gpu"))
    args = ap.parse_args()
    if args.cpu_smoke:
        args.layers, args.dim = 2, 256

    dist.init_process_group("gloo" if args.cpu_smoke else "cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu_smoke:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    ckpt_group = dist.new_group(backend="gloo")

    model, opt = build(args.layers, args.dim, device, seed=0)
    train_step(model, opt, args.dim, device)
    state = state_of(model, opt)
    saved = [t.detach().clone() for t in tensors(state)]
    local_bytes = state_bytes(saved)
    sizes = [torch.tensor(0, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor(local_bytes, dtype=torch.int64), group=ckpt_group)
    total = sum(int(s) for s in sizes)
    run = Run("bench_multi_gpu", args, [args.dir],
              launcher="torchrun --standalone --nproc-per-node "
                       f"{os.environ.get('LOCAL_WORLD_SIZE', world)}")
    if rank == 0:
        run.header()
        log(f"{world} ranks, {format_size(total)} of FSDP2 model + AdamW state "
            f"({format_size(local_bytes)} per rank)")

    engine = Engine(host_cache_size=local_bytes + (512 << 20))
    engine.reserve(local_bytes).release()  # map and pin the cache before timing anything
    writer = DataStatesWriter(engine=engine, overwrite=True)
    handle = guard(opt, writer)
    reader = DataStatesReader(engine=engine)
    results: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}

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
                staging, upload = futures(box["resp"])
                t0 = time.perf_counter()
                staging.result()
                record(side, "snapshot_s", time.perf_counter() - t0)
                upload.result()
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
            flag = torch.tensor(int(not differs(saved, tensors(state_of(model2, opt2)))))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ckpt_group)
            if not flag.item():
                raise SystemExit(f"{side} rep {rep}: loaded state differs from the saved state")
            del model2, opt2, target
            if rank == 0:
                log(f"rep {rep} {side}: " + ", ".join(
                    f"{k} {v[-1]:.3f}" for k, v in results[side].items()) + "  (bit-exact)")
                shutil.rmtree(path, ignore_errors=True)

    handle.remove()
    engine.close()
    if rank == 0:
        run.res.update(world=world, layers=args.layers, dim=args.dim, reps=args.reps,
                       total_bytes=total, results=results)
        run.finish(tables, plot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
