"""The ways to checkpoint that ``bench_training.py`` compares, each as its users write it.

A mode's saver is a context manager entered right before the first timed step (so whatever a
mode sets up on first use is on the clock): it yields a ``Save`` that starts one checkpoint
and adds its own figures to the mode's record when the mode is done.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp

from dcp_datastates import CheckpointManager, DataStatesWriter
from harness.baselines import async_save_pinned
from harness.ranks import Ranks
from harness.states import state_bytes

from .model import Trainer

Save = Callable[[dict, int], object]  # (state, step) -> what dcp.async_save returned


@dataclass
class Context:
    """What the modes share: the trainer, the ranks, the memory tiers' root (node memory)
    and the ``--prepare`` choice of the ``CheckpointManager`` modes."""

    tr: Trainer
    ranks: Ranks
    memory: Path
    prepare: str = "background"


@dataclass(frozen=True)
class Mode:
    """One way to checkpoint during training.

    ``saver(cx, path, rec)``: see the module's docstring; None: no checkpoints. ``every``:
    the checkpoint interval, or the name of the argument giving it. ``reuse_state``: build the
    state dict once and save it again at each checkpoint (its tensors are the live parameters
    and optimizer states, updated in place), so an every-step mode does not time
    ``get_state_dict`` at every step.
    """

    label: str
    saver: Callable[[Context, Path, dict], AbstractContextManager[Save]] | None = None
    snapshot_before_step: bool = False  # wait for the snapshot right before optimizer.step()
    every: int | str = "every"
    wait_previous: bool = True  # the previous checkpoint must be done before the next starts
    reuse_state: bool = False
    ranks: int = 1  # the fewest ranks the mode makes sense with

    def interval(self, args: object) -> int:
        return self.every if isinstance(self.every, int) else getattr(args, self.every)


@contextmanager
def checkpoints(cx: Context, path: Path, rec: dict) -> Iterator[Callable[[int], Path]]:
    """Where each save of a DCP mode goes: ``path/step_<N>`` (DCP's idiom: a directory per
    checkpoint). Starting one removes those before the previous (durable by then: the loop
    waits for it), off the training thread, on rank 0 (the directory is the ranks')."""
    removing = ThreadPoolExecutor(1, thread_name_prefix="bench-rm") if cx.ranks.lead else None
    made: list[Path] = []

    def where(step: int) -> Path:
        made.append(path / f"step_{step}")
        if removing is not None:
            for old in made[:-2]:
                removing.submit(shutil.rmtree, old, ignore_errors=True)
        del made[:-2]
        rec["last_path"] = str(made[-1])
        return made[-1]

    try:
        yield where
    finally:
        if removing is not None:
            removing.shutdown(wait=True)


@contextmanager
def dcp_pinned(cx: Context, path: Path, rec: dict) -> Iterator[Save]:
    """``dcp.async_save`` with a fresh FileSystemWriter and DCP's pinned DefaultStager."""
    with checkpoints(cx, path, rec) as where:
        yield lambda state, step: async_save_pinned(state, where(step), cx.ranks.device == "cuda")


@contextmanager
def ours(cx: Context, path: Path, rec: dict) -> Iterator[Save]:
    """The README's idiom: ``dcp.async_save`` with a fresh ``DataStatesWriter()`` per save
    (default arguments: the process's engine, which orders every optimizer step after its
    snapshots by itself)."""
    stats = []
    with checkpoints(cx, path, rec) as where:
        def save(state: dict, step: int) -> object:
            writer = DataStatesWriter()
            resp = dcp.async_save(state, checkpoint_id=where(step), storage_writer=writer)
            stats.append(writer.last_stats())
            return resp

        yield save
    rec["snapshots"] = {"bytes": state_bytes(cx.tr.state(0)),
                        "copy_s": [st.copy_s for st in stats],
                        "snapshot_s": [st.snapshot_s for st in stats],
                        "durable_s": [st.durable_s for st in stats]}
    if stats:
        st = stats[-1]
        rec["ours_last_stats"] = {"backend": st.backend, "o_direct": st.direct_io,
                                  "bytes": st.bytes_written, "flush_s": st.flush_s,
                                  "durable_s": st.durable_s}


def manager(durable: Path, memory: Path, replicate: bool,
            max_overhead: float | None = None) -> CheckpointManager:
    """The manager of the ``CheckpointManager`` modes (and of their restarts), default engine."""
    return CheckpointManager(durable, memory_dir=memory, keep_memory=2, keep_durable=1,
                             persist="idle", replicate=replicate, max_overhead=max_overhead)


def tier_dirs(cx: Context, path: Path) -> tuple[Path, Path]:
    """(durable tier, this rank's memory tier) of the mode whose directory is ``path``."""
    return path / "durable", cx.memory / path.name / f"rank_{cx.ranks.rank}"


class _Response:
    """A managed save as the loop sees a DCP response: its snapshot and its memory commit."""

    def __init__(self, handle: object) -> None:
        self.staging_completion, self.upload_completion = handle.staged, handle.committed


@contextmanager
def tiers(cx: Context, path: Path, rec: dict, max_overhead: float | None = None,
          replicate: bool = False) -> Iterator[Save]:
    """A fresh ``CheckpointManager`` (memory tier per rank under ``cx.memory``, persisted
    whenever the previous persist is over) and ``manager.prepare(state)`` (``--prepare wait``:
    ``wait=True``, off the clock). The tiers stay when the mode ends (the restart figures read
    them)."""
    durable, memory = tier_dirs(cx, path)
    shutil.rmtree(memory, ignore_errors=True)
    state = cx.tr.state(0)
    t0 = time.perf_counter()
    tiers = manager(durable, memory, replicate, max_overhead)
    reasons: Counter[str] = Counter()
    asked: list[int] = []
    box = {"t0": None}

    def save(state: dict, step: int) -> _Response:
        box["t0"] = box["t0"] or time.perf_counter()
        asked.append(step)
        handle = tiers.save(step, state)
        if handle.skipped:
            reasons[handle.reason.split(";")[0].split(" (")[0]] += 1
        return _Response(handle)

    try:
        tiers.prepare(state, wait=cx.prepare == "wait")
        rec["setup_s"] = time.perf_counter() - t0
        yield save
        tiers.wait()
        if box["t0"] is None:
            return
        span = time.perf_counter() - box["t0"]
        taken = [f for f in tiers.history if not f.skipped]
        persisted = [f for f in taken if f.persist_s is not None]
        rec["tiers"] = {"saves": len(taken), "persisted": len(persisted),
                        "skipped": len(tiers.history) - len(taken), "span_s": span,
                        "bytes": state_bytes(state), "asked_steps": asked,
                        "taken_steps": [f.step for f in taken],
                        "persist_s": [f.persist_s for f in persisted],
                        "memory_s": [f.memory_s for f in taken],
                        "snapshot_s": [f.snapshot_s for f in taken],
                        "copy_s": [f.copy_s for f in taken],
                        "blocked_s": [f.blocked_s for f in taken],
                        "cost_s": [f.cost_s for f in taken],
                        "skip_reasons": dict(reasons)}
        rec["snapshots"] = {k: rec["tiers"][k] for k in ("bytes", "copy_s", "snapshot_s")}
    finally:
        tiers.close()


MODES = {
    "none": Mode("no checkpoint"),
    "dcp_pinned": Mode("DCP async_save + FileSystemWriter + pinned DefaultStager", dcp_pinned,
                       snapshot_before_step=True, every="dcp_every"),
    "ours": Mode("DCP async_save + DataStatesWriter()", ours, every="dcp_every"),
    "tiers": Mode("CheckpointManager: memory tier + persist", tiers, wait_previous=False),
    "tiers_replicate": Mode("CheckpointManager, replicate=True",
                            functools.partial(tiers, replicate=True), wait_previous=False,
                            ranks=2),
    "tiers_budget": Mode("CheckpointManager, every step, max_overhead=0.05",
                         functools.partial(tiers, max_overhead=0.05), every=1,
                         wait_previous=False, reuse_state=True),
    "tiers_every_step": Mode("CheckpointManager, every step", tiers, every=1,
                             wait_previous=False, reuse_state=True),
}
