"""When memory-tier steps are sent to the peers, and the thread that sends them.

An exchange sends this rank's newest committed step to the next rank and keeps the previous
rank's (:func:`.replica.replicate_step`), over gloo on the replicas' group: the host network,
not the training's NCCL links, at the speed TCP gives. It runs on a thread of its own, off the
path of the commits (a step's slot and retention never wait for its replica). A save is
replicated when every rank's previous exchange is over at its ``save()`` (decided together,
one all-reduce, as the idle persist chain decides); a save made while one still runs is not
(logged once per burst): replicas lag at most one exchange behind, and a slow network never
holds up the saves or piles exchanges up. The newest step sent stays in its owner's memory tier
until a newer one is sent (:meth:`.Retention.keep_sent`; going back past it or saving it again
lets it go, as its replicas), so that a rank whose node is lost and its peers have a step in
common however far the replicas lag.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _replica as replica
from ._handles import SaveHandle
from ._ranks import Ranks
from ._retention import Retention
from ._steps import step_dir

log = logging.getLogger("dcp_datastates")


class Replicator:
    """Sends this rank's memory steps to its peer on ``group`` (the replicas' own ranks);
    ``ranks``: every rank on the manager's group (the decision at each save); ``exchange``:
    :func:`.replica.replicate_step`, or a stand-in."""

    def __init__(self, ranks: Ranks, group: Ranks, retention: Retention, keep: int,
                 exchange: Callable[..., Path | None] = replica.replicate_step) -> None:
        self.ranks, self.group, self.retention, self.keep = ranks, group, retention, keep
        self._send = exchange  # (group, rank, world, memory root, step, mine) -> the replica
        self.memory = retention.memory
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-replica")
        self._lock = threading.Lock()
        self._owed = 0  # exchanges decided and not over
        self._skipping = False
        self._chosen: set[int] = set()  # saves whose exchange is decided, not yet started

    def decide(self, handle: SaveHandle) -> None:
        """At ``save()`` (collective): replicate this save if every rank is idle."""
        with self._lock:
            idle = self._owed == 0
        if self.ranks.all(idle):
            with self._lock:
                self._owed += 1
                self._chosen.add(id(handle))
            self._skipping = False
        elif not self._skipping:
            self._skipping = True
            log.info("dcp_datastates: step %d not replicated: a rank's previous exchange with "
                     "its peer is still running (saves go on; the next save made once it is "
                     "over is replicated)", handle.step)

    def committed(self, handle: SaveHandle) -> None:
        """In save order, once the save's commit is over: start its exchange if it was chosen
        (the step is kept from retention until the exchange is over)."""
        with self._lock:
            if id(handle) not in self._chosen:
                return
            self._chosen.discard(id(handle))
        held = contextlib.ExitStack()
        ok = handle.committed.exception() is None
        if ok:
            held.enter_context(self.retention.reading(handle.step))
        self._thread.submit(self._exchange, handle, ok, held)

    def _exchange(self, handle: SaveHandle, ok: bool, held: contextlib.ExitStack) -> None:
        """Exchange the step of ``handle`` with the peers (``held`` from retention meanwhile);
        once this rank's step is on its peer, retention keeps it until a newer one is: the
        ranks keep a step in common that the replicas can restore."""
        sent = False
        try:
            mine = step_dir(self.memory, handle.step) if ok else None
            got = self._send(self.group.group, self.ranks.rank, self.ranks.world, self.memory,
                             handle.step, mine)
            handle.figures.replicated = sent = ok
            if got is not None:
                self.retention.retain(got.parent, self.keep)
        except Exception as exc:  # noqa: BLE001 - the copy in memory stands
            log.error("dcp_datastates: replica of step %d failed: %s", handle.step, exc)
        finally:
            if sent:  # the step replicated before may go now
                self.retention.keep_sent(handle.step)
            with self._lock:
                self._owed -= 1
            held.close()

    def drain(self) -> None:
        """Wait for the exchanges started so far."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for the exchange in progress, stop the thread, let the newest replicated step
        go (retention drops it once it is old)."""
        self._thread.shutdown(wait=True)
        self.retention.keep_sent(None)
