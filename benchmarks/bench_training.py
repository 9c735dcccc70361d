"""Training-loop overhead of checkpointing: a GPT with AdamW on one GPU, or FSDP2 on several.

Modes (``harness/training/modes.py``), in one run on the same model, each as its users write
it and timed from its first step: ``none`` (no checkpoints; run first and again last),
``dcp_pinned`` (``dcp.async_save`` + a fresh FileSystemWriter + DCP's pinned DefaultStager,
waiting for ``staging_completion`` right before the next ``optimizer.step()``), ``ours``
(``dcp.async_save`` with a fresh ``DataStatesWriter()``, no guard), and
the ``CheckpointManager`` modes, a fresh manager each: ``tiers`` (every ``--every`` steps),
``tiers_replicate`` (the same with ``replicate=True``; several ranks only), ``tiers_budget``
(every step, ``max_overhead=0.05``) and ``tiers_every_step``. The DCP modes keep one checkpoint
in flight (the next waits for the previous to be durable). Then, measured in the same run: the
ceilings (idle pinned D2H, the disk's write and cold read, all ranks at once), cold loads of the
DCP modes' last checkpoints checked bit for bit, and restarts after ``tiers_replicate`` (one
process: ``tiers``): from memory (the rank whose node is lost from its peer's replica) against
the durable tier, to the first training step.

Under torchrun each rank trains its FSDP2 shard on its own GPU (``LOCAL_RANK``); a step's time
is the slowest rank's; rank 0 prints the tables and writes the JSON and the PNG.

    python benchmarks/bench_training.py --preset 8g --steps 120 --dcp-every 30   # one GPU
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_training.py --preset 8gib \
        --steps 120 --dcp-every 30                                      # FSDP2 on two GPUs
    ... --prepare wait --skip dcp_pinned ours        # the managers' steady state, to compare
    python benchmarks/bench_training.py --cpu-smoke                     # checks the code paths
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_training.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from harness.ceilings import copies_together, copy_ceiling, disk_ceiling, disk_together
from harness.machine import free_bytes, require
from harness.ranks import Ranks
from harness.run import Run, log, parser
from harness.states import state_bytes
from harness.timing import median, sync
from harness.training.loop import run_mode, slowest
from harness.training.model import Trainer
from harness.training.modes import MODES, Context, tier_dirs
from harness.training.report import ms, params, plot, summarize, tables
from harness.training.restore import READERS, cold_load, restarts, resume_child

from dcp_datastates._sizes import format_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")

PRESETS = {  # name: (layers, batch per rank, fp32)
    "8g": (12, 16, True),
    "8gib": (13, 16, True),
}


def arguments() -> argparse.Namespace:
    ap = parser(__doc__, smoke="tiny model on CPU (gloo under torchrun), 8 steps, checkpoint "
                               "every 4")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step and rank")
    ap.add_argument("--fp32", action="store_true",
                    help="fp32 parameters and AdamW state, bf16 autocast compute")
    ap.add_argument("--preset", choices=list(PRESETS),
                    help="8g: 12 layers, fp32 state (7.5 GiB), batch 16; 8gib: 13 layers, "
                         "fp32 state (8.07 GiB in total: 4.03 GiB a rank on two), batch 16 "
                         "per rank. Default: 20 layers, bf16 (6 GiB)")
    ap.add_argument("--steps", type=int, default=40,
                    help="timed steps per mode: a multiple of --every and --dcp-every (the "
                         "last step saves: its checkpoint is loaded back and checked)")
    ap.add_argument("--every", type=int, default=10,
                    help="checkpoint interval of 'tiers' and 'tiers_replicate'")
    ap.add_argument("--dcp-every", type=int, default=None,
                    help="checkpoint interval of the DCP modes (default: --every)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each mode")
    ap.add_argument("--prepare", choices=["background", "wait"], default="background",
                    help="CheckpointManager modes: 'background' (the README's idiom): "
                         "prepare(state) right before the first timed step; 'wait' (the "
                         "steady state): prepare(state, wait=True) off the clock")
    ap.add_argument("--dir", default="/tmp/bench_training", help="checkpoint directory")
    ap.add_argument("--memory-dir", default="/dev/shm/bench_training",
                    help="the memory tiers' root (a directory per mode and rank)")
    ap.add_argument("--gc", choices=["default", "freeze"], default="default",
                    help="freeze: gc.freeze() once the model and optimizer are made (every "
                         "mode): a full collection then skips them (README: 'Python's GC')")
    ap.add_argument("--no-restart", action="store_true",
                    help="leave out the restart figures (new managers from memory and from "
                         "the durable tier; in one process also a new process's resume)")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(MODES), metavar="MODE",
                    help=f"modes to leave out: {', '.join(MODES)}")
    ap.add_argument("--resume-child", nargs=2, metavar=("MEMORY", "DURABLE"),
                    help=argparse.SUPPRESS)  # the process resume_in_child starts
    args = ap.parse_args()
    if args.preset:
        args.layers, args.batch, args.fp32 = PRESETS[args.preset]
    if args.cpu_smoke:
        args.layers, args.dim, args.heads, args.vocab, args.seq, args.batch = 2, 64, 4, 256, 32, 4
        args.steps, args.every, args.warmup = 8, 4, 1
    args.dcp_every = args.dcp_every or args.every
    for name in ("every", "dcp_every"):
        if args.steps % getattr(args, name):
            ap.error(f"--steps {args.steps} is not a multiple of --{name.replace('_', '-')} "
                     f"{getattr(args, name)}: the last step must save")
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu-smoke to check the script on CPU")
    return args


def ceilings(cx: Context, root: Path, local: int) -> dict:
    """Idle pinned D2H (GPU only) and the disk's write and cold read, every rank at once."""
    r = cx.ranks
    out = {}
    if r.device == "cuda":
        out["copy"] = copies_together(r.gather(copy_ceiling(min(local, 2 << 30),
                                                            barrier=r.barrier)))
    out["disk"] = disk_together(r.gather(disk_ceiling(
        root, min(local, 4 << 30), name=f"ceiling_disk_{r.rank}.bin", barrier=r.barrier)))
    return out


def after_mode(cx: Context, name: str, path: Path, host: dict | None, res: dict) -> None:
    """What follows a mode: the cold load of a DCP mode's last checkpoint, the restarts after
    the restart mode; then its directories go (the memory tiers' and the checkpoints')."""
    rec = res["runs"].get(name, {})
    if host is not None and name in READERS:
        res.setdefault("loads", {})[name] = cold_load(cx, name, Path(rec["last_path"]), host)
    elif host is not None:
        res["restart"] = {"mode": name, **restarts(cx, path, name == "tiers_replicate", host)}
    shutil.rmtree(tier_dirs(cx, path)[1], ignore_errors=True)
    cx.ranks.barrier()
    if cx.ranks.lead:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(cx.memory / name, ignore_errors=True)


def main() -> None:
    t_start = time.perf_counter()
    args = arguments()
    if args.cpu_smoke:
        torch.set_num_threads(1)  # ranks share the few cores
    ranks = Ranks.start(args.cpu_smoke)
    if args.resume_child:
        return resume_child(args, ranks.device)
    if args.log is not None and ranks.world > 1:  # a log per rank
        args.log = args.log.with_name(f"{args.log.stem}.rank{ranks.rank}{args.log.suffix}")
    root, memory = Path(args.dir).resolve(), Path(args.memory_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    memory.mkdir(parents=True, exist_ok=True)
    cx = Context(Trainer(args, ranks.device, ranks.world), ranks, memory, args.prepare)
    cx.tr.step()  # creates the optimizer state
    sync()
    if args.gc == "freeze":  # what a long training loop may do once it is set up
        gc.freeze()
    local = state_bytes(cx.tr.state(0))
    per_rank = ranks.gather(local)
    total = sum(per_rank)
    require(str(root), int(2.2 * total), free_bytes(root), "2 checkpoints")
    modes = [m for m in MODES if m not in args.skip and MODES[m].ranks <= ranks.world]
    plan = [*modes, "none"] if "none" in modes and len(modes) > 1 else modes
    restart_mode = None if args.no_restart else next(
        (m for m in ("tiers_replicate", "tiers") if m in modes), None)
    run = Run("bench_training", args, [root, memory], fail_fast=ranks.world > 1,
              launcher=f"torchrun --standalone --nproc-per-node {ranks.world}"
              if ranks.world > 1 else "python")
    res = run.res
    res.update(**{k: getattr(args, k) for k in ("layers", "dim", "heads", "vocab", "seq",
                                                 "batch", "steps", "every", "dcp_every",
                                                 "warmup", "fp32", "prepare")},
               world=ranks.world, device=ranks.device, n_params=cx.tr.n_params,
               ckpt_bytes=total, ckpt_bytes_per_rank=per_rank, dir=str(root), setup={},
               runs={}, summary={})
    if ranks.lead:
        run.header()
        log(f"model: {params(cx.tr.n_params)} params on {ranks.world} x {ranks.device}; "
            f"checkpoint {format_size(total)}" + (f" ({format_size(local)} on rank 0)"
                                                  if ranks.world > 1 else "")
            + f"; {format_size(free_bytes(root))} free in {root}")
        shm = (8 if "tiers_replicate" in modes else 5) * total  # keep_memory + 3 slots a rank
        if any(m.startswith("tiers") for m in modes):  # and up to 3 replicas of its peer's
            log(f"memory tiers: up to {format_size(shm)} in {memory} at once, "
                f"{format_size(free_bytes(memory))} free"
                + (" (TOO LITTLE: saves will fail with TierFullError)"
                   if free_bytes(memory) < shm else ""))
    try:
        for i, mode in enumerate(plan):
            name = mode if mode not in plan[:i] else f"{mode}#2"
            rec: dict = {}
            t_mode = time.perf_counter()
            keep = name in READERS or name == restart_mode
            host = run.guard(name, run_mode, MODES[mode], cx, root / name, rec, keep)
            res["runs"][name] = slowest(ranks.gather(rec))
            if "setup_s" in res["runs"][name]:
                res["setup"][f"{name} manager + prepare"] = res["runs"][name]["setup_s"]
            run.guard(f"{name}: after", after_mode, cx, name, root / name, host, res)
            if ranks.lead:
                log(f"{name}: {mode_line(res['runs'][name])}; mode took "
                    f"{time.perf_counter() - t_mode:.1f} s (elapsed "
                    f"{time.perf_counter() - t_start:.0f} s)")
                run.write()  # what is done so far, should a later mode fail
        res.update(run.guard("ceilings", ceilings, cx, root, local) or {})
    finally:  # the tables of what was measured, also where a rank failed (fail fast)
        if ranks.lead:
            report(run)
    ranks.close()


def mode_line(rec: dict) -> str:
    steps = rec.get("step_s", [])
    tier = rec.get("tiers")
    return (f"{len(steps)} steps, median {ms(median(steps)) or 0:.1f} ms, mean "
            f"{ms(sum(steps) / max(1, len(steps))):.1f} ms, max "
            f"{ms(max(steps, default=0)):.1f} ms"
            + (f"; {tier['saves']} saves, {tier.get('skipped', 0)} skipped, "
               f"{tier['persisted']} persisted" if tier else ""))


def report(run: Run) -> None:
    """Each mode's summary against the no-checkpoint steps (both runs), the tables, the JSON
    and the PNG."""
    run.fail_fast = False  # nothing collective from here: a table that fails is recorded
    res = run.res
    runs = res["runs"]
    both = runs.get("none", {}).get("step_s", []) + runs.get("none#2", {}).get("step_s", [])
    if "none#2" in runs:
        first, again = median(runs["none"].get("step_s", [])), median(runs["none#2"]["step_s"])
        res["baseline_drift_pct"] = 100 * (again / first - 1) if first and again else None
    base = median(both)
    res["summary"] = {m: summarize({"step_s": both} if m == "none" else r, base)
                      for m, r in runs.items() if m != "none#2"}
    run.finish(tables, plot)


if __name__ == "__main__":
    main()
