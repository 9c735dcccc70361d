"""``CheckpointManager``: frequent checkpoints into node memory, persisted in the background.

Every ``save(step, state)`` is a lazy snapshot committed into the memory tier
(:mod:`.memory_save`): one checkpoint of this rank's state under ``memory_dir/step_<N>`` (tmpfs
by default), which outlives the training process but not the node. On tmpfs the snapshot is
copied straight into a slot file of the tier (:mod:`.slots`) that becomes the step's data file,
so a memory-tier checkpoint costs no more than its snapshot. Some of them are persisted
(:mod:`.persister`, :mod:`.persist`): copied in the background to ``durable_dir/step_<N>`` and
committed there as one checkpoint of the whole job. Each tier keeps its newest steps
(:mod:`.retention`). Restores take the newest step complete on every rank from the fastest tier
that holds it (:mod:`.restore`).

Decisions that ranks must share (which step to persist, which to restore) are taken together,
on a gloo group of the manager's, in ``save`` and ``load``; so every rank calls them with the
same steps, as it calls ``dcp.async_save``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .._arguments import checked_keywords
from .._engine import Engine, default_engine
from .._format.directory import memory_backed
from .._jobs.snapshot import layout, walk
from .._renamed import Renamed
from .._sizes import parse_size
from ..errors import CheckpointError
from ._budget import Budget, check_max_overhead
from ._claims import TierClaims
from ._handles import SaveFigures, SaveHandle, failed_handle
from ._local_dcp import plain
from ._memory_save import MemorySaver, state_bytes
from ._persister import Persister
from ._private import check_private, user_root
from ._ranks import Ranks
from ._replicator import Replicator
from ._reports import Reports
from ._restore import Restorer, held, pick
from ._retention import ABANDONED, Retention
from ._slots import NextSlot, Slot, SlotPool
from ._steps import (
    keep_replaced,
    make_private,
    remove_dead_unfinished,
    settle_killed_replacing,
    settle_replacing,
    step_dir,
)
from ._unclosed import Unclosed, warn_unpersisted

log = logging.getLogger("dcp_datastates")

#: Saves whose figures ``CheckpointManager.history`` keeps (the latest ones).
HISTORY_KEPT = 1000


class CheckpointManager:
    """Checkpoints every few steps into node memory; persists some; restarts from the fastest.

    Args:
        durable_dir: where persisted checkpoints go (shared or local file system); None keeps
            checkpoints in memory only.
        memory_dir: this rank's memory tier; default
            ``/dev/shm/dcp_datastates-<uid>/<durable_dir's last names>-<hash>/rank_<rank>``
            (made 0700). Give every rank of a node its own directory (the default does). A run
            resuming from memory steps beside a new, empty ``durable_dir`` (removed to start
            over?) warns, saying how to start over; one on another number of ranks loads the
            durable tier instead (:mod:`.restore`).
        keep_memory: memory-tier checkpoints kept (plus the one being written and one ready
            for the next save: size the tier for ``keep_memory + 2`` states, ``+ 3`` where
            saves pile up or a persist lags behind them; ``keep_memory + 2`` slots, as many
            as the tier has room for then, are made in the background from ``prepare()`` on,
            or on a GPU from the first save on).
        keep_durable: durable checkpoints kept (None: all); also the sets of steps set
            aside in ``durable_dir/.abandoned`` that are kept.
        memory_limit: bytes the memory tier may hold (an int or ``"48GiB"``); default: as much
            as its file system has free. A save that would not fit drops persisted steps from
            the tier first (oldest first), then fails before writing.
        persist: ``"idle"`` keeps the disk busy: a save is persisted when every rank's
            previous persist is over, and a persist that ends goes on with the newest step
            committed meanwhile; N persists every N-th save (one due during a persist is
            deferred to the next save that finds every rank idle; logged); None never.
        replicate: also keep each rank's memory checkpoints in the next rank's memory tier
            (another node's, in a real job), so a lost node's memory can be restored from memory.
        engine: the :class:`~dcp_datastates.Engine` (default: the process's engine).
        max_overhead: the fraction of training time checkpointing may cost the training
            thread (``save()`` calls, the guard's waits, the loop's slowdown while a save is in
            flight); a save that does not fit is skipped at once (:mod:`.budget`). 0.05 lets a
            loop call ``save`` every step and get as many checkpoints as the hardware allows
            within 5%. None (default) takes every save, as a loop saving every N steps expects.
        clock: what the budget measures time with (tests pass a fake).

    Under ``torch.distributed`` the manager makes gloo groups of its own (collectively, in the
    constructor): make it on every rank at the same point. It claims its memory tier, and the
    job (through rank 0) its durable tier (:mod:`.claims`): a second manager on either fails
    here, naming the directory and the holder's pid. A tier directory another user owns or
    may write (or a directory above it), or one it cannot write (the durable tier: unless
    ``persist=None``), fails here too, saying why (:mod:`.private`). The tiers are held open
    until ``close()``; a tier renamed away and replaced meanwhile fails the next ``save``,
    ``load``, ``latest_step`` or ``close`` on every rank, nothing read from or written to it.
    """

    @checked_keywords
    def __init__(self, durable_dir: str | os.PathLike | None = None, *,
                 memory_dir: str | os.PathLike | None = None, keep_memory: int = 2,
                 keep_durable: int | None = 3, memory_limit: int | str | None = None,
                 persist: int | str | None = "idle",
                 replicate: bool = False, engine: Engine | None = None,
                 max_overhead: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _check_options(durable_dir, memory_dir, keep_memory, keep_durable, persist)
        check_max_overhead(max_overhead)
        ranks = self._ranks = Ranks.here()
        self.rank, self.world = ranks.rank, ranks.world
        self.durable = Path(os.path.expanduser(durable_dir)).absolute() if durable_dir else None
        self.memory = _memory_tier(memory_dir, self.durable, self.rank)
        self._default_memory = not memory_dir
        self.keep_memory, self.keep_durable = keep_memory, keep_durable
        self.memory_limit = None if memory_limit is None else parse_size(
            memory_limit, name="memory_limit")
        self.persist_policy = persist if self.durable is not None else None
        self._engine = engine
        if replicate and self.world == 1:
            log.info("dcp_datastates: replicate=True with one rank: no peer to replicate to")
        self.replicate = replicate and self.world > 1
        #: the figures of the latest HISTORY_KEPT saves: committed, and skipped ones at once
        self.history: deque[SaveFigures] = deque(maxlen=HISTORY_KEPT)
        self._budget = None if max_overhead is None else Budget(max_overhead, clock, ranks,
                                                                self.history)
        self._reports = Reports()  # errors of saves that wait() or close() has to raise
        self._handles: list[SaveHandle] = []
        self._closed = False
        self._rollback: int | None = None  # step a load went back to, newer steps existing
        self._claims = TierClaims(self.memory, self.durable, ranks,
                                  persists=self.persist_policy is not None)
        try:
            remove_dead_unfinished(self.memory)  # only its holder cleans a tier
            settle_killed_replacing(self.memory)
            self._wire()
            # the engine's close finishes it: exit too
            self._unclosed = Unclosed.track(self.engine, self._finish_unclosed)
            self._timing = None if self._budget is None else self.engine.time_step_waits(
                self._budget.wait)  # every optimizer step waits for the engine's snapshots
            views = self._restorer.views()
            self._restorer.warn_new_durable(views)
            self._taken = held(views)  # steps some tier holds: a save of one replaces it
            if self._persister is not None:
                self._persister.leftover(views, "committed in memory by an earlier process")
        except BaseException:
            self._claims.release()
            raise

    def _wire(self) -> None:
        """Make the parts (and the groups, collectively, in the same order on every rank)."""
        # on tmpfs, snapshots go straight into slot files that become the steps' data files
        self._slots = (SlotPool(self.engine, self.memory, self.keep_memory + 3,
                                rotation=self.keep_memory + 2,
                                room=lambda: self._saver.slot_room())
                       if memory_backed(self.memory) else None)
        self._retention = Retention(self.memory, self.durable, self._slots, self._ranks,
                                    keep_aside=self.keep_durable)
        self._after = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-tier")
        self._replicator = Replicator(self._ranks, self._ranks.another_group(),
                                      self._retention, self.keep_memory) \
            if self.replicate else None
        self._saver = MemorySaver(
            self._retention, self.memory_limit, self.keep_memory, self._slots, self._ranks,
            self._replicator, self._engine_now, self.history)
        self._restorer = Restorer(self.memory, self.durable, self.replicate, self._ranks,
                                  self._engine_now, self._start_over())
        self._persister: Persister | None = None
        if self.persist_policy is not None and self.durable is not None:  # set together
            self._persister = Persister(
                self.persist_policy, self.durable, self._retention,
                keep=(self.keep_memory, self.keep_durable), ranks=self._ranks,
                engine=self._engine_now, after=self._after.submit, history=self.history,
                errors=self._reports, check=self._claims.verify)

    def _start_over(self) -> str | None:
        """Where the durable tier is new (no manager used it before), how to start over
        instead of resuming from the memory tiers (None: it is not new)."""
        if not self._claims.durable_new:
            return None
        if self._default_memory:
            return (f"remove the memory tiers too (rm -rf {self.memory.parent} on every node: "
                    f"the default ones, named after durable_dir)")
        return f"empty every rank's memory_dir too ({self.memory} here)"

    @property
    def engine(self) -> Engine:
        return self._engine_now()

    def _engine_now(self) -> Engine:
        return self._engine if self._engine is not None else default_engine()

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> SaveHandle:
        """Start a checkpoint of ``state`` at ``step`` into the memory tier; return at once.

        The snapshot runs while training goes on (``guard(optimizer, source=manager)`` makes
        the optimizer step wait for it). A tier without room fails this save with
        :class:`TierFullError` in its handle (logged; nothing is written) and training goes on.
        The first save after ``load`` of an older step removes the newer steps from the memory
        tiers and moves the durable ones to ``durable_dir/.abandoned/<time>/`` (logged). A step
        saved again (a tier holds it already) replaces it in every tier once the new save has
        committed on every rank (this save waits for the saves and persists before it, then
        for its own commit; collective): its ``.metadata`` replaces the old memory copy, then
        the replicas leave the memory tiers and the durable copy moves aside the same way
        (logged); a save that fails on some rank leaves the old copies. A step older than the
        newest one saved or held (a counter that restarted) raises ValueError here, nothing
        written: retention would delete it at once. Under ``max_overhead``, a save that does
        not fit is skipped: its handle says why. An error a ``Stateful``'s ``state_dict()``
        raises is raised here, nothing written.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._check_open("no more saves")
        self._check_not_older(step)
        self._claims.verify_together()
        if self._rollback is not None:
            self._retention.set_aside(self._rollback)
            self._taken = {s for s in self._taken if s <= self._rollback}
            self._rollback = None
        budget, slots = self._budget, self._slots
        if slots is not None and self.engine.cuda is not None and not slots.prepared():
            self._prepare_slots(state)  # no copy into a slot not pinned yet
        slot = (slots.take(later=budget is None, spare=budget is None) if slots is not None
                else None)
        if budget is not None:
            if (slot is None and slots is not None and slots.readying() and not slots.waiting()
                    and self.engine.aside_room_for(slots.snapshot_bytes())):
                # the tier is being set up: one save at a time waits aside on the GPU for the
                # slot on its way (:mod:`.budget`); no state dict is taken before the ranks
                # decide (a collective one would hang them, and its time is the save's cost)
                slot = slots.take(later=True, spare=False)
            skipped = budget.decide(step, slots, slot)
            if skipped is not None:
                return skipped
            if slots is not None:
                slots.make_spares()
        replacing = step in self._taken
        if replacing:
            self._drain()  # nothing reads the old copies while the new save replaces them
        start = time.perf_counter()
        flat = self._state_dicts(state, slot)
        self._taken.add(step)
        handle = self._saver.start(step, flat, start, slot, replacing)
        if replacing:
            handle = self._replaced(handle)
        if self._persister is not None:
            self._persister.after_save(handle)
        if self._replicator is not None:
            self._replicator.decide(handle)
        self._after.submit(self._saver.after_commit, handle, start, slot)
        self._handles.append(handle)
        if self._budget is not None:
            handle.waits = self._budget.wait
            self._budget.taken(handle)
        return handle

    def _state_dicts(self, state: dict, slot: Slot | NextSlot | None) -> dict:
        """``state`` with its ``Stateful`` values' state dicts; where one raises, the slot
        taken for the save is given back (else no later save gets it) and the error raised."""
        try:
            return plain(state)
        except BaseException:
            if slot is not None:
                assert self._slots is not None  # a slot comes from slots
                self._slots.give_back(slot)
            raise

    def _replaced(self, handle: SaveHandle) -> SaveHandle:
        """Wait for the save of a step again to end here, then on every rank (collective).
        Where every rank committed it, the old copies leave the other tiers (the memory tier's
        went as the new one committed); else every rank keeps the copy it replaced, a rank
        whose copy is not that one (it committed the new save) drops the step, and its handle
        fails saying so."""
        step, ok = handle.step, handle.committed.exception() is None
        directory = step_dir(self.memory, step)
        if self._ranks.all(ok):
            settle_replacing(directory)
            self._retention.replace(step)
            return handle
        if not keep_replaced(directory):
            self._retention.drop(self.memory, step, reuse_slot=False)
        if not ok:
            return handle
        error = CheckpointError(
            f"the save of step {step} again into {directory} committed on this rank but not "
            f"on every rank, so no rank takes it: the step keeps its earlier copies where a "
            f"rank or the durable tier holds them, this rank's memory tier has none")
        log.error("dcp_datastates: %s", error)
        return failed_handle(step, error)

    def _check_not_older(self, step: int) -> None:
        """Raise ValueError where ``step`` is older than the newest step saved or held (after
        the going back that a ``load`` asked for)."""
        taken = self._taken if self._rollback is None else {
            s for s in self._taken if s <= self._rollback}
        newest = max(taken, default=None)
        if newest is None or step >= newest:
            return
        aside = f" (to {self.durable / ABANDONED})" if self.durable is not None else ""
        raise ValueError(
            f"save of step {step} refused: step {newest} is the newest in the tiers (memory "
            f"{self.memory}, durable {self.durable}), and retention keeps the newest steps, so "
            f"step {step} would be deleted at once. A new run (a step counter that starts "
            f"again) goes into new directories (another durable_dir, memory_dir); to go back "
            f"and train on from an older step, load(state, step=N) it first (N <= {step}): "
            f"the next save then sets the newer steps aside{aside}")

    def prepare(self, state: dict, wait: bool = False) -> None:
        """Have the memory tier's slots (``keep_memory + 2``) sized for states like ``state``
        and pinned (seconds each for a few GiB), one after the other in the background, then
        one more ahead of a save that finds no other free; a save meanwhile waits aside for
        its slot (the training does not wait). ``wait``: return once they are pinned (or
        pinning failed). Without it, on a GPU, the first save does the same with its own
        state (it then waits aside for its slot); without a GPU, where nothing is pinned, it
        sizes its slot itself."""
        self._check_open("nothing to prepare")
        if self._slots is not None:
            self._prepare_slots(state, wait)

    def _prepare_slots(self, state: dict, wait: bool = False) -> None:
        """Size the slots for ``state`` (its state dicts taken once)."""
        assert self._slots is not None  # a memory tier on tmpfs
        flat = plain(state)
        self._slots.prepare(*_snapshot_size(flat), wait=wait, nbytes=state_bytes(flat))

    # -- waiting --------------------------------------------------------------------------------
    def wait_for_staging(self) -> None:
        """Block until every snapshot so far is staged (a cost under ``max_overhead``)."""
        saves = self.engine.saves
        self._wait(saves.wait_for_staging if saves is not None else lambda: None)

    def order_after_staging(self) -> None:
        """What ``guard`` calls (:meth:`Engine.order_after_staging`), counted as above."""
        self._wait(self.engine.order_after_staging)

    wait_for_snapshots = Renamed("wait_for_staging", removed_in="0.2.0")
    order_after_snapshots = Renamed("order_after_staging", removed_in="0.2.0")

    def _wait(self, wait: Callable[[], None]) -> None:
        wait() if self._budget is None else self._budget.wait(wait)

    def wait(self) -> None:
        """Wait for every save so far: memory commits, replicas and persists; raise the first
        error of those saves that no ``wait()`` raised yet (all are logged), also where
        ``latest_step`` or ``load`` waited for them, and also where ``handle.result()`` raised
        it (``close()`` then does not)."""
        self._check_open("nothing to wait for")
        self._wait(self._drain)  # a cost of the saves under max_overhead
        self._reports.raise_first()

    def _drain(self) -> None:
        """Wait for every save so far; keep their errors for :meth:`wait` to raise."""
        handles, self._handles = self._handles, []
        for h in handles:
            error = next((e for f in (h.committed, h.persisted) if f is not None
                          for e in [f.exception()] if e is not None), None)
            if error is not None:
                self._reports.append(error, h)
        if self._persister is not None:
            self._persister.drain()
        self._after.submit(lambda: None).result()
        if self._replicator is not None:
            self._replicator.drain()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager of {self.memory} is closed: {what}")

    def close(self) -> None:
        """Wait for every save, persist the newest if the durable tier lacks it, drop what
        failed saves left in the memory tier, then stop the manager's threads (the engine
        stays) and give up the claims of the tier directories. Raises the first error of the
        saves that nothing raised yet (neither ``wait()`` nor ``handle.result()``), or of that
        last persist, after all that: a save that failed on some ranks only must not keep them
        out of the collective that the others are in. Closing again does nothing; every other
        method raises RuntimeError."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
            self._claims.verify_together()
            if self._persister is not None:
                self._persister.leftover(self._restorer.views(), "the newest checkpoint")
            self._drain()
            self._saver.drop_failed()
        finally:
            self._stop()
        self._reports.raise_first(unraised_only=True)

    def _finish_unclosed(self) -> None:
        """At the engine's close, the manager not closed (:mod:`.unclosed`): with one rank,
        close it; with several, finish its saves on this rank alone, log their errors and
        warn of a step in the memory tier only."""
        if self._closed:
            return
        if self.world == 1:
            try:
                self.close()
            except Exception as exc:  # noqa: BLE001 - no caller to raise it to
                log.warning("dcp_datastates: CheckpointManager of %s was not closed; closing "
                            "it at exit failed: %s", self.memory, exc)
            return
        self._closed = True
        try:
            self._drain()
        finally:
            self._stop()
        for error in self._reports.take():
            log.warning("dcp_datastates: a save of the unclosed CheckpointManager of %s "
                        "failed: %s", self.memory, error)
        # (persist_policy is None where durable is)
        warn_unpersisted(self.memory, self.durable if self.persist_policy is not None else None)

    def _stop(self) -> None:
        """Stop the manager's threads (once its saves are over) and unmap its slots; the
        claims are given up whatever fails."""
        try:
            self._unclosed.untrack()
            if self._timing is not None:
                self._timing.remove()
            self._saver.close()
            self._after.shutdown(wait=True)
            if self._replicator is not None:
                self._replicator.close()
            if self._persister is not None:
                self._persister.close()
            if self._slots is not None:
                self._slots.close()
        finally:
            self._claims.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore --------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest step committed and complete on every rank, in any tier (None: none).
        A step whose persist found it damaged is dropped from the memory tier: never this.
        Where none is but memory tiers hold steps another number of ranks saved, raises
        :class:`WorldSizeChangedError` as :meth:`load` does (None would start the run over,
        and retention delete those steps)."""
        self._check_open("no steps to tell")
        self._drain()
        self._claims.verify_together()
        views = self._restorer.views()
        step = pick(views, None)
        if step is None:
            self._restorer.check_world(views, "a checkpoint")
        return step

    def load(self, state: dict, step: int | None = None) -> int:
        """Load ``step`` (default: the latest) into ``state`` from the fastest tier holding it:
        this rank's memory tier (after a peer sends back a lost copy, with ``replicate``), else
        the durable tier. Returns the step; logs which tier.

        Loading a step older than the newest means going back: the next ``save`` sets the
        newer steps aside (see :meth:`save`). Without ``step``, a step that does not load on
        some rank (damaged in every tier holding it: a checksum fails) gives way to the next
        older one (logged as an error), so a run restarts from the newest step that verifies.
        """
        self._check_open("nothing to load")
        self._drain()
        self._claims.verify_together()
        chosen, newer = self._restorer.restore(state, step)
        self._rollback = chosen if newer else None
        if newer:
            log.warning("dcp_datastates: loading step %d while steps %s are newer: the next save "
                        "sets them aside (training goes on from step %d)", chosen, newer, chosen)
        return chosen



def _memory_tier(memory_dir: str | os.PathLike | None, durable: Path | None,
                 rank: int) -> Path:
    """This rank's memory tier; the default's per-user root and run directory are made (0700)
    and checked (:mod:`.private`), the tier itself is when it is claimed."""
    if memory_dir:
        memory = Path(os.path.expanduser(memory_dir)).absolute()
    else:
        memory = _default_memory_dir(durable, rank)
        root = user_root()
        for directory in (root, memory.parent):
            make_private(directory)
            check_private(directory, "memory tiers' directory", follow=directory != root)
    if durable is not None and os.path.realpath(memory) == os.path.realpath(durable):
        raise ValueError(f"memory_dir {memory} is durable_dir: give each tier its own directory")
    return memory


def _snapshot_size(flat: dict) -> tuple[int, int]:
    """The bytes a snapshot of ``flat`` (a state with no ``Stateful`` values: ``plain``)
    takes, and its tensor count."""
    sources: list[torch.Tensor] = []
    walk(flat, sources, {}, {})
    _offsets, total = layout(sources)
    return total, len(sources)


def _check_options(durable_dir: object, memory_dir: object, keep_memory: object,
                   keep_durable: object, persist: object) -> None:
    """Raise ValueError for options the manager cannot take."""
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


def _default_memory_dir(durable: Path | None, rank: int) -> Path:
    """``/dev/shm/dcp_datastates-<uid>/<durable_dir's last two names>-<hash of durable_dir>/
    rank_<r>``: the root is this user's (:func:`~.private.user_root`), the name says whose
    tier it is, the hash keeps tiers of equally named runs apart."""
    tag = hashlib.sha1(str(durable).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(durable.parts[-2:]) if durable else "")
    name = name[-48:].strip("_")
    return user_root() / (f"{name}-{tag}" if name else tag) / f"rank_{rank}"
