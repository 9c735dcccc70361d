"""Saves into the memory tier: admission, the snapshot, DCP's one-process save, and what
follows each commit (the slot, the figures, retention, the replica's exchange).

A save is admitted only if the tier has room for it (else :class:`TierFullError`, and nothing
is written). It is an explicit save job of the engine (``_jobs/explicit.py``): its snapshot
runs on the engine's staging thread (into a slot of the tier on tmpfs); its flush and commit
run on the upload thread. What follows the commits runs in save order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor

from .._engine import Engine
from .._format.align import round_up
from .._jobs.explicit import ExplicitSave
from .._memory.host_cache import nbytes_of
from .._sizes import format_size, free_bytes
from ..errors import TierFullError
from ._handles import SaveFigures, SaveHandle, failed_handle
from ._plans import ReusingPlanner
from ._ranks import Ranks
from ._replicator import Replicator
from ._retention import Retention
from ._slots import NextSlot, Slot, SlotPool
from ._steps import (
    TierRecord,
    committed,
    make_private,
    mark_replacing,
    settle_replacing,
    size_of,
    step_dir,
    steps,
)

log = logging.getLogger("dcp_datastates")

#: Room a memory-tier save needs besides its tensors: headers and bytes items.
SLACK_BYTES = 1 << 20


class MemorySaver:
    """Starts this rank's saves into its memory tier and settles them in save order.

    ``limit``: bytes the tier may hold (None: what its file system has free); ``replicator``:
    sends the steps to the peers (None: no replicas); ``history``: where the figures of the
    saves committed go.
    """

    def __init__(self, retention: Retention, limit: int | None, keep: int,
                 slots: SlotPool | None, ranks: Ranks, replicator: Replicator | None,
                 engine: Callable[[], Engine], history: deque[SaveFigures]) -> None:
        self.retention, self.memory = retention, retention.memory
        self.limit, self.keep, self.slots = limit, keep, slots
        self.ranks, self.replicator = ranks, replicator
        self.engine, self.history = engine, history
        # flushes and commits the saves, one at a time
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-upload")
        # a save's place in the engine's save order and its upload's in the queue are taken
        # together: an upload queued ahead of an earlier save's waits for its turn for good
        # (an owned save holds the line until it ends), so saves from two threads would hang
        self._queue = threading.Lock()
        #: plans the saves (one at a time, on the upload thread), reusing the last plans
        self.planner = ReusingPlanner()
        self._failed: set[int] = set()  # steps whose latest save here failed

    def start(self, step: int, state: dict, start: float, slot: Slot | NextSlot | None,
              replacing: bool = False) -> SaveHandle:
        """Start the save of ``state`` (plain: no ``Stateful``) at ``step``; a save that cannot
        start fails its handle (logged) and leaves nothing. ``replacing``: a rank holds the
        step already; the copy here stays until the new save commits, marked
        (:func:`~.steps.mark_replacing`) until every rank did."""
        directory = step_dir(self.memory, step)
        save = None
        try:
            nbytes = state_bytes(state)
            self._admit(step, nbytes, slot)
            make_private(directory)
            if replacing:
                mark_replacing(directory)
            else:  # no rank holds a copy: a mark a killed save left names none to keep
                settle_replacing(directory)
            TierRecord(step, self.ranks.rank, self.ranks.world).write(directory)
            with self._queue:
                save = ExplicitSave(self.engine(), directory, target=slot, overwrite=True)
                staged = save.stage(state)
                committed = self._uploader.submit(self._upload, step, save)
        except Exception as exc:  # noqa: BLE001 - the handle carries it; training goes on
            if save is not None:
                save.abort(exc)  # a snapshot staged for a save that will not run: given back
            if slot is not None:
                assert self.slots is not None  # a slot comes from slots
                # now, not in save order: the next save's admission counts what the pool has
                self.slots.give_back(slot)
            log.error("dcp_datastates: checkpoint of step %d not taken: %s", step, exc)
            refused = failed_handle(step, exc)
            refused.started = False
            return refused
        handle = SaveHandle(step, staged, committed, staging_ordered=save.staging_ordered)
        handle.figures.blocked_s = time.perf_counter() - start
        handle.figures.bytes = nbytes
        stats, figures = save.stats, handle.figures

        def snapshot_done(_f: Future) -> None:
            figures.snapshot_s = time.perf_counter() - start
            figures.copy_s = stats.copy_s
        handle.staged.add_done_callback(snapshot_done)
        return handle

    def _admit(self, step: int, nbytes: int, slot: Slot | NextSlot | None) -> None:
        """Raise TierFullError unless a save of ``nbytes`` fits, some of them in the pages
        that ``slot`` (the one it is snapshotted into) holds on the tier already; where it
        does not, the free slots go first (a spare: none is made from then on), then steps
        the durable tier holds leave the memory tiers, as many as it takes, if that is
        enough. Where the tier is short, the room is counted again once the slots being
        sized are (they move the tier's pages between its free space and themselves)."""
        need, free = self._shortfall(nbytes, slot)
        if need > free and self.slots is not None:
            self.slots.release_free()  # the free slots (a spare) give way
            self.slots.wait_sized()
            need, free = self._shortfall(nbytes, slot)
        if need > free and self.retention.make_room(need - free):
            if self.slots is not None:
                self.slots.wait_sized()
            need, free = self._shortfall(nbytes, slot)
        if need > free:
            raise TierFullError(
                f"memory tier {self.memory} has {format_size(free)} free; the checkpoint "
                f"of step {step} needs {format_size(need)}. Nothing was written; "
                f"{self._advice()}")

    def _shortfall(self, nbytes: int, slot: Slot | NextSlot | None) -> tuple[int, int]:
        """Bytes a save of ``nbytes`` into ``slot`` needs on the tier, and the tier's room:
        the slot's pages are read first (a slot being sized takes them from the free space:
        read the other way round, a page could be counted twice)."""
        reuse = slot.nbytes if slot is not None else 0
        return max(0, nbytes - reuse) + SLACK_BYTES, self.room(reuse)

    def _advice(self) -> str:
        """What gives the tier room, as the options in use allow."""
        ways = [f"a larger memory_limit= (now {format_size(self.limit)})"
                if self.limit is not None else
                "more free space where it lives (a larger /dev/shm: --shm-size= in a "
                "container)",
                "memory_dir= on local NVMe"]
        if self.keep > 1:
            ways.append(f"keep_memory={self.keep - 1} (now {self.keep}) to keep fewer "
                        f"checkpoints")
        advice = "give the tier more room: " + "; ".join(ways)
        durable = self.retention.durable
        unpersisted = sorted({s for root in self.retention.memory_roots() for s in steps(root)
                              if durable is None or not committed(step_dir(durable, s))})
        if unpersisted:
            advice += (f". Step(s) {', '.join(map(str, unpersisted))} in it are not persisted: "
                       f"only persisted steps leave it to make room")
        return advice

    def _upload(self, step: int, save: ExplicitSave) -> None:
        """On the upload thread (it stays, so a save costs the training loop no thread
        start): flush and commit the save of ``step`` once its snapshot is staged. An error
        is logged here (the handle carries it)."""
        try:
            save.flush(self.planner)
            save.commit()
        except Exception as exc:
            log.error("dcp_datastates: checkpoint of step %d not committed to the memory tier "
                      "%s: %s", step, self.memory, exc)
            raise
        finally:
            self.planner.release()

    def room(self, reused: int = 0) -> int:
        """Bytes a new memory-tier checkpoint may take now, besides the ``reused`` bytes of
        the slot it is snapshotted into (on the tier already: they count towards the limit,
        not against the file system's free space)."""
        free = free_bytes(self.memory)
        if self.limit is None:
            return free
        roots = self.retention.memory_roots()
        used = sum(size_of(step_dir(root, s)) for root in roots for s in steps(root))
        used += self.slots.free_bytes() if self.slots is not None else 0
        return max(0, min(free, self.limit - used - reused))

    def slot_room(self) -> int:
        """Bytes the tier has for memory-tier slots made ahead of the saves: its room, less
        the slack a save's admission keeps."""
        return max(0, self.room() - SLACK_BYTES)

    def after_commit(self, handle: SaveHandle, start: float,
                     slot: Slot | NextSlot | None) -> None:
        """In save order: the slot, the figures, the memory tier's retention, the replica's
        exchange (on the replicator's thread)."""
        ok = handle.committed.exception() is None
        if slot is not None and handle.started:  # a save refused at its call gave it back
            assert self.slots is not None  # a slot comes from slots
            self.slots.settle(slot, step_dir(self.memory, handle.step), ok)
        (self._failed.discard if ok else self._failed.add)(handle.step)
        if ok:
            handle.figures.memory_s = time.perf_counter() - start
            self.history.append(handle.figures)
            self.retention.retain(self.memory, self.keep)
        if self.replicator is not None:
            self.replicator.committed(handle)

    def drop_failed(self) -> None:
        """Drop what the saves that failed here left in the tier (their step directories and
        data files), once no save is in flight: at the manager's close."""
        failed, self._failed = sorted(self._failed), set()
        for step in failed:
            if not committed(step_dir(self.memory, step)):
                self.retention.drop(self.memory, step, reuse_slot=False)

    def close(self) -> None:
        """Wait for the saves started, and stop the upload thread."""
        self._uploader.shutdown(wait=True)


def state_bytes(state: dict) -> int:
    """Bytes the tensors of ``state`` take, each rounded up to a page (shared ones once)."""
    total, seen, todo = 0, set(), [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, DTensor):
            total += round_up(nbytes_of(obj._local_tensor))
        elif isinstance(obj, torch.Tensor):
            total += round_up(nbytes_of(obj))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list):
            todo.extend(obj)
    return total
