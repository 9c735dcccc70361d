"""When to persist, and the thread that does it: the persist policy and the ``"idle"`` chain.

``persist=N`` persists every N-th save (one due while a persist still runs is deferred to the
next save that finds every rank idle); ``persist="idle"`` persists a save when every rank's
previous persist is over, and a persist that ends goes straight on with the newest step every
rank committed meanwhile, decided together on a gloo group of the persist thread's own. A step
committed in memory but newer than every durable step (one a process that died left, or the last
of a run) is a leftover, persisted at start and at close.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .._engine import Engine
from ..errors import DamagedStepError
from ._handles import SaveFigures, SaveHandle
from ._persist import persist_part
from ._ranks import Ranks
from ._reports import Reports
from ._retention import Retention
from ._steps import committed_steps, complete, step_dir, steps

log = logging.getLogger("dcp_datastates")


class Persister:
    """Persists this rank's memory steps into the durable tier, by ``policy``.

    ``ranks``: every rank, on the manager's group (save-time decisions); ``chain``: the same
    ranks on the persist thread's group (the ``"idle"`` chain); ``after``: runs a call on the
    thread that keeps the tiers in save order; ``history``: the figures of the saves;
    ``errors``: where errors no handle carries are kept for ``wait`` and ``close`` to raise;
    ``check``: raises where the tiers may not be used (:meth:`~.claims.TierClaims.verify`), before
    each persist.
    """

    def __init__(self, policy: int | str, durable: Path, retention: Retention, *,
                 keep: tuple[int, int | None], ranks: Ranks, engine: Callable[[], Engine],
                 after: Callable[..., object], history: deque[SaveFigures],
                 errors: Reports, check: Callable[[], None]) -> None:
        self.policy, self.durable, self.retention = policy, durable, retention
        self.memory = retention.memory
        self.keep_memory, self.keep_durable = keep
        self.ranks, self.engine, self.after = ranks, engine, after
        self.history, self.errors, self.check = history, errors, check
        self.chain = ranks.another_group() if policy == "idle" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-persist")
        self._persisting: Future | None = None
        self._leftover: Future | None = None  # a persist no save's handle carries
        self._owed = False  # a persist was due but deferred
        self._saves = 0

    def after_save(self, handle: SaveHandle) -> None:
        """Persist the save of ``handle`` if it is due and every rank is idle (collective)."""
        self._saves += 1
        policy = self.policy
        due = self._owed or policy == "idle" or (
            isinstance(policy, int) and self._saves % policy == 0)
        if not due:
            return
        idle = self._persisting is None or self._persisting.done()
        failed = handle.committed.done() and handle.committed.exception() is not None
        if self.ranks.all(idle and not failed):
            if self._owed:
                log.info("dcp_datastates: persisting step %d (a persist was deferred)",
                         handle.step)
            self._owed = False
            self._persisting = handle.persisted = self._thread.submit(
                self._persist, handle.step, handle.committed, handle.figures)
        elif policy != "idle":
            if not self._owed:
                log.info("dcp_datastates: persist of step %d deferred: the previous persist "
                         "is still running", handle.step)
            self._owed = True

    def leftover(self, views: list[dict], what: str) -> None:
        """Persist the newest step every rank committed in memory (by ``views``), if it is
        newer than every durable checkpoint."""
        common = set.intersection(*(set(v["memory"]) for v in views))
        durable = views[0]["durable"]
        if common and (not durable or max(common) > durable[-1]):
            step = max(common)
            log.info("dcp_datastates: persisting step %d (%s)", step, what)
            self._persisting = self._leftover = self._thread.submit(
                self._persist, step, None, None)

    def drain(self) -> None:
        """Wait for the persist running; keep the error of a leftover's in ``errors``."""
        if self._persisting is not None:
            self._persisting.exception()
        leftover, self._leftover = self._leftover, None
        if leftover is not None and (exc := leftover.exception()) is not None:
            self.errors.append(exc)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _persist(self, step: int, memory_commit: Future | None,
                 figures: SaveFigures | None) -> None:
        """Persist ``step``; with ``persist="idle"``, then (the disk being free) the newest step
        every rank has committed in memory since, and so on while there is one. Every rank
        takes each "and so on" decision together, on the chain's group."""
        error = self._persist_one(step, memory_commit, figures)
        ok = error is None
        while self.chain is not None:
            with contextlib.ExitStack() as held:  # the step chosen, kept from retention
                nxt = self._next_to_persist(step, ok, held)
                if nxt is None:
                    break
                chained = self._persist_one(nxt, None, self._figures_of(nxt))
            if chained is not None:
                self.errors.append(chained)
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
                        offered.enter_context(self.retention.reading(s))
                mine = [s for s in committed_steps(self.memory)
                        if s > after and complete(step_dir(self.memory, s))]
            assert self.chain is not None  # persist="idle": the chain is what asks
            views = self.chain.gather(mine if ok else None)
            common = (set.intersection(*(set(v) for v in views))
                      if all(v is not None for v in views) else set())
            if not common:
                return None
            chosen = max(common)
            held.enter_context(self.retention.reading(chosen))
        return chosen

    def _figures_of(self, step: int) -> SaveFigures | None:
        return next((f for f in reversed(self.history) if f.step == step), None)

    def _persist_one(self, step: int, memory_commit: Future | None,
                     figures: SaveFigures | None) -> BaseException | None:
        """Persist ``step``; return what failed (logged), or None."""
        start = time.perf_counter()
        target = step_dir(self.durable, step)
        try:
            with self.retention.reading(step):  # from the start: retention must not take it
                if memory_commit is not None:
                    memory_commit.result()
                self.check()
                done = persist_part(self.engine(), step_dir(self.memory, step), target,
                                    self.ranks.rank, self.ranks.world)
        except BaseException as exc:  # noqa: BLE001 - the caller raises or records it
            log.error("dcp_datastates: persist of step %d to %s failed: %s", step, target, exc)
            if isinstance(exc, DamagedStepError):  # it would not load either: no checkpoint
                log.error("dcp_datastates: step %d is dropped from the memory tier %s: it is "
                          "damaged", step, self.memory)
                with contextlib.suppress(RuntimeError):  # the manager is closing
                    self.after(self.retention.drop, self.memory, step)
            return exc
        finally:
            # retention left this step while it was read: drop it now if it is beyond keep_memory
            with contextlib.suppress(RuntimeError):  # the manager is closing
                self.after(self.retention.retain, self.memory, self.keep_memory)
        if figures is not None:
            figures.persist_s = time.perf_counter() - start
        if done:
            log.info("dcp_datastates: step %d persisted to %s", step, target)
            self.retention.retain(self.durable, self.keep_durable)
        return None
