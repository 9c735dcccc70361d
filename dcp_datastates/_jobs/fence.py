"""When training may change a snapshot's sources: once the staging is done (*staged*), or, for
GPU work, once it is *ordered* (its copies queued on the GPU: work queued after events recorded
behind them runs after them).

A save's :class:`StagingFence` is set (like a ``threading.Event``) when it is staged: its sources
copied, failed or not, and its snapshot handed out. While the copies of GPU sources run on the side
streams it also holds an event per device recorded behind them: :meth:`StagingFence.order` then
makes the work queued next on the training's streams wait for those events and returns at once, so
the training thread goes on issuing work while the copies run (the optimizer's kernels queue behind
them). Once the copier has waited for them and takes the events back, the sources are free:
``order`` returns at once from then on, with or without a waiter.
"""

from __future__ import annotations

import threading
from typing import Protocol


class StreamWaiter(Protocol):
    def wait_current(self, events: dict[int, object]) -> None:
        """Make the work queued next on each device's current stream wait for its event."""


class StagingFence:
    """A save's staging: staged (``set``) or, for GPU sources, ordered (``publish``)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._free = threading.Event()  # the sources may change: done, or events taken back
        self._ordered = threading.Event()  # free, or events published
        self._lock = threading.Lock()
        self._events: dict[int, object] | None = None

    def set(self) -> None:
        """Staged: the copies are over (or will never run) and the snapshot handed out."""
        self._done.set()
        self._free.set()
        self._ordered.set()

    def release_sources(self) -> None:
        """The sources may change from now on (no copy reads them: the call copied them);
        the fence is set once the snapshot is handed out."""
        self._free.set()
        self._ordered.set()

    def is_set(self) -> bool:
        return self._done.is_set()

    def ordered(self) -> bool:
        """Whether the staging is ordered: :meth:`order` returns at once (with a waiter), the
        copies being over, or the events behind them published."""
        with self._lock:
            return self._free.is_set() or self._events is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the fence is set (staged: the copies over, the snapshot handed out)."""
        return self._done.wait(timeout)

    def publish(self, events: dict[int, object] | None) -> None:
        """The copier's call: ``events`` recorded behind the copies on each device once all
        are issued; None once it has waited for them, before the events are destroyed (the
        sources are free). Events are ignored once the sources are free: later copies (a
        snapshot moving from where it waited aside, maybe issued before the fence is set)
        read no source, and the training's streams must not wait for them."""
        with self._lock:
            if events is not None and self._free.is_set():
                return
            self._events = events
            if events is None:
                self._free.set()
        self._ordered.set()

    def order(self, waiter: StreamWaiter | None) -> None:
        """Hold the work queued next on the calling thread's streams until the copies are
        over: on the GPU where their events are published (``waiter`` makes the streams wait;
        this returns at once), else by waiting here."""
        self._ordered.wait()
        if waiter is not None:
            with self._lock:
                if self._events is not None:
                    waiter.wait_current(self._events)
                    return
        self._free.wait()
