"""The errors of a manager's saves and persists, raised to the caller once.

Every error is logged where it happens. ``wait()`` raises the first error of the saves since
the last ``wait()`` (also one that ``handle.result()`` raised already: ``wait()`` is where a
training loop that does not look at its handles learns of them); ``close()`` raises the first
one that nothing raised yet, neither ``handle.result()`` nor ``wait()``, so a run that handled
an error does not crash on it at the end.
"""

from __future__ import annotations

import threading

from ._handles import SaveHandle


class Reports:
    """Errors not yet raised by ``wait()``, each with the handle that carries it (None: an
    error no handle carries, such as a chained persist's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the persist thread adds to it
        self._pending: list[tuple[BaseException, SaveHandle | None]] = []

    def append(self, error: BaseException, handle: SaveHandle | None = None) -> None:
        with self._lock:
            if all(error is not e for e, _h in self._pending):
                self._pending.append((error, handle))

    def take(self) -> list[BaseException]:
        """The errors kept (forgetting them), for a caller with no one to raise them to."""
        with self._lock:
            pending, self._pending = self._pending, []
        return [error for error, _handle in pending]

    def raise_first(self, *, unraised_only: bool = False) -> None:
        """Raise the first error kept (with ``unraised_only``, the first that no
        ``handle.result()`` raised), forgetting them all."""
        with self._lock:
            pending, self._pending = self._pending, []
        for error, handle in pending:
            if not (unraised_only and handle is not None and handle.raised):
                raise error
