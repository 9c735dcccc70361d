"""Loads of what the modes saved, each checked bit for bit against a host copy of the state
the checkpoint holds, and the restart figures: new managers after a node's memory tier is lost
(the lost rank from its peer's replica), from the durable tier alone, and, in one process, a
new process resuming from the memory tier."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import set_state_dict

from dcp_datastates import CheckpointManager, DataStatesReader
from harness.ceilings import drop_cache
from harness.run import log
from harness.states import blank, differs, poison
from harness.timing import step_sync, sync

from .model import Trainer
from .modes import Context, manager, tier_dirs

READERS = {  # mode: (what reads its checkpoints, a fresh one for the directory)
    "ours": ("DataStatesReader()", lambda path: DataStatesReader()),
    "dcp_pinned": ("FileSystemReader", FileSystemReader),
}


def cold_load(cx: Context, mode: str, path: Path, host: dict) -> dict:
    """``dcp.load`` of the checkpoint in ``path`` (saved by ``mode``) with a fresh reader,
    page cache dropped, into a blank state like the trainer's (on its device); seconds of the
    slowest rank, and whether every rank's local shards equal ``host``, bit for bit."""
    name, reader = READERS[mode]
    target = blank(cx.tr.state(0))
    cx.ranks.barrier()
    evict = drop_cache([path]) if cx.ranks.lead else None
    cx.ranks.barrier()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=path, storage_reader=reader(path))
    sync()
    seconds = cx.ranks.slowest(time.perf_counter() - t0)
    same = cx.ranks.all(not differs(host, target))
    return {"reader": name, "load_s": seconds, "bit_exact": same, "evict": evict}


def restart(cx: Context, make: Callable[[], CheckpointManager], host: dict,
            lose: Callable[[], object]) -> dict:
    """A restart as a job makes one: after ``lose()`` (what the failure takes away), a new
    manager on every rank loads the newest step into the trainer's state (poisoned first),
    then ``set_state_dict`` and one training step. Seconds (the slowest rank's) from the new
    manager to the loaded state and to the end of that step, the bit-for-bit check against
    ``host`` left out of the clock."""
    state = cx.tr.state(0)
    with torch.no_grad():
        poison(state)
    what = lose()
    cx.ranks.barrier()
    t0 = time.perf_counter()
    tiers = make()
    made = time.perf_counter() - t0
    try:
        step = tiers.load(state)
        sync()
        loaded = time.perf_counter() - t0
        same = not differs(host, state)
        t1 = time.perf_counter()
        set_state_dict(cx.tr.model, cx.tr.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        cx.tr.step()
        step_sync()
        first = loaded + time.perf_counter() - t1
    finally:
        tiers.close()
    r = cx.ranks
    return {"step": step, "lost": what, "manager_s": r.slowest(made), "load_s": r.slowest(loaded),
            "to_first_step_s": r.slowest(first), "bit_exact": r.all(same)}


def restarts(cx: Context, path: Path, replicate: bool, host: dict) -> dict:
    """After a ``CheckpointManager`` mode in ``path`` (closed: its newest step persisted):
    ``replica``: the last rank's memory tier deleted (its node lost; with one rank, none:
    the node survived), a restart from memory (that rank from its peer's replica);
    ``resume`` (one process): a new process resumes from the memory tier; ``durable``: every
    memory tier deleted and the page cache dropped, a restart from the durable tier."""
    durable, memory = tier_dirs(cx, path)
    last = cx.ranks.world - 1

    def lose_node() -> str:
        if cx.ranks.world > 1 and cx.ranks.rank == last:
            shutil.rmtree(memory)
        return f"rank {last}'s memory tier" if cx.ranks.world > 1 else "nothing"

    def lose_all() -> str:
        shutil.rmtree(memory, ignore_errors=True)
        cx.ranks.barrier()
        evict = drop_cache([durable]) if cx.ranks.lead else ""
        return f"every memory tier; page cache ({evict})"

    def make() -> CheckpointManager:
        return manager(durable, memory, replicate)

    out = {"replica": restart(cx, make, host, lose_node)}
    if cx.ranks.world == 1:
        out.update(resume_in_child(memory, durable))
    out["durable"] = restart(cx, make, host, lose_all)
    return out


RESUMED = "RESUMED "


def resume_in_child(memory: Path, durable: Path) -> dict:
    """A new process resumes from the memory tier (as a job restarted after a crash: a new
    manager, ``load``, ``prepare``, a training step, a save): its marks in seconds from its
    start, and the goal's ratio: manager + load + prepare + first step over the load."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the child trains the same model on the same GPU
    t0 = time.time()
    out = subprocess.run([sys.executable, str(Path(sys.argv[0]).resolve()), *sys.argv[1:],
                          "--resume-child", str(memory), str(durable)],
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith(RESUMED)), None)
    if line is None:
        log(f"resume child failed (rc {out.returncode}): {out.stderr[-3000:]}")
        return {}
    got = json.loads(line[len(RESUMED):])
    marks = {k: v - t0 for k, v in got.pop("marks").items()}
    load_s = marks["loaded"] - marks["manager"]
    to_step = marks["first_step"] - marks["manager"]
    return {"resume": {**got, "marks": marks, "load_s": load_s, "to_first_step_s": to_step,
                       "over_load": to_step / load_s if load_s else None,
                       "start_to_first_step_s": marks["first_step"]}}


def resume_child(args: argparse.Namespace, device: str) -> None:
    """The child of :func:`resume_in_child`: prints its marks (``time.time()``) as JSON."""
    marks = {"imported": time.time()}
    tr = Trainer(args, device)
    tr.step()  # the optimizer state exists to load into, as in any DCP resume
    sync()
    memory, durable = args.resume_child
    state = tr.state(0)
    marks["manager"] = time.time()
    tiers = CheckpointManager(durable, memory_dir=memory, keep_memory=1, persist=None)
    marks["made"] = time.time()
    step = tiers.load(state)
    sync()
    marks["loaded"] = time.time()
    tiers.prepare(state)  # slots sized and pinned in the background
    marks["prepared"] = time.time()
    tr.step()
    sync()
    marks["first_step"] = time.time()
    tr.step()
    sync()
    marks["second_step"] = time.time()
    handle = tiers.save(step + 1, tr.state(step + 1))  # while the slots are being pinned
    handle.committed.result()
    marks["first_save"] = time.time()
    tiers.close()
    marks["closed"] = time.time()
    f = handle.figures
    print(RESUMED + json.dumps({"marks": marks, "step": step, "save_blocked_s": f.blocked_s,
                                "save_snapshot_s": f.snapshot_s, "save_memory_s": f.memory_s}),
          flush=True)
