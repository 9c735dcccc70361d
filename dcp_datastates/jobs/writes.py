"""In-place writes to a save's sources before its copies could take the values of the call.

A snapshot's GPU sources are copied lazily, on a side stream, while training goes on. A write
that the training queues after the copies are ordered ahead of its work (the optimizer's step:
the engine's step pre-hook orders the training's streams behind the copies) or after they are
over cannot reach them. Any other in-place write between ``async_save`` and that moment may
land before or during a copy: the checkpoint would hold values the state never had together.
Such a write bumps the tensor's version counter when it is queued, so :class:`WriteWatch`
compares each source's version at the call with its version at that moment, and the save
fails naming the tensors rather than commit a snapshot that may be torn.
"""

from __future__ import annotations

import threading

import torch


class WriteWatch:
    """Version counters of a save's lazily copied sources: at the call, and at the *fence*
    (the first moment from which the training's work is queued behind the copies)."""

    def __init__(self, sources: dict[int, torch.Tensor]) -> None:
        self._sources = sources  # source index -> the caller's tensor (held until checked)
        self._start = {i: t._version for i, t in sources.items()}
        self._fenced: dict[int, int] | None = None
        self._lock = threading.Lock()

    def fence(self) -> None:
        """Work queued from now on runs after the copies: record the versions now (once)."""
        with self._lock:
            if self._fenced is None:
                self._fenced = {i: t._version for i, t in self._sources.items()}
                self._sources = {}

    def changed(self) -> list[int]:
        """Fence now if not yet; the sources written in place before the fence."""
        self.fence()
        return sorted(i for i, v in self._fenced.items() if v != self._start[i])
