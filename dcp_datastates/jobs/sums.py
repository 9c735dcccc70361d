"""Per-block checksums of a save's items, computed on the engine's checksum threads.

The items' blocks are dealt out in tasks of about equal bytes (about two per checksum thread),
one large item over many threads. A save job starts the checksums of its snapshot's copies the
moment they are all done (:class:`SnapshotSums`), so that they run while DCP plans the save;
the flush hashes the rest (bytes items, a plain save's tensors) and takes the snapshot's.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..align import round_up
from ..checksums import BLOCK_BYTES, deal_blocks, regions_checksums
from ..host_cache import Lease
from ..snapshot import nbytes_of

if TYPE_CHECKING:
    from ..engine import Engine

#: Checksum tasks cover at least this many bytes; each thread gets about this many tasks.
_SUM_BYTES, _TASKS_PER_THREAD = BLOCK_BYTES, 2


def _sum_pieces(pieces: list[tuple[int, int, int]]) -> list[list[int]]:
    return regions_checksums([(a, n) for _, a, n in pieces], BLOCK_BYTES)


class Sums:
    """Per-block checksums of keyed items (memory regions) in flight on ``engine``'s checksum
    threads. Whoever starts them waits for them (:meth:`wait`) before the memory goes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tasks: list[Future] = []
        self._parts: dict[Hashable, list[tuple[Future, int]]] = {}  # key -> (task, piece)

    def start(self, keys: list[Hashable], regions: list[tuple[int, int]]) -> None:
        """Start the checksums of memory ``regions`` (address, bytes), the items ``keys``."""
        total = sum(n for _, n in regions)
        tasks = _TASKS_PER_THREAD * self.engine.hash_workers
        share = max(_SUM_BYTES, round_up(-(-total // tasks), BLOCK_BYTES))
        for pieces in deal_blocks(regions, share):
            task = self.engine.compute(_sum_pieces, pieces)
            self._tasks.append(task)
            for at, (k, _, _) in enumerate(pieces):
                self._parts.setdefault(keys[k], []).append((task, at))

    def has(self, key: Hashable) -> bool:
        """Whether the item ``key`` was started."""
        return key in self._parts

    def of(self, key: Hashable) -> list[int]:
        """The checksums of the item ``key`` (waits for them; raises a task's error)."""
        return [s for task, at in self._parts[key] for s in task.result()[at]]

    def wait(self) -> None:
        """Wait for every task started (they read the items' memory); raises nothing."""
        for task in self._tasks:
            task.exception()


class SnapshotSums:
    """The checksums of a snapshot's copies in its lease (keyed by source index), owned by
    the save job: started the moment the copies are done, none after :meth:`close`, which
    waits for those started (before the lease goes)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sums: Sums | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self, staged: list[torch.Tensor], lease: Lease | None) -> None:
        """The copies ``staged`` are done: start the checksums of those in ``lease``."""
        if lease is None:
            return
        end = lease.addr + lease.capacity
        keys = [k for k, t in enumerate(staged) if t.numel() and lease.addr <= t.data_ptr() < end]
        with self._lock:
            if self._closed or not keys:
                return
            self._sums = Sums(self.engine)
            self._sums.start(keys, [(staged[k].data_ptr(), nbytes_of(staged[k])) for k in keys])

    def has(self, source: int) -> bool:
        """Whether the checksums of ``source``'s copy were started."""
        return self._sums is not None and self._sums.has(source)

    def of(self, source: int) -> list[int]:
        """The checksums of ``source``'s copy (waits for them)."""
        return self._sums.of(source)

    def close(self) -> None:
        """Start none from now on; wait for those started (they read the lease)."""
        with self._lock:
            self._closed = True
        if self._sums is not None:
            self._sums.wait()
