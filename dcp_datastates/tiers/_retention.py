"""Retention and going back: which steps the tiers keep, and the marks of steps being read.

Each tier keeps its newest ``keep`` committed steps (unfinished ones older than the newest
committed go too), except memory steps marked as being read (a persist, a replica send): those
stay until read, and retention runs again after; and the newest step sent to the peers, which
stays until a newer one is sent or training leaves it (going back, the step saved again). A
dropped memory step's ``.metadata`` goes first, then its data file goes back to being a free
slot. Going back (``load`` of an older step, then training on) sets the newer steps aside; a
step saved again is set aside the same way once every rank committed the new save.
``durable_dir/.abandoned`` keeps the newest ``keep_durable`` sets of steps set aside.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .._format.directory import DIR_MODE, new_token
from . import _replica as replica
from ._ranks import Ranks
from ._slots import SlotPool
from ._steps import (
    committed,
    committed_steps,
    remove_step,
    size_of,
    step_dir,
    steps,
    uncommit,
)

log = logging.getLogger("dcp_datastates")

#: Where the durable steps that training left are set aside, a directory per set.
ABANDONED = ".abandoned"


class Retention:
    """Keeps the tiers of one rank (its memory tier ``memory``, the replicas it holds, the
    durable tier ``durable``) to their sizes; ``slots``: the memory tier's slot pool, if any."""

    def __init__(self, memory: Path, durable: Path | None, slots: SlotPool | None,
                 ranks: Ranks, keep_aside: int | None = None) -> None:
        self.memory, self.durable, self.slots, self.ranks = memory, durable, slots, ranks
        self.keep_aside = keep_aside  # sets of steps kept in durable/.abandoned (None: all)
        self._lock = threading.Lock()
        self._dropping = threading.Lock()  # held by one drop at a time
        self._busy: dict[int, int] = {}  # memory steps being read, and by how many
        self._sent: int | None = None  # the newest memory step on the peers: kept

    def memory_roots(self) -> list[Path]:
        """This rank's memory tier and the replicas it holds of every rank."""
        return [self.memory, *(replica.replica_root(self.memory, r)
                               for r in range(self.ranks.world))]

    @contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """Marks the memory step ``step`` as being read meanwhile: retention leaves it."""
        with self._lock:
            self._busy[step] = self._busy.get(step, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._busy[step] - 1
                if left:
                    self._busy[step] = left
                else:
                    del self._busy[step]

    def keep_sent(self, step: int | None) -> None:
        """Keep the memory step ``step``, the newest on the peers, until the next call (None:
        none), or until going back or a save of it again sets it aside."""
        with self._lock:
            self._sent = step

    def _kept(self) -> set[int]:
        """The memory steps retention leaves (lock held): being read, or the newest sent."""
        return set(self._busy) | ({self._sent} if self._sent is not None else set())

    def retain(self, root: Path, keep: int | None) -> None:
        """Drop committed steps beyond the newest ``keep`` and unfinished ones older than the
        newest committed, except steps being read and the newest sent."""
        done = committed_steps(root)
        if keep is None or not done:
            return
        with self._lock:
            busy = self._kept() if root == self.memory else set()
        newest = done[-1]
        drop = [s for s in steps(root) if s not in busy and (
            s in done[:-keep] or (s < newest and s not in done))]
        for s in drop:
            self.drop(root, s)

    def drop(self, root: Path, step: int, *, reuse_slot: bool = True) -> bool:
        """Remove ``step`` from the tier ``root``; from this rank's memory tier only if it is
        not being read nor the newest sent, and its data file goes back to being a free slot
        (``reuse_slot``) or goes with it. Returns whether it went. Drops are made one at a
        time (the thread that keeps the tiers, and a save making room)."""
        directory = step_dir(root, step)
        with self._dropping:
            if root == self.memory:
                with self._lock:  # a step marked as being read meanwhile stays committed
                    if step in self._kept():
                        return False
                    uncommit(directory)
                if self.slots is not None:  # uncommitted: its data file may be a slot
                    if reuse_slot:
                        self.slots.reclaim(directory)
                    else:
                        self.slots.discard(directory)
            remove_step(directory)
        return True

    def make_room(self, shortfall: int) -> list[int]:
        """Free ``shortfall`` bytes of the memory tiers by dropping steps that the durable tier
        holds committed (their copies there stay), oldest first, if they hold that much (else
        none goes); return those dropped (logged). Their data files are deleted, not kept as
        free slots (those would take the same room)."""
        if self.durable is None:
            return []
        persisted = sorted((s, root) for root in self.memory_roots()
                           for s in committed_steps(root)
                           if committed(step_dir(self.durable, s)))
        sizes = [size_of(step_dir(root, s)) for s, root in persisted]
        if sum(sizes) < shortfall:
            return []
        dropped: list[int] = []
        for (s, root), size in zip(persisted, sizes, strict=True):
            if shortfall <= 0:
                break
            if self.drop(root, s, reuse_slot=False):
                dropped.append(s)
                shortfall -= size
        if dropped:
            log.warning("dcp_datastates: the memory tier %s was full: persisted step(s) %s "
                        "dropped from it to make room (their durable copies stay)",
                        self.memory, dropped)
        return dropped

    def set_aside(self, after: int) -> None:
        """Training went on from ``after`` (``load`` of an older step): the steps newer than it
        belong to the run that was left. They leave the memory tiers, and the durable ones move
        to ``durable_dir/.abandoned/<time>/`` (kept, no longer taken for checkpoints of this
        run), so a later step of the same number is saved and persisted anew. Collective."""
        self._put_aside(lambda s: s > after, f"training went on from step {after}")

    def replace(self, step: int) -> None:
        """``step`` was saved again, and every rank committed the new save in its memory tier
        (which replaced the old copy there as it committed): the replicas of the old copies
        leave the memory tiers and the old durable copy moves to
        ``durable_dir/.abandoned/<time>/``, so that no tier holds the old state under that
        step. Collective."""
        self._put_aside(lambda s: s == step, f"step {step} is saved again", mine=False)

    def _put_aside(self, which: Callable[[int], bool], why: str, *, mine: bool = True) -> None:
        """Steps ``which`` leave the memory tiers (this rank's own only if ``mine``); the
        durable ones move to ``durable_dir/.abandoned/<time>/``."""
        with self._lock:  # the newest step sent belongs to the run left: it goes too
            if self._sent is not None and which(self._sent):
                self._sent = None
        for root in self.memory_roots()[0 if mine else 1:]:
            for s in steps(root):
                if which(s):
                    self.drop(root, s)
        durable = self.durable
        moving = [s for s in steps(durable) if which(s)] if durable else []
        if durable is not None and moving and self.ranks.rank == 0:  # (moving: a durable)
            aside = _new_aside(durable / ABANDONED)
            for s in moving:
                os.rename(step_dir(durable, s), aside / step_dir(durable, s).name)
            log.warning("dcp_datastates: %s: the durable steps %s were moved to %s", why,
                        moving, aside)
            self._prune_aside(durable)
        self.ranks.barrier()  # no rank persists into a step being moved

    def _prune_aside(self, durable: Path) -> None:
        """Keep the newest ``keep_aside`` sets of ``durable/.abandoned`` (removed oldest first,
        each step's ``.metadata`` first; logged)."""
        root = durable / ABANDONED
        if self.keep_aside is None:
            return
        sets = sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink()),
                      key=lambda p: (p.stat().st_mtime_ns, p.name))
        old = sets[:-self.keep_aside]
        for aside in old:
            for entry in aside.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    remove_step(entry)
            shutil.rmtree(aside, ignore_errors=True)
        if old:
            log.info("dcp_datastates: removed %s from %s (it keeps the newest %d, as "
                     "keep_durable)", ", ".join(p.name for p in old), root, self.keep_aside)


def _new_aside(root: Path) -> Path:
    """A new directory ``root/<time>`` (``<time>-<token>`` where that one exists)."""
    root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    name = time.strftime("%Y%m%dT%H%M%S")
    while True:
        try:
            (root / name).mkdir(mode=DIR_MODE)
            return root / name
        except FileExistsError:
            name = f"{time.strftime('%Y%m%dT%H%M%S')}-{new_token()[:6]}"
