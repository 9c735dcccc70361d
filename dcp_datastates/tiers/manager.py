"""``CheckpointManager``: frequent checkpoints into node memory, persisted in the background.

Every ``save(step, state)`` is a lazy snapshot (``dcp.async_save`` with a fresh
:class:`~dcp_datastates.DataStatesWriter`) committed into the memory tier: one checkpoint of
this rank's state under ``memory_dir/step_<N>`` (tmpfs by default), which outlives the training
process but not the node. On tmpfs the snapshot is copied straight into a slot file of the tier
(``slots.py``) that becomes the step's data file, so a memory-tier checkpoint costs no more
than its snapshot. Some of them are persisted: copied in the background to
``durable_dir/step_<N>`` and committed there as one checkpoint of the whole job. Restores take
the newest step complete on every rank from the fastest tier that holds it.

Decisions that ranks must share (which step to persist, which to restore) are taken together,
on a gloo group of the manager's, in ``save`` and ``load``; so every rank calls them with the
same steps, as it calls ``dcp.async_save``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ..align import round_up
from ..directory import memory_backed
from ..engine import Engine, default_engine
from ..errors import CheckpointError
from ..reader import DataStatesReader
from ..sizes import format_size, parse_size
from ..snapshot import layout, nbytes_of, walk
from ..writer import DataStatesWriter
from . import replica
from .persist import persist_part
from .slots import Slot, SlotPool
from .steps import (
    TierRecord,
    committed,
    committed_steps,
    complete,
    remove_step,
    size_of,
    step_dir,
    steps,
    uncommit,
)

log = logging.getLogger("dcp_datastates")

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
#: Room a memory-tier save needs besides its tensors: headers and bytes items.
SLACK_BYTES = 1 << 20


class TierFullError(CheckpointError):
    """The memory tier has no room for a checkpoint; nothing was written."""


@dataclass
class SaveFigures:
    """One rank's figures for one managed save (seconds from the ``save`` call)."""

    step: int
    bytes: int = 0
    blocked_s: float | None = None
    snapshot_s: float | None = None
    memory_s: float | None = None
    persist_s: float | None = None
    replicated: bool = False


@dataclass
class SaveHandle:
    """A managed save in flight: its snapshot, its memory commit and, if it is persisted, its
    part of the durable checkpoint."""

    step: int
    staged: Future
    committed: Future
    persisted: Future | None = None
    figures: SaveFigures = field(init=False)

    def __post_init__(self) -> None:
        self.figures = SaveFigures(self.step)

    def result(self, timeout: float | None = None) -> None:
        """Wait for the memory commit (and the persist, if any); raise what failed."""
        self.committed.result(timeout)
        if self.persisted is not None:
            self.persisted.result(timeout)


class CheckpointManager:
    """Checkpoints every few steps into node memory; persists some; restarts from the fastest.

    Args:
        durable_dir: where persisted checkpoints go (shared or local file system); None keeps
            checkpoints in memory only.
        memory_dir: this rank's memory tier; default
            ``/dev/shm/dcp_datastates/<hash of durable_dir>/rank_<rank>``. Give every rank of
            a node its own directory (the default does).
        keep_memory: memory-tier checkpoints kept (each rank keeps this many, plus up to two
            being written and one being persisted: size the tier for ``keep_memory + 3``
            states).
        keep_durable: durable checkpoints kept (None: all).
        memory_limit: bytes the memory tier may hold (an int or ``"48GiB"``); default: as much
            as its file system has free. A save that would not fit fails before writing.
        persist: ``"idle"`` keeps the disk busy: a save is persisted when every rank's
            previous persist is over, and a persist that ends goes straight on with the newest
            step committed meanwhile, if any; an integer N persists every N-th save (one
            due while a persist still runs is deferred to the next save that finds every rank
            idle; logged); None never.
        replicate: also keep each rank's memory checkpoints in the next rank's memory tier
            (another node's, in a real job), so a lost node's memory can be restored from memory.
        engine: the :class:`~dcp_datastates.Engine` (default: the process's engine).

    Under ``torch.distributed`` the manager makes gloo groups of its own (collectively, in the
    constructor): make it on every rank at the same point.
    """

    def __init__(self, durable_dir: str | os.PathLike | None = None, *,
                 memory_dir: str | os.PathLike | None = None, keep_memory: int = 2,
                 keep_durable: int | None = 3, memory_limit: int | str | None = None,
                 persist: int | str | None = "idle",
                 replicate: bool = False, engine: Engine | None = None) -> None:
        if not isinstance(keep_memory, int) or keep_memory < 1:
            raise ValueError(f"keep_memory must be an integer >= 1, got {keep_memory!r}")
        if keep_durable is not None and (not isinstance(keep_durable, int) or keep_durable < 1):
            raise ValueError(f"keep_durable must be None or an integer >= 1, got "
                             f"{keep_durable!r}")
        if not (persist is None or persist == "idle" or (
                isinstance(persist, int) and not isinstance(persist, bool) and persist >= 1)):
            raise ValueError(f"persist must be 'idle', an integer >= 1 or None, got {persist!r}")
        if durable_dir is None and memory_dir is None:
            raise ValueError("give durable_dir, memory_dir or both")
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.durable = Path(os.path.expanduser(durable_dir)).absolute() if durable_dir else None
        self.memory = (Path(os.path.expanduser(memory_dir)).absolute() if memory_dir
                       else _default_memory_dir(self.durable, self.rank))
        self.memory.mkdir(parents=True, exist_ok=True)
        self.keep_memory, self.keep_durable = keep_memory, keep_durable
        self.memory_limit = None if memory_limit is None else parse_size(
            memory_limit, name="memory_limit")
        self.persist_policy = persist if self.durable is not None else None
        self._engine = engine
        self._group = dist.new_group(backend="gloo") if distributed else None
        self.replicate = replicate and self.world > 1
        self._replica_group = dist.new_group(backend="gloo") if self.replicate else None
        self._persist_group = (dist.new_group(backend="gloo")
                               if distributed and self.persist_policy == "idle" else None)
        if replicate and self.world == 1:
            log.info("dcp_datastates: replicate=True with one rank: no peer to replicate to")
        # on tmpfs, snapshots go straight into slot files that become the steps' data files
        self._slots = (SlotPool(self.engine, self.memory, keep_memory + 3)
                       if memory_backed(self.memory) else None)
        self._after = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-tier")
        # runs each save's DCP part, as dcp.async_save's thread would (so not "dcp_datastates-":
        # the writer ties a DCP save to the snapshot its thread took)
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="CheckpointManager-upload")
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-persist")
        self._persisting: Future | None = None
        self._leftover: Future | None = None  # a persist no save's handle carries
        self._owed = False  # a persist was due but deferred
        self._saves = 0
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # memory steps being read (persist, replica send)
        self._handles: list[SaveHandle] = []
        self._unreported: list[BaseException] = []  # errors of saves that wait() has to raise
        self.history: list[SaveFigures] = []
        self._closed = False
        self._rollback: int | None = None  # step a load went back to, newer steps existing
        # DCP warns at every call with no_dist=True, which every memory-tier save and load is
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING, category=UserWarning)
        self._persist_leftover("committed in memory by an earlier process")

    @property
    def engine(self) -> Engine:
        return self._engine if self._engine is not None else default_engine()

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> SaveHandle:
        """Start a checkpoint of ``state`` at ``step`` into the memory tier; return at once.

        The snapshot runs while training goes on (``guard(optimizer, source=manager)`` makes
        the optimizer step wait for it). A tier without room fails this save with
        :class:`TierFullError` in its handle (logged; nothing is written) and training goes on.
        The first save after ``load`` of an older step removes the newer steps from the memory
        tiers and moves the durable ones to ``durable_dir/.abandoned/<time>/`` (logged).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self._closed:
            raise RuntimeError(f"CheckpointManager of {self.memory} is closed: no more saves")
        if self._rollback is not None:
            self._set_aside(self._rollback)
            self._rollback = None
        start = time.perf_counter()
        newer = [s for s in committed_steps(self.memory) if s > step]
        if newer:  # a rollback (load(step=older), then training on): the newer steps stay
            log.warning("dcp_datastates: saving step %d while the memory tier holds newer "
                        "steps %s (a rollback?): they stay, and latest_step() returns the "
                        "newest of them until they are removed", step, newer)
        state = _plain(state)
        slot = self._slots.take() if self._slots is not None else None
        handle = self._start_save(step, state, start, slot)
        self._saves += 1
        self._maybe_persist(handle)
        self._after.submit(self._after_commit, handle, start, slot)
        self._handles.append(handle)
        return handle

    def _start_save(self, step: int, state: dict, start: float,
                    slot: Slot | None) -> SaveHandle:
        directory = step_dir(self.memory, step)
        writer = None
        try:
            nbytes = _state_bytes(state)
            reuse = slot.nbytes if slot is not None else 0  # on the tier already
            need = max(0, nbytes - reuse) + SLACK_BYTES
            free = self._room(reuse)
            if need > free:
                raise TierFullError(
                    f"memory tier {self.memory} has {format_size(free)} free; the checkpoint "
                    f"of step {step} needs {format_size(need)}. Nothing was written; give the "
                    f"tier more room (a larger /dev/shm, memory_limit=, or memory_dir= on local "
                    f"NVMe) or keep fewer checkpoints (keep_memory={self.keep_memory})")
            directory.mkdir(parents=True, exist_ok=True)
            TierRecord(step, self.rank, self.world).write(directory)
            writer = DataStatesWriter(directory, engine=self.engine, overwrite=True,
                                      snapshot_into=slot)
            staged = writer.stage(state)
            committed = self._uploader.submit(self._upload, writer, staged, directory)
        except Exception as exc:  # noqa: BLE001 - the handle carries it; training goes on
            if writer is not None:
                writer.close()  # a snapshot staged for a save that will not run: given back
            log.error("dcp_datastates: checkpoint of step %d not taken: %s", step, exc)
            failed: Future = Future()
            failed.set_exception(exc)
            return SaveHandle(step, failed, failed)
        handle = SaveHandle(step, staged, committed)
        handle.figures.blocked_s = time.perf_counter() - start
        handle.figures.bytes = nbytes
        handle.staged.add_done_callback(
            lambda _f: setattr(handle.figures, "snapshot_s", time.perf_counter() - start))
        return handle

    def _upload(self, writer: DataStatesWriter, staged: Future, directory: Path) -> None:
        """The rest of a save, as ``dcp.async_save`` runs it on a thread of its own (this
        thread stays, so a save costs the training loop no thread start): DCP's save of the
        snapshot, once it is copied."""
        try:
            with _storage_errors():  # a full tier, a failed write
                dcp.save(staged.result(), checkpoint_id=str(directory), storage_writer=writer,
                         no_dist=True, process_group=self._group)
        finally:
            writer.close()  # a snapshot that DCP's save did not take is given back

    def _room(self, reused: int = 0) -> int:
        """Bytes a new memory-tier checkpoint may take now, besides the ``reused`` bytes of
        the slot it is snapshotted into (on the tier already: they count towards
        ``memory_limit``, not against the file system's free space)."""
        st = os.statvfs(self.memory)
        free = st.f_bavail * st.f_frsize
        if self.memory_limit is None:
            return free
        roots = [self.memory, *(replica.replica_root(self.memory, r) for r in range(self.world))]
        used = sum(size_of(step_dir(root, s)) for root in roots for s in steps(root))
        used += self._slots.free_bytes() if self._slots is not None else 0
        return max(0, min(free, self.memory_limit - used - reused))

    def _maybe_persist(self, handle: SaveHandle) -> None:
        policy = self.persist_policy
        if policy is None:
            return
        due = self._owed or policy == "idle" or self._saves % policy == 0
        if not due:
            return
        idle = self._persisting is None or self._persisting.done()
        if self._all(idle and not _failed(handle.committed)):
            if self._owed:
                log.info("dcp_datastates: persisting step %d (a persist was deferred)",
                         handle.step)
            self._owed = False
            self._persisting = handle.persisted = self._persister.submit(
                self._persist, handle.step, handle.committed, handle.figures)
        elif policy != "idle":
            if not self._owed:
                log.info("dcp_datastates: persist of step %d deferred: the previous persist "
                         "is still running", handle.step)
            self._owed = True

    def _persist(self, step: int, memory_commit: Future | None,
                 figures: SaveFigures | None) -> None:
        """Persist ``step``; with ``persist="idle"``, then (the disk being free) the newest step
        every rank has committed in memory since, and so on while there is one. Every rank
        takes each "and so on" decision together, on a group of the persist thread's own."""
        error = self._persist_one(step, memory_commit, figures)
        ok = error is None
        while self.persist_policy == "idle":
            with contextlib.ExitStack() as held:  # the step chosen, kept from retention
                nxt = self._next_to_persist(step, ok, held)
                if nxt is None:
                    break
                chained = self._persist_one(nxt, None, self._figures_of(nxt))
            if chained is not None:
                self._unreported.append(chained)
            ok, step = chained is None, nxt
        if error is not None:
            raise error

    def _next_to_persist(self, after: int, ok: bool,
                         held: contextlib.ExitStack) -> int | None:
        """The newest step committed in memory on every rank and newer than ``after``, if
        every rank's last persist went well (None: stop). Ranks commit at their own pace and
        each drops its old steps, so this rank's newest step may be gone from another's tier:
        the step is one every rank holds, marked as being read (in ``held``) before it is
        offered, so retention leaves it until it is persisted."""
        mine: list[int] = []
        with contextlib.ExitStack() as offered:
            if ok:
                for s in steps(self.memory):
                    if s > after:
                        offered.enter_context(self._reading(s))
                mine = [s for s in committed_steps(self.memory)
                        if s > after and complete(step_dir(self.memory, s))]
            common = set(mine)
            if self._persist_group is not None:
                views: list = [None] * self.world
                dist.all_gather_object(views, mine if ok else None, group=self._persist_group)
                common = (set.intersection(*(set(v) for v in views))
                          if all(v is not None for v in views) else set())
            if not common:
                return None
            chosen = max(common)
            held.enter_context(self._reading(chosen))
        return chosen

    def _figures_of(self, step: int) -> SaveFigures | None:
        return next((f for f in reversed(self.history) if f.step == step), None)

    def _persist_one(self, step: int, memory_commit: Future | None,
                     figures: SaveFigures | None) -> BaseException | None:
        """Persist ``step``; return what failed (logged), or None."""
        start = time.perf_counter()
        target = step_dir(self.durable, step)
        try:
            with self._reading(step):  # from the start: retention must not take it meanwhile
                if memory_commit is not None:
                    memory_commit.result()
                done = persist_part(self.engine, step_dir(self.memory, step), target)
        except BaseException as exc:  # noqa: BLE001 - the caller raises or records it
            log.error("dcp_datastates: persist of step %d to %s failed: %s", step, target, exc)
            return exc
        finally:
            # retention left this step while it was read: drop it now if it is beyond keep_memory
            with contextlib.suppress(RuntimeError):  # the manager is closing
                self._after.submit(self._retain, self.memory, self.keep_memory)
        if figures is not None:
            figures.persist_s = time.perf_counter() - start
        if done:
            log.info("dcp_datastates: step %d persisted to %s", step, target)
            self._retain(self.durable, self.keep_durable)
        return None

    def _after_commit(self, handle: SaveHandle, start: float, slot: Slot | None) -> None:
        """In save order: the slot, the figures, the memory tier's retention, the replica."""
        ok = _ok(handle.committed)
        if slot is not None:
            self._slots.settle(slot, step_dir(self.memory, handle.step), ok)
        if ok:
            handle.figures.memory_s = time.perf_counter() - start
            self.history.append(handle.figures)
            self._retain(self.memory, self.keep_memory)
        if self.replicate:
            mine = step_dir(self.memory, handle.step) if ok else None
            try:
                with self._reading(handle.step):
                    got = replica.replicate_step(self._replica_group, self.rank, self.world,
                                                 self.memory, handle.step, mine)
                handle.figures.replicated = True
                if got is not None:
                    self._retain(got.parent, self.keep_memory)
            except Exception as exc:  # noqa: BLE001 - the copy in memory stands
                log.error("dcp_datastates: replica of step %d failed: %s", handle.step, exc)

    def _retain(self, root: Path, keep: int | None) -> None:
        """Drop committed steps beyond the newest ``keep`` and unfinished ones older than the
        newest committed, except steps being read."""
        done = committed_steps(root)
        if keep is None or not done:
            return
        with self._lock:
            busy = set(self._busy) if root == self.memory else set()
        newest = done[-1]
        drop = [s for s in steps(root) if s not in busy and (
            s in done[:-keep] or (s < newest and s not in done))]
        for s in drop:
            self._drop(root, s)

    def _drop(self, root: Path, step: int) -> None:
        """Remove ``step`` from the tier ``root``; from this rank's memory tier only if it is
        not being read, and its data file goes back to being a free slot."""
        directory = step_dir(root, step)
        if root == self.memory:
            with self._lock:  # a step marked as being read meanwhile stays committed
                if step in self._busy:
                    return
                uncommit(directory)
            if self._slots is not None:  # uncommitted: its data file may be a free slot
                self._slots.reclaim(directory)
        remove_step(directory)

    def _set_aside(self, after: int) -> None:
        """Training went on from ``after`` (``load`` of an older step): the steps newer than it
        belong to the run that was left. They leave the memory tiers, and the durable ones move
        to ``durable_dir/.abandoned/<time>/`` (kept, no longer taken for checkpoints of this
        run), so a later step of the same number is saved and persisted anew. Collective."""
        roots = [self.memory, *(replica.replica_root(self.memory, r) for r in range(self.world))]
        for root in roots:
            for s in steps(root):
                if s > after:
                    self._drop(root, s)
        newer = [s for s in steps(self.durable) if s > after] if self.durable else []
        if newer and self.rank == 0:
            aside = self.durable / ".abandoned" / time.strftime("%Y%m%dT%H%M%S")
            aside.mkdir(parents=True, exist_ok=True)
            for s in newer:
                os.rename(step_dir(self.durable, s), aside / step_dir(self.durable, s).name)
            log.warning("dcp_datastates: training went on from step %d: the newer durable "
                        "steps %s were moved to %s", after, newer, aside)
        if self._group is not None:
            dist.barrier(group=self._group)  # no rank persists into a step being moved

    def prepare(self, state: dict) -> None:
        """Map and pin the memory tier's slots for states like ``state`` now (about 0.5 s per
        GiB each on a GPU host), rather than on the staging thread of the first saves."""
        if self._slots is None:
            return
        sources: list[torch.Tensor] = []
        walk(_plain(state), sources, {}, set())
        _offsets, total = layout(sources)
        self._slots.prepare(total, len(sources))

    # -- waiting --------------------------------------------------------------------------------
    def wait_for_snapshots(self) -> None:
        """Block until every snapshot staged so far is copied (what ``guard`` calls)."""
        self.engine.wait_for_snapshots()

    def wait(self) -> None:
        """Wait for every save so far: memory commits, replicas and persists; raise the first
        error of those saves not reported yet (each is raised once; all are logged), also
        where ``latest_step`` or ``load`` waited for them."""
        self._drain()
        self._raise_unreported()

    def _drain(self) -> None:
        """Wait for every save so far; keep their errors for :meth:`wait` to raise."""
        handles, self._handles = self._handles, []
        for h in handles:
            error = next((e for f in (h.committed, h.persisted) if f is not None
                          for e in [f.exception()] if e is not None), None)
            if error is not None:
                self._unreported.append(error)
        if self._persisting is not None:
            self._persisting.exception()
        leftover, self._leftover = self._leftover, None
        if leftover is not None and leftover.exception() is not None:
            self._unreported.append(leftover.exception())
        self._after.submit(lambda: None).result()

    def _raise_unreported(self) -> None:
        errors, self._unreported = self._unreported, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for every save, persist the newest if the durable tier lacks it, then stop
        the manager's threads (the engine stays). Raises the first error of the saves not yet
        reported (or of that last persist), after all that: a save that failed on some ranks
        only must not keep them out of the collective that the others are in.
        Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
            self._persist_leftover("the newest checkpoint")
            self._drain()
        finally:
            self._uploader.shutdown(wait=True)
            self._after.shutdown(wait=True)
            self._persister.shutdown(wait=True)
            if self._slots is not None:
                self._slots.close()
        self._raise_unreported()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore --------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest step committed and complete on every rank, in any tier (None: none)."""
        self._drain()
        return _pick(self._gather(self._view()), None)

    def load(self, state: dict, step: int | None = None) -> int:
        """Load ``step`` (default: the latest) into ``state`` from the fastest tier holding it:
        this rank's memory tier (after a peer sends back a lost copy, with ``replicate``), else
        the durable tier. Returns the step; logs which tier.

        Loading a step older than the newest means going back: the next ``save`` sets the
        newer steps aside (see :meth:`save`)."""
        self._drain()
        views = self._gather(self._view())
        chosen = _pick(views, step)
        if chosen is None:
            where = f"step {step}" if step is not None else "a checkpoint"
            raise FileNotFoundError(
                f"no tier holds {where} complete on every rank (memory {self.memory}, durable "
                f"{self.durable})")
        newer = sorted({s for v in views for s in (*v["memory"], *v["durable"],
                                                   *(x for r in v["replicas"].values() for x in r))
                        if s > chosen})
        self._rollback = chosen if newer else None
        if newer:
            log.warning("dcp_datastates: loading step %d while steps %s are newer: the next save "
                        "sets them aside (training goes on from step %d)", chosen, newer, chosen)
        moves = [(holder, owner) for owner, v in enumerate(views) if chosen not in v["memory"]
                 for holder in [_holder(views, owner, chosen)] if holder is not None]
        if moves:
            got = replica.restore(self._group, self.rank, moves, self.memory, chosen)
            if got:
                holder = next(h for h, owner in moves if owner == self.rank)
                log.info("dcp_datastates: step %d of rank %d restored into %s from rank %d's "
                         "replica", chosen, self.rank, self.memory, holder)
        return self._load_local(state, chosen)

    def _load_local(self, state: dict, step: int) -> int:
        start = time.perf_counter()
        mine = step_dir(self.memory, step)
        if complete(mine):
            try:
                self._read(state, mine)
                log.info("dcp_datastates: restored step %d from the memory tier (%s) in %.2f s",
                         step, mine, time.perf_counter() - start)
                return step
            except (CheckpointError, OSError) as exc:
                log.warning("dcp_datastates: memory tier copy of step %d unusable (%s); "
                            "loading it from the durable tier", step, exc)
        target = step_dir(self.durable, step) if self.durable is not None else None
        if target is None or not committed(target):
            raise CheckpointError(f"step {step} is in no tier of rank {self.rank}")
        self._read(state, target)
        log.info("dcp_datastates: restored step %d from the durable tier (%s) in %.2f s",
                 step, target, time.perf_counter() - start)
        return step

    def _read(self, state: dict, directory: Path) -> None:
        with _storage_errors():  # a checksum mismatch, a short file
            dcp.load(state, checkpoint_id=str(directory),
                     storage_reader=DataStatesReader(engine=self.engine), no_dist=True)

    # -- what the ranks share -------------------------------------------------------------------
    def _view(self) -> dict:
        mem = [s for s in committed_steps(self.memory) if complete(step_dir(self.memory, s))]
        reps: dict[int, list[int]] = {}
        if self.replicate:
            for owner in range(self.world):
                root = replica.replica_root(self.memory, owner)
                held = [s for s in committed_steps(root) if complete(step_dir(root, s))]
                if held:
                    reps[owner] = held
        durable = committed_steps(self.durable) if self.durable is not None else []
        return {"memory": mem, "replicas": reps, "durable": durable}

    def _gather(self, view: dict) -> list[dict]:
        if self._group is None:
            return [view]
        views: list = [None] * self.world
        dist.all_gather_object(views, view, group=self._group)
        return views

    def _all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        if self._group is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return bool(t.item())

    def _persist_leftover(self, what: str) -> None:
        """Persist the newest step every rank committed in memory, if it is newer than every
        durable checkpoint (one a process that died left, or the last of a run)."""
        if self.persist_policy is None:
            return
        views = self._gather(self._view())
        common = set.intersection(*(set(v["memory"]) for v in views))
        durable = views[0]["durable"]
        if common and (not durable or max(common) > durable[-1]):
            step = max(common)
            log.info("dcp_datastates: persisting step %d (%s)", step, what)
            self._persisting = self._leftover = self._persister.submit(
                self._persist, step, None, None)

    def _reading(self, step: int) -> _Reading:
        return _Reading(self, step)


class _Reading:
    """Marks a memory step as being read, so retention leaves it."""

    def __init__(self, manager: CheckpointManager, step: int) -> None:
        self.manager, self.step = manager, step

    def __enter__(self) -> None:
        with self.manager._lock:
            self.manager._busy[self.step] = self.manager._busy.get(self.step, 0) + 1

    def __exit__(self, *exc: object) -> None:
        with self.manager._lock:
            left = self.manager._busy[self.step] - 1
            if left:
                self.manager._busy[self.step] = left
            else:
                del self.manager._busy[self.step]


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """Raise what a storage step raised (an OSError, a CheckpointError) rather than DCP's
    ``CheckpointException`` that wraps it, which ``except Exception`` does not catch."""
    try:
        yield
    except CheckpointException as exc:
        inner = [e for e, _trace in exc.failures.values() if isinstance(e, Exception)]
        if inner:
            raise inner[0] from exc
        raise


def _default_memory_dir(durable: Path | None, rank: int) -> Path:
    tag = hashlib.sha1(str(durable).encode()).hexdigest()[:12]
    return Path("/dev/shm/dcp_datastates") / tag / f"rank_{rank}"


def _plain(state: dict) -> dict:
    """``state`` with its ``Stateful`` values replaced by their state dicts (as DCP does)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _state_bytes(state: dict) -> int:
    """Bytes the tensors of ``state`` take, each rounded up to a page (shared ones once)."""
    total, seen, todo = 0, set(), [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, DTensor):
            total += round_up(nbytes_of(obj.to_local()))
        elif isinstance(obj, torch.Tensor):
            total += round_up(nbytes_of(obj))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list):
            todo.extend(obj)
    return total


def _ok(future: Future) -> bool:
    """Whether ``future`` finished without error (waits for it)."""
    return future.exception() is None


def _failed(future: Future) -> bool:
    """Whether ``future`` has failed already (does not wait)."""
    return future.done() and future.exception() is not None


def _holder(views: list[dict], owner: int, step: int) -> int | None:
    for rank, v in enumerate(views):
        if step in v["replicas"].get(owner, ()):
            return rank
    return None


def _pick(views: list[dict], step: int | None) -> int | None:
    """The newest step (or ``step``) every rank can restore: from its memory tier, a peer's
    replica of it, or the durable tier."""
    durable = set(views[0]["durable"])
    candidates = durable.union(*(v["memory"] for v in views),
                               *(s for v in views for s in v["replicas"].values()))
    for s in sorted(candidates, reverse=True):
        if step is not None and s != step:
            continue
        if all(s in v["memory"] or s in durable or _holder(views, r, s) is not None
               for r, v in enumerate(views)):
            return s
    return None
