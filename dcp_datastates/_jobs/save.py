"""A save job: one rank's part of one save, from snapshot to commit, owning what it holds.

States: planned -> staging -> staged -> flushing -> committed | failed (or handed_off, when
DCP's PROCESS checkpointer takes the snapshot to its own process). The job owns its snapshot
lease, the CUDA events and source tensors of its copies (until they are done), the directory
claim, its data file and its figures; ``end`` releases all of it, on success, failure and
cancellation alike. Saves take their storage steps in ticket order, and whether DCP abandoned
one is judged in one place: ``_jobs/ordering.py``. The flush is ``_jobs/flush.py``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from .._cuda.cuda_copy import CudaCopier, IssuedCopies
from .._engine import POLL_S, Engine
from .._format.data_file import Placement
from .._format.directory import DIR_MODE, DirectoryClaim, new_token
from .._format.metadata_file import METADATA_NAME
from .._memory.arenas import Memory
from .._memory.aside import stash
from .._memory.host_cache import Lease, nbytes_of
from .._sizes import format_size
from .._stats import SaveStats
from ..errors import CheckpointError
from .commit import commit
from .fence import StagingFence
from .flush import write_data_file
from .groups import Began, began_staging
from .ordering import CALLS, Caller, OwnedTie, SaveOrder, StagedFuture, Tie
from .snapshot import (
    Snapshot,
    SnapshotTarget,
    copies_done,
    issue_into,
    keep_still,
    offsets_of,
    place_sources,
    rebuild,
    source_paths,
    walk,
)
from .writes import WriteWatch

#: the version DCP's own writer stamps (older torch, without the constant: "1.0.0")
CURRENT_DCP_VERSION: str = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", "1.0.0")

log = logging.getLogger("dcp_datastates")


def new_save_job(engine: Engine, owned: bool = False) -> SaveJob:
    """A save job of ``engine``'s save order, holding the next ticket (``owned``: driven by
    its owner, not DCP: ``_jobs/explicit.py``)."""
    return save_order(engine).new_job(owned)


def save_order(engine: Engine) -> SaveOrder[SaveJob]:
    """The save order of ``engine`` (attached at the first call)."""
    order = engine.attach_saves(lambda e: SaveOrder(e, SaveJob))
    if not isinstance(order, SaveOrder):  # the only saves attached
        raise TypeError(f"the engine's saves are a {type(order).__name__}, not a SaveOrder")
    return order


@dataclass
class _Plan:
    """A snapshot to stage: the structure, the sources, and where each goes."""

    skeleton: object
    sources: list[torch.Tensor]
    dtensors: set[int]
    ready: dict | None  # CUDA events the copies wait for (destroyed once they are issued)
    placements: list[Placement] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    total: int = 0

    def drop_events(self, cuda: CudaCopier | None) -> None:
        """Destroy the events the copies waited for (once they are issued, or given up)."""
        if self.ready is not None:
            assert cuda is not None  # the events are the copier's
            cuda.destroy_events(self.ready)
            self.ready = None


class SaveState(enum.Enum):
    """Where a :class:`SaveJob` is (its other flags say what it still holds)."""

    PLANNED = "planned"  # made; DCP plans the save
    STAGING = "staging"  # the snapshot's copies are being issued
    STAGED = "staged"  # the snapshot is in host memory, handed out to DCP
    FLUSHING = "flushing"  # this rank's data file is being written
    HANDED_OFF = "handed_off"  # DCP's checkpointer process took the snapshot (a copy)
    COMMITTED = "committed"  # this rank's part is over
    FAILED = "failed"


class SaveJob:
    """One rank's part of one save. Made by :func:`new_save_job`."""

    def __init__(self, engine: Engine, order: SaveOrder[SaveJob], ticket: int,
                 owned: bool = False) -> None:
        self.engine = engine
        self.order = order
        self.ticket = ticket
        self.state = SaveState.PLANNED
        self.stats = SaveStats(backend=engine.io.name)
        # how DCP (or its owner) holds this save, judged by the save order
        self.tie = OwnedTie() if owned else Tie()
        self.staging = StagingFence()  # staged (or ordered): the sources may change
        self.quiet = threading.Event()  # no copy reads the sources or fills the lease
        self.committed: Future = Future()  # this rank's part over (the coordinator: committed)
        self.is_coordinator = True
        self.token = new_token()
        self.directory: Path | None = None
        self.target: SnapshotTarget | None = None  # where to snapshot into (async saves)
        self.snapshot: Snapshot | None = None  # the staged snapshot (async saves)
        self.leases: list[Lease] = []
        self.writes = WriteWatch({})  # writes to the sources before their copies (async saves)
        self.began: Began | None = None  # when, and under which process group (.groups)
        self._claim: DirectoryClaim | None = None
        self._lock = threading.RLock()
        self._ended = self._in_flight = False  # in flight: copies issued, not waited for

    # -- staging (async saves) ------------------------------------------------------------------
    def stage(self, state_dict: dict) -> StagedFuture:
        """Start the snapshot; return a Future of the staged state dict.

        Runs on the caller's thread only to record the structure, copy what a lazy copy cannot
        keep still (:func:`~dcp_datastates._jobs.snapshot.keep_still`: CPU tensors, small GPU
        ones) and record a CUDA event; the other GPU copies run on the engine's staging thread.
        """
        self.tie.stager = threading.current_thread()
        if self.began is None:  # an explicit save's owner said
            self.began = began_staging()
        sources: list[torch.Tensor] = []
        dtensors: dict[int, DTensor] = {}
        try:
            skeleton = walk(state_dict, sources, {}, dtensors)
            copied = keep_still(sources, skeleton)
            # a DTensor itself: an op on it bumps its own counter, not its local's
            self.writes = WriteWatch({i: dtensors.get(i, t) for i, t in enumerate(sources)
                                      if t.is_cuda and i not in copied})
            devices = {t.device.index for t in sources if t.is_cuda}
            if not devices:
                self.staging.release_sources()
            cuda = self.engine.cuda
            ready = cuda.record_current(devices) if devices and cuda is not None else None
            self.engine.order_optimizer_steps()
            self.state = SaveState.STAGING
            self.stats.blocking_s = time.perf_counter() - self.stats.start
            self.engine.threads.stage.submit(self._stage, skeleton, sources, set(dtensors),
                                             ready)
        except BaseException as exc:
            self.end(exc)
            raise
        return self.tie.staged

    def _stage(self, skeleton: object, sources: list[torch.Tensor], dtensors: set[int],
               ready: dict | None) -> None:
        """On the staging thread: copy the snapshot into its target or the host cache. While
        the cache is being made, or the target is not ready (sized and pinned), copy it aside
        and move it in on the arena thread (or wait for the target: :func:`_waited`)."""
        plan = _Plan(skeleton, sources, dtensors, ready)
        try:
            plan.placements = place_sources(sources)
            plan.offsets, plan.total = offsets_of(plan.placements, len(sources))
            if self.target is not None and not self.target.pinned and plan.total > 0 \
                    and not _waited(self, sources):
                self._stage_aside(plan, self._into_target, f"{self.target} is not ready yet")
                return
            lease = self.hold(_target_lease(self.target, plan, self.ticket))
            memory = Memory.ARENA if lease is not None else self.engine.arenas.snapshot_memory(
                plan.total)
            if memory is Memory.ARENA:
                self._copy(plan, lease)
            elif memory is Memory.QUEUE:
                self.engine.arenas.after_arena(self._copy, plan, None)
            else:
                self._stage_aside(plan, self._copy, "the host cache is being made")
        except BaseException as exc:  # noqa: BLE001 - the save's futures carry it
            plan.drop_events(self.engine.cuda)
            self.end(exc)

    def _stage_aside(self, plan: _Plan, move: Callable[[_Plan, None], None], why: str) -> None:
        """Copy the snapshot aside (the sources may change once it returns), then queue
        ``move(plan, None)`` on the arena thread: into the target once it is sized there, or
        into the host cache once it is made there."""
        try:
            aside = stash(plan.sources, self.engine.cuda, plan.ready,
                          issued=self.staging.publish)
        finally:
            plan.drop_events(self.engine.cuda)
        if (error := self._written(plan)) is not None:
            aside.free()
            return self.end(error)
        plan.sources.clear()
        plan.sources = list(aside.views)
        where = f"{format_size(aside.gpu_bytes)} on the GPU, {format_size(aside.host_bytes)} " \
                "in pageable memory"
        self.engine.arenas.move_aside(aside, move, plan, None, failed=self.end,
                               when=self.target.when_ready if self.target is not None else None)
        self.staging.set()
        log.info("dcp_datastates: save %d: %s; the snapshot waits aside meanwhile (%s)",
                 self.ticket, why, where)

    def _into_target(self, plan: _Plan, _: None) -> None:
        """On the arena thread: size the target for a snapshot that waited aside (or, where it
        cannot take it, fall back to the host cache) and copy it in. A save that ended
        meanwhile leases nothing (its slot may be another save's by now)."""
        if self._ended:
            return self._go_quiet(plan)
        try:
            lease = self.hold(_target_lease(self.target, plan, self.ticket))
        except BaseException as exc:  # noqa: BLE001 - the save's futures carry it
            self.end(exc)
            return
        self._copy(plan, lease)

    def _copy(self, plan: _Plan, lease: Lease | None) -> None:
        """Issue the snapshot's copies into ``lease`` (the job's already; None: a lease of the
        cache); the settle thread waits for them, while this one may issue the next snapshot's."""
        with self._lock:  # from here, an end leaves the leases to _go_quiet (after the copies)
            ended, self._in_flight = self._ended, not self._ended
        if ended:
            return self._go_quiet(plan)
        try:
            held = lease if lease is not None else self.hold(
                self.engine.reserve(plan.total, give_up=self.order.memory_given_up))
            snapshot = Snapshot(held, plan.placements, in_target=lease is not None)
            staged, snapshot.overflow, copies = issue_into(
                snapshot.lease, plan.sources, plan.offsets, self.engine.cuda, plan.ready,
                plan.dtensors, self.staging.publish)
        except BaseException as exc:  # noqa: BLE001 - the save's futures carry it
            self._go_quiet(plan)
            return self.end(exc)
        self.engine.after_copies(self._settle, plan, snapshot, staged, copies)

    def _settle(self, plan: _Plan, snapshot: Snapshot, staged: list[torch.Tensor],
                copies: IssuedCopies | None) -> None:
        """On the settle thread: wait for the copies' end, then hand the staged state dict out
        (or, once no copy is left, fail the save)."""
        error: BaseException | None
        try:
            self.stats.copy_s = copies_done(copies)
            error = self._written(plan)
            if error is None:
                snapshot.copies = {t.data_ptr(): k for k, t in enumerate(staged) if t.numel()}
                snapshot.sums = copies.checksums if copies is not None else {}
                state = rebuild(plan.skeleton, staged, {})
        except BaseException as exc:  # noqa: BLE001 - the save's futures carry it
            error = exc
        self._go_quiet(plan)  # before the futures tell of an error: nothing is held then
        if error is not None:
            return self.end(error)
        if self._ended:  # closed or discarded meanwhile: nothing to hand out
            return None
        self.snapshot, self.state = snapshot, SaveState.STAGED
        _note_staged(self.stats, staged, snapshot.overflow, self.ticket)
        self.tie.deliver(state)
        self.staging.set()  # after the staged future: a guard that waited finds it done

    def _written(self, plan: _Plan) -> CheckpointError | None:
        """The error of a save some of whose sources were written in place before their
        copies were ordered ahead of the training's work (:mod:`.writes`): it names them."""
        changed = self.writes.changed()
        if not changed:
            return None
        paths = source_paths(plan.skeleton)
        names = ", ".join(repr(paths.get(i, f"#{i}")) for i in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        return CheckpointError(
            f"save {self.ticket}: {names}{more} changed in place after the save was called "
            f"and before the snapshot's copies were ordered ahead of the change, so the "
            f"snapshot may mix old and new values; it is not committed (a checkpoint there "
            f"before is intact). optimizer.step() waits for the copies by itself; before "
            f"changing the state otherwise, wait for the save's staging_completion")

    def order_after(self, cuda: CudaCopier | None) -> None:
        """Hold the work the calling thread queues next until the snapshot's copies are over
        (on the GPU where they were issued there): the sources may change from then on."""
        self.staging.order(cuda)
        self.writes.fence()

    def _go_quiet(self, plan: _Plan) -> None:  # no copy reads the sources or fills the lease
        plan.sources.clear()
        plan.drop_events(self.engine.cuda)
        with self._lock:
            self._in_flight, ended = False, self._ended
        if ended:  # the leases that end() left for after the copies
            self._release(claim=False)
        self.quiet.set()

    def hold(self, lease: Lease | None) -> Lease | None:
        """Keep ``lease`` until the job ends (or its bytes are in the file)."""
        if lease is not None:
            with self._lock:
                self.leases.append(lease)
                if self._ended:  # ended meanwhile (engine closing): give it straight back
                    self._release()
                    raise CheckpointError(f"save {self.ticket} ended while it was staging")
        return lease

    # -- the DCP save ---------------------------------------------------------------------------
    def run_here(self) -> None:
        """The calling thread runs this save now (DCP's ``reset``); any save it left
        unfinished is over."""
        self.order.run(self, CALLS.index("reset"))

    def check_group(self) -> None:
        """Raise if the process group the save began under is gone (:mod:`.groups`): DCP
        would run it as each rank's own save, or on a group made since."""
        if self.began is not None:
            self.began.check(self.ticket)

    def checkpoint_directory(self) -> Path:
        """:attr:`directory`, which the storage writer sets before the save's steps use it."""
        if self.directory is None:
            raise RuntimeError(f"save {self.ticket} has no checkpoint directory")
        return self.directory

    def prepare(self, overwrite: bool) -> None:
        """Create the directory; the coordinator claims it and checks for a checkpoint."""
        directory = self.checkpoint_directory()
        directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        if not self.is_coordinator:
            return
        self._claim = DirectoryClaim(directory)
        if (directory / METADATA_NAME).exists() and not overwrite:
            raise RuntimeError(f"Checkpoint already exists and overwrite=False: {directory} holds "
                               f"{METADATA_NAME}; pass overwrite=True to DataStatesWriter to "
                               "replace it (the old checkpoint stays intact until the new one "
                               "is committed)")

    def flush(self, plan: SavePlan, planner: SavePlanner,
              direct_io: bool | None) -> list[WriteResult]:
        """Write this rank's data file; return DCP's write results."""
        self.state = SaveState.FLUSHING
        try:
            results = write_data_file(self, plan, planner, direct_io)
        finally:
            self._release(claim=False)  # the bytes are in the file (or the save failed)
        if not self.is_coordinator:
            self.end(None)  # this rank's part is durable
        return results

    def commit(self, metadata: Metadata, results: list[list[WriteResult]],
               storage_meta: StorageMeta) -> None:
        """Commit ``.metadata`` (after every rank's file is durable) and end the save."""
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = storage_meta
        metadata.version = CURRENT_DCP_VERSION
        commit(self.checkpoint_directory(), metadata, self.token)
        self.end(None)

    def hand_off(self) -> None:
        """DCP's PROCESS checkpointer pickled (copied) the snapshot: the rest is its process's."""
        self.tie.caller = Caller.here()
        self.state = SaveState.HANDED_OFF
        self.end(None)

    # -- the end --------------------------------------------------------------------------------
    def end(self, error: BaseException | None) -> None:
        """Release everything the job holds and settle its futures (idempotent)."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._release()
        if self.state is not SaveState.HANDED_OFF:
            self.state = SaveState.FAILED if error is not None else SaveState.COMMITTED
        if error is None:
            self.stats.durable_s = time.perf_counter() - self.stats.start
            if self.stats.bytes_written:
                self.stats.log()
        elif self.engine.exiting and self.tie.taken():  # no one is left to read its future
            log.warning("dcp_datastates: save %d into %s lost at exit: %s (a checkpoint "
                        "committed there before is intact)", self.ticket, self.directory,
                        error)
        for future in (self.tie.staged, self.committed):
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        self.staging.set()
        self.quiet.set()
        self.order.done(self)

    @property
    def ended(self) -> bool:
        return self._ended

    def holds_memory(self) -> bool:
        return bool(self.leases)

    def _release(self, claim: bool = True) -> None:
        """Return the leases (copies in flight: :meth:`_go_quiet`, after them) and the claim."""
        with self._lock:
            leases, self.leases = ([], self.leases) if self._in_flight else (self.leases, [])
            held, self._claim = (self._claim, None) if claim else (None, self._claim)
        for lease in leases:
            lease.release()
        if held is not None:
            held.release()


def _waited(job: SaveJob, sources: list[torch.Tensor]) -> bool:
    """On the staging thread, for ``job``'s target not ready: False where a copy aside keeps
    the snapshot's GPU sources on the GPU (the job copies it aside). Else (one would go to
    pageable memory, slow) wait for the target, and True once it can be leased (or its pool
    closed: the lease then falls back to the host cache): the training's guard waits about
    one commit with it rather than for that copy. The wait ends early, with False, once the
    GPU has room again (an earlier snapshot aside has moved into its slot). Raises once the job
    has ended meanwhile."""
    if job.engine.aside_fits_on_gpu(sources):
        return False
    ready, start = threading.Event(), time.perf_counter()
    assert job.target is not None  # asked only for a target that is not ready
    job.target.when_ready(ready.set)
    if not ready.is_set():
        log.info("dcp_datastates: save %d: %s is not ready yet and the GPU has no room to keep "
                 "the snapshot aside; the snapshot waits for it or for room (the engine's saves "
                 "staged after it wait too)", job.ticket, job.target)
        while not ready.wait(POLL_S) and not job.ended:
            if job.engine.aside_fits_on_gpu(sources) and not ready.is_set():
                log.info("dcp_datastates: save %d: the GPU has room again after %.3f s",
                         job.ticket, time.perf_counter() - start)
                return False
        log.info("dcp_datastates: save %d waited %.3f s for %s", job.ticket,
                 time.perf_counter() - start, job.target)
    if job.ended:  # its target then has no slot for it (a settled NextSlot calls back)
        raise CheckpointError(f"save {job.ticket} ended while it waited for {job.target}")
    return True


def _target_lease(target: SnapshotTarget | None, plan: _Plan, ticket: int) -> Lease | None:
    """The snapshot's lease in save ``ticket``'s snapshot target, if it has one that can take
    it (else the snapshot goes to the host cache: logged)."""
    if target is None or plan.total <= 0:
        return None
    try:
        return target.lease(plan.total, len(plan.sources))
    except (OSError, RuntimeError) as exc:  # no space on the tier, pinning refused
        log.warning("dcp_datastates: save %d: %s unusable (%s); the snapshot goes to the host "
                    "cache and is copied", ticket, target, exc)
        return None


def _note_staged(stats: SaveStats, staged: list[torch.Tensor], overflow: int,
                 ticket: int) -> None:
    """Record a staged snapshot's figures in ``stats``; warn of bytes in pageable memory."""
    stats.overflow_bytes = overflow
    stats.staged_bytes = sum(nbytes_of(t) for t in staged) - overflow
    stats.snapshot_s = time.perf_counter() - stats.start
    if overflow:
        log.warning(
            "dcp_datastates: save %d: %s of the state did not fit in the host cache and was "
            "staged in pageable memory (slower); give the engine a larger host_cache_size",
            ticket, format_size(overflow))
