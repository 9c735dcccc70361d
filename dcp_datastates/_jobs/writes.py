"""In-place writes to a save's sources before its copies could take the values of the call.

A snapshot's GPU sources are copied lazily, on a side stream, while training goes on. A write
that the training queues after the copies are ordered ahead of its work (the optimizer's step:
the engine's step pre-hook orders the training's streams behind the copies) or after they are
over cannot reach them. Any other in-place write between ``async_save`` and that moment may
land before or during a copy: the checkpoint would hold values the state never had together.
Such a write bumps the tensor's version counter when it is queued (a DTensor's own counter for
an op on the DTensor, its local tensor's for one on ``to_local()``; torch's in-place foreach
ops on DTensors bump neither, and go unseen), so :class:`WriteWatch` compares each source's
versions at the call with its versions at that moment, and the save fails naming the tensors
rather than commit a snapshot that may be torn.

Writes that bump no counter go unseen: through ``p.data``, a ``set_()`` alias,
``untyped_storage()``, ``.numpy()`` or DLPack, BatchNorm's running statistics in forward.
Sources copied in the call (:func:`~dcp_datastates._jobs.snapshot.keep_still`: CPU tensors,
small GPU ones) are not watched: no write after the call reaches their copies.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor


class WriteWatch:
    """Version counters of a save's lazily copied sources: at the call, and at the *fence*
    (the first moment from which the training's work is queued behind the copies)."""

    def __init__(self, sources: dict[int, torch.Tensor]) -> None:
        # source index -> the caller's tensors whose counters tell of a write (held until
        # fenced); a DTensor's local tensor as it is now (the one the copy reads)
        self._sources = {i: _written_through(t) for i, t in sources.items()}
        self._start = {i: _versions(ts) for i, ts in self._sources.items()}
        self._fenced: dict[int, tuple[int, ...]] | None = None
        self._lock = threading.Lock()

    def fence(self) -> None:
        """Work queued from now on runs after the copies: record the versions now (once)."""
        with self._lock:
            if self._fenced is None:
                self._fenced = {i: _versions(ts) for i, ts in self._sources.items()}
                self._sources = {}

    def changed(self) -> list[int]:
        """Fence now if not yet; the sources written in place before the fence."""
        self.fence()
        fenced = self._fenced
        assert fenced is not None  # fence() has set it, and nothing unsets it
        return sorted(i for i, v in fenced.items() if v != self._start[i])


def _written_through(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t``, and a DTensor's local tensor: an in-place op on either bumps its own counter."""
    return (t, t._local_tensor) if isinstance(t, DTensor) else (t,)


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)
