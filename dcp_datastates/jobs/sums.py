"""Per-block checksums of a save's items, computed on the engine's checksum threads.

:class:`Sums` hashes keyed memory regions, one large region over many threads. A snapshot in a
lease gets a :class:`SnapshotSums`: its sources are hashed as soon as their copies have landed
(``copy_into``'s ``landed``), while the rest of the snapshot is still being copied, so that the
flush finds most checksums done. They are of the very bytes the file holds: a snapshot is never
changed after its copy.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..align import round_up
from ..checksums import BLOCK_BYTES, deal_blocks, regions_checksums
from ..host_cache import Lease

if TYPE_CHECKING:
    from ..engine import Engine

#: Checksum tasks cover at least this many bytes; each thread gets about this many tasks.
_SUM_BYTES, _TASKS_PER_THREAD = BLOCK_BYTES, 2


def _sum_pieces(pieces: list[tuple[int, int, int]]) -> list[list[int]]:
    return regions_checksums([(a, n) for _, a, n in pieces], BLOCK_BYTES)


class Sums:
    """Per-block checksums of keyed items in flight on the checksum threads: the items' blocks
    are dealt out in tasks of about equal bytes, one large item over many threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tasks: list[Future] = []
        self._parts: dict[Hashable, list[tuple[Future, int]]] = {}  # key -> (task, piece)

    def start(self, keys: list[Hashable], regions: list[tuple[int, int]]) -> None:
        """Start the checksums of memory ``regions`` (address, bytes), the items ``keys``."""
        total = sum(n for _, n in regions)
        workers = self.engine.hash_workers
        share = max(_SUM_BYTES, round_up(-(-total // (_TASKS_PER_THREAD * workers)),
                                         BLOCK_BYTES))
        for pieces in deal_blocks(regions, share):
            task = self.engine.compute(_sum_pieces, pieces)
            self._tasks.append(task)
            for at, (k, _, _) in enumerate(pieces):
                self._parts.setdefault(keys[k], []).append((task, at))

    def started(self, key: Hashable) -> bool:
        return key in self._parts

    def of(self, key: Hashable) -> list[int] | None:
        """The item's checksums, once computed (None: never started)."""
        parts = self._parts.get(key)
        if parts is None:
            return None
        return [s for task, at in parts for s in task.result()[at]]

    def wait(self) -> None:
        """Wait for every task started (they read the items' memory)."""
        for task in self._tasks:
            task.exception()


class SnapshotSums:
    """The checksums of a snapshot's sources in a lease, started as their copies land. Owned
    by the save job, which calls :meth:`wait` before it releases the lease."""

    def __init__(self, engine: Engine, lease: Lease, offsets: list[int],
                 sizes: list[int]) -> None:
        self._sums = Sums(engine)
        self._addr, self._offsets, self._sizes = lease.addr, offsets, sizes
        self._lock = threading.Lock()
        self._closed = False

    def landed(self, sources: list[int]) -> None:
        """The copies of ``sources`` are in the lease: start their checksums (nothing once
        :meth:`wait` was called)."""
        with self._lock:
            if not self._closed:
                self._sums.start(sources, [(self._addr + self._offsets[s], self._sizes[s])
                                           for s in sources])

    def started(self, source: int) -> bool:
        return self._sums.started(source)

    def of(self, source: int) -> list[int] | None:
        """The source's checksums (None: never started)."""
        return self._sums.of(source)

    def wait(self) -> None:
        """Wait for every task started; none starts after this (the lease may then go)."""
        with self._lock:
            self._closed = True
        self._sums.wait()
