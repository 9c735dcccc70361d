"""Save ordering, and the one place that decides that DCP abandoned a save.

**Tickets and turns.** Every save job of an engine takes the next *ticket* when it is made.
Snapshots stage at once, in parallel; a save's storage steps (from ``reset`` on) wait for its
*turn*: until no save with an earlier ticket *holds the line* (:meth:`Tie.holds_line`).

**"DCP abandoned this save": the contract.** DCP calls a StorageWriter in a fixed order
(:data:`CALLS`) and never tells it that it gave a save up (its planner failed, another rank
failed, the caller's thread died). A save is over when it ends (committed, failed, handed off)
or when it is *abandoned*, which is judged here and nowhere else, by these rules:

1. **Call index** (explicit, from DCP's call order): each save remembers the index of the last
   DCP call it ran. A call whose index is not after that one starts the next save on that
   writer (DCP calls ``reset`` only when given a ``checkpoint_id``), and a thread that starts a
   save has left every earlier save it ran. NVRx's async checkpointing keeps such an index per
   async call; DCP gives no more than its call order, so rules 2 and 3 remain.
2. **Caller** (heuristic, DCP's frames, read by ``_dcp_frames.py``): the DCP call through
   which a save entered the writer has returned, or its thread ended. Needed because a failure
   between two calls tells the writer nothing, and the save would hold its memory, directory
   claim and turn forever.
3. **Taker** (heuristic, thread liveness): the thread that took a snapshot (DCP's upload
   thread asks for the staged state dict before it calls the writer) ended before starting
   the save. Needed because a failing planner kills that thread before any writer call.
4. **Untaken grace**: a snapshot handed out that no thread has taken for
   :data:`UNTAKEN_GRACE_S` stops holding the line (and memory waits give up on it); only the
   writer's ``close()`` or the engine's frees it, since a late DCP save may still come.

A save its owner drives, not DCP (``_jobs/explicit.py``: a manager's memory-tier save), is
never judged: its :class:`OwnedTie` holds the line until its owner ends it.

A save whose process group is gone is not judged here: each DCP call of it refuses it
(``_jobs/groups.py``, from the group it began under).

Abandoned saves are ended by :meth:`SaveOrder.reap`: in the waits of this module, in the
engine's memory waits, and every :data:`WATCH_S` by the order's watcher thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from .._dcp_frames import dcp_entry, on_stack
from ..errors import CheckpointError
from .fence import StagingFence

if TYPE_CHECKING:
    from .._cuda.cuda_copy import CudaCopier
    from .._engine import Engine

log = logging.getLogger("dcp_datastates")

#: DCP's calls to a StorageWriter for one save, in the order it makes them (``reset`` only
#: when given a checkpoint_id; ``prepare_global_plan`` and ``finish`` on the coordinator).
CALLS = ("reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
         "write_data", "finish")
#: A snapshot handed out this long ago that no save has taken no longer holds others up.
UNTAKEN_GRACE_S = 2.0
#: How often waits for a turn or for the saves at close look for abandoned saves.
POLL_S = 0.05
#: How often the watcher looks for abandoned saves, when nothing else does.
WATCH_S = 0.25

#: This package's own threads (the engine's executors) never take a snapshot for a save.
_OWN_THREADS = "dcp_datastates-"

class StagedFuture(Future):
    """The staged state dict; remembers which threads asked for it (DCP's upload thread does,
    before it starts the save), which ties a DCP save to its snapshot (rule 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.takers: list[threading.Thread] = []

    def result(self, timeout: float | None = None) -> object:
        me = threading.current_thread()
        # The engine's own threads (named by its executors) wait here without being a save.
        if me not in self.takers and not me.name.startswith(_OWN_THREADS):
            self.takers.append(me)
        return super().result(timeout)


@dataclass(frozen=True)
class Caller:
    """A thread and the frame (by identity, not kept alive) of the DCP call it is in (rule 2)."""

    thread: threading.Thread
    frame_id: int
    code: CodeType | None

    @classmethod
    def here(cls) -> Caller:
        """The calling thread, and the outermost DCP frame around the writer's method: the
        call through which DCP runs this save."""
        entry = dcp_entry()
        if entry is None:  # called from nowhere we can see: the thread alone decides
            return cls(threading.current_thread(), 0, None)
        return cls(threading.current_thread(), *entry)

    def gone(self) -> bool:
        """Whether the thread ended or has returned from that call."""
        if not self.thread.is_alive():
            return True
        if self.code is None:
            return False
        return not on_stack(self.thread, (self.frame_id, self.code))


class Tie:
    """How DCP holds one save: the future its snapshot is taken from, the DCP call running it
    and the index of the last call it ran. Judged only by :class:`SaveOrder`."""

    def __init__(self) -> None:
        self.staged = StagedFuture()
        self.caller: Caller | None = None
        self.call = -1  # index in CALLS of the last DCP call the save ran
        self.stager: threading.Thread | None = None  # the thread that called stage()
        self._delivered_at: float | None = None  # when the staged dict was handed out

    def deliver(self, state: object) -> None:
        """Hand the staged state dict out (once)."""
        if not self.staged.done():
            self._delivered_at = time.monotonic()
            self.staged.set_result(state)

    def follows(self, call: int) -> bool:
        """Record DCP call ``call``; False if it does not come after the last one (rule 1:
        it starts another save)."""
        if call <= self.call:
            return False
        self.call = call
        return True

    def takers(self) -> list[threading.Thread]:
        return [t for t in self.staged.takers if t is not self.stager]

    def taken(self) -> bool:
        """Whether DCP took this save: a DCP call ran it, or a thread other than the stager
        took its snapshot (not so for a snapshot DCP refused to save once it was staged)."""
        return self.caller is not None or bool(self.takers())

    def taken_by(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` took the staged state dict and no call runs the save yet."""
        return self.caller is None and thread in self.staged.takers

    def untaken_for(self) -> float:
        """Seconds since the snapshot was handed out with no save taking it (0 otherwise)."""
        at = self._delivered_at
        if at is None or self.caller is not None or self.takers():
            return 0.0
        return time.monotonic() - at

    def holds_line(self) -> bool:
        """Whether later saves wait for this (not ended) one: it runs, its snapshot is still
        copying, a DCP thread took the snapshot and is on its way, or it was handed out only
        just now (rule 4)."""
        if self.caller is not None or not self.staged.done():
            return True
        takers = self.takers()
        if any(t.is_alive() for t in takers):
            return True
        return not takers and self.untaken_for() < UNTAKEN_GRACE_S

    def abandoned(self) -> bool:
        """Whether DCP left this (not ended) save: rule 2, or rule 3."""
        if self.caller is not None:
            return self.caller.gone()
        takers = self.takers()
        return bool(takers) and not any(t.is_alive() for t in takers)


class OwnedTie(Tie):
    """How its owner, not DCP, holds a save (``_jobs/explicit.py``): taken from the start, it
    holds the line until it ends and is never abandoned, since its owner ends it."""

    def taken(self) -> bool:
        return True

    def taken_by(self, thread: threading.Thread) -> bool:
        return False

    def untaken_for(self) -> float:
        return 0.0

    def holds_line(self) -> bool:
        return True

    def abandoned(self) -> bool:
        return False


class OrderedSave(Protocol):
    """What the save order asks of a save job (``_jobs/save.py``'s ``SaveJob``)."""

    @property
    def ticket(self) -> int: ...

    @property
    def tie(self) -> Tie: ...

    @property
    def staging(self) -> StagingFence: ...

    @property
    def ended(self) -> bool: ...

    def holds_memory(self) -> bool: ...

    def order_after(self, cuda: CudaCopier | None) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


J = TypeVar("J", bound=OrderedSave)


class SaveOrder(Generic[J]):
    """An engine's saves in ticket order. One per engine (``_jobs.save.save_order``), attached
    to it as work its ``close()`` waits for (:meth:`wait`) and then ends (:meth:`end`).
    ``make(engine, order, ticket, owned)`` makes a job (``owned``: see :class:`OwnedTie`)."""

    def __init__(self, engine: Engine,
                 make: Callable[[Engine, SaveOrder[J], int, bool], J]) -> None:
        self.engine = engine
        self._make = make
        self._lock = threading.Condition()
        self._tickets = itertools.count(1)
        self._jobs: dict[int, J] = {}
        #: the DCP calls running saves, by ticket, until they return (after the job ended)
        self._calls: dict[int, Caller] = {}
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name="dcp_datastates-watch",
                                         daemon=True)
        self._watcher.start()

    def new_job(self, owned: bool = False) -> J:
        """A job holding the next ticket: its storage steps run after every earlier one's."""
        self.reap()
        with self._lock:
            self.engine.check_open()
            job = self._make(self.engine, self, next(self._tickets), owned)
            self._jobs[job.ticket] = job
            return job

    def done(self, job: J) -> None:
        """Called by a job once it holds nothing: later saves may take their turn."""
        with self._lock:
            self._jobs.pop(job.ticket, None)
            self._lock.notify_all()
        self.engine.arenas.free_retired()

    def run(self, job: J, call: int) -> None:
        """The calling thread runs ``job`` from DCP call ``call`` on (rule 1: any other save
        it ran is over)."""
        job.tie.caller = Caller.here()
        job.tie.call = call
        thread = job.tie.caller.thread
        with self._lock:
            left = [j for j in self._jobs.values() if j is not job
                    and j.tie.caller is not None and j.tie.caller.thread is thread]
            self._calls = {t: c for t, c in self._calls.items() if c.thread is not thread}
            if job.tie.caller.code is not None:
                self._calls[job.ticket] = job.tie.caller
        for other in left:
            self._end_abandoned(other)

    def wait_turn(self, job: J) -> None:
        """Block until no save with an earlier ticket holds the line (abandoned ones are
        ended) and the DCP calls of earlier saves have returned: a rank whose part of a save
        ended (its data file written) is still in that save's last collectives, and a later
        save's collectives on the same group would cross them on another rank."""
        while True:
            with self._lock:
                self._calls = {t: c for t, c in self._calls.items() if not c.gone()}
                if not any(t < job.ticket and not j.ended and j.tie.holds_line()
                           for t, j in self._jobs.items()) \
                        and not any(t < job.ticket for t in self._calls):
                    return
                self._lock.wait(POLL_S)
            self.reap()

    def wait_for_staging(self) -> None:
        """Block until every snapshot so far is staged (failed ones included)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.staging.wait()

    def order_after_staging(self) -> None:
        """Hold the work the calling thread queues next until every snapshot staged so far
        is staged: on the GPU where it is ordered (:meth:`StagingFence.order`)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.order_after(self.engine.cuda)

    def reap(self) -> None:
        """End the saves DCP abandoned (rules 2 and 3)."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if not j.ended and j.tie.abandoned()]
        for job in jobs:
            self._end_abandoned(job)

    def memory_given_up(self) -> bool:
        """For a save's wait for cache memory (``Engine.reserve``'s ``give_up``): end abandoned
        saves, then whether the cache is held only by snapshots no save has taken for the grace
        time (rule 4: waiting is futile)."""
        self.reap()
        with self._lock:
            holders = [j for j in self._jobs.values() if j.holds_memory()]
        untaken = [j.ticket for j in holders if j.tie.untaken_for() >= UNTAKEN_GRACE_S]
        if holders and len(untaken) == len(holders):
            log.warning(
                "dcp_datastates: the host cache is held by snapshot(s) %s that no save has "
                "taken; staging in pageable memory instead. Call close() on the writer that "
                "staged them to free the cache", untaken)
            return True
        return False

    # -- the engine's close ---------------------------------------------------------------------
    def wait(self, deadline: float) -> None:
        """Block until every save is over or only untaken snapshots are left (no save will
        come for them), or until ``deadline`` (``time.monotonic``)."""
        while True:
            self.reap()
            with self._lock:
                if not any(not j.ended and j.tie.holds_line() for j in self._jobs.values()):
                    return
                if time.monotonic() >= deadline:
                    return
                self._lock.wait(POLL_S)

    def end(self) -> None:
        """The engine is closing: end every save left, stop the watcher."""
        with self._lock:
            self._closed = True
            jobs, self._jobs = list(self._jobs.values()), {}
            self._lock.notify_all()
        for job in jobs:
            job.end(RuntimeError(f"the engine was closed before save {job.ticket} finished"))
        self._watcher.join()

    def _end_abandoned(self, job: J) -> None:
        job.end(CheckpointError(
            f"save {job.ticket} stopped outside dcp_datastates (another rank, the planner or "
            f"DCP failed); what it held is released"))

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                self._lock.wait(WATCH_S)
                if self._jobs and not self._closed:
                    self._lock.release()
                    try:
                        self.reap()
                    finally:
                        self._lock.acquire()
