"""One save at a time per writer: DCP's collectives and the writer's per-save state need it."""

from __future__ import annotations

import threading


class SaveTurns:
    """A lock held by the thread running a save, from set-up to its last storage call.

    A save that fails outside the writer's own calls never releases it, so a waiter takes the
    turn over once the holder thread has exited (async saves run on threads that exit when the
    save ends), and a thread that stages a new async save cannot be inside a save itself.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: threading.Thread | None = None

    def acquire(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._owner not in (None, me) and self._owner.is_alive():
                self._cond.wait(0.1)
            self._owner = me

    def release(self) -> None:
        """Release the turn if the calling thread holds it."""
        with self._cond:
            if self._owner is threading.current_thread():
                self._owner = None
                self._cond.notify_all()
