"""A worker in the background: a step function run on a thread of its own whenever woken.

:class:`Background` runs the step function on its thread, started at the first
:meth:`~Background.wake`, until the function has nothing left to do; a later wake runs it
again. :meth:`~Background.close` stops it after the step in progress and joins it. The memory
tier's slot pool (``tiers/_slots.py``) readies its free slots with one (sizes and pins them), so
that neither ``prepare()`` nor a save waits for ``cudaHostRegister`` (slow for a large slot).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """Runs ``step`` (True: it did something, call it again) on the thread ``name`` whenever
    woken, until closed."""

    def __init__(self, step: Callable[[], bool], name: str) -> None:
        self._step, self._name = step, name
        self._woken = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wake(self) -> None:
        """Have ``step`` run until it has nothing to do (the thread is started if need be)."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._woken.set()

    def _run(self) -> None:
        while True:
            self._woken.wait()
            self._woken.clear()  # a wake while the steps run makes another round
            while not self._closed and self._step():
                pass
            if self._closed:
                return

    def close(self) -> None:
        """Stop after the step in progress and join the thread (idempotent)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._woken.set()
        if thread is not None:
            thread.join()
