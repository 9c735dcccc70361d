"""The host cache: one page-aligned block of shared memory, made once and carved into regions.

Every region starts on a 4 KiB boundary and spans a multiple of 4 KiB, so a region serves
O_DIRECT and io_uring registered-buffer transfers as it is. The block is split in two pools:
``snapshots`` holds staged copies of state until they are flushed, ``bounce`` holds the short-lived
buffers the flush and restore paths gather bytes into. Keeping them apart means a flush never
waits for memory that a waiting snapshot holds, so backpressure cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from .io.base import ALIGN
from .sizes import format_size

#: The bounce pool's share of the cache: enough for a few flush extents in flight.
MAX_BOUNCE_BYTES = 256 << 20


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


@dataclass(eq=False)
class Region:
    """``nbytes`` of the cache at ``offset``, with ``capacity`` (a multiple of 4 KiB) reserved."""

    pool: Pool
    offset: int
    nbytes: int
    capacity: int
    released: bool = field(default=False)

    @property
    def addr(self) -> int:
        return self.pool.cache.addr + self.offset

    def as_tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """The region as a flat uint8 tensor (``nbytes`` long, default the requested size)."""
        n = self.nbytes if nbytes is None else nbytes
        return self.pool.cache.tensor[self.offset : self.offset + n]

    def own_storage_tensor(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A ``dtype``/``shape`` tensor over the region with a storage of its own (offset 0).

        Torch pickles a DTensor whose local tensor sits at a storage offset as a plain tensor
        (and crashes sharing it), so staged copies get their own storage slice.
        """
        storage = self.pool.cache.storage[self.offset : self.offset + self.nbytes]
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def zero_tail(self) -> None:
        """Zero the bytes between the requested size and the capacity (no stale memory in files)."""
        if self.capacity > self.nbytes:
            self.as_tensor(self.capacity)[self.nbytes :].zero_()

    def release(self) -> None:
        """Give the region back to its pool (idempotent)."""
        self.pool.release(self)


class Pool:
    """First-fit allocator over a slice of the cache, with blocking allocation (backpressure)."""

    def __init__(self, cache: HostCache, start: int, size: int, name: str) -> None:
        self.cache = cache
        self.name = name
        self.capacity = size
        self.used = 0
        self._free: list[list[int]] = [[start, size]] if size else []
        self._cond = threading.Condition()

    def try_allocate(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes``, or None if no free block is large enough now."""
        need = round_up(max(nbytes, 1))
        with self._cond:
            for block in self._free:
                if block[1] >= need:
                    region = Region(self, block[0], nbytes, need)
                    block[0] += need
                    block[1] -= need
                    if not block[1]:
                        self._free.remove(block)
                    self.used += need
                    return region
        return None

    def allocate(self, nbytes: int) -> Region:
        """A region of at least ``nbytes``, waiting for releases while the pool is full."""
        if round_up(max(nbytes, 1)) > self.capacity:
            raise ValueError(
                f"{format_size(nbytes)} does not fit in the {self.name} pool of "
                f"{format_size(self.capacity)}"
            )
        while True:
            region = self.try_allocate(nbytes)
            if region is not None:
                return region
            self.wait_for_release()

    def wait_for_release(self, timeout: float | None = None) -> None:
        """Block until some region is released (or ``timeout`` seconds pass)."""
        with self._cond:
            self._cond.wait(timeout)

    def release(self, region: Region) -> None:
        with self._cond:
            if region.released:
                return
            region.released = True
            self.used -= region.capacity
            self._insert_free(region.offset, region.capacity)
            self._cond.notify_all()

    def _insert_free(self, offset: int, size: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, [offset, size])
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1][1] += free.pop(i)[1]


class HostCache:
    """``nbytes`` of page-aligned shared memory, allocated once and reused across checkpoints.

    The memory is shared (an fd-backed mapping), so staged tensors that point into it cross to
    DCP's checkpoint process without a copy. ``bounce_only`` gives all of it to the bounce pool
    (a reader stages nothing).
    """

    def __init__(self, nbytes: int, *, bounce_only: bool = False) -> None:
        check_cache_size(nbytes)
        nbytes = round_up(nbytes)
        _check_shm_room(nbytes)
        self.nbytes = nbytes
        self.storage = torch.UntypedStorage._new_shared(nbytes)
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(self.storage)
        self.addr = self.storage.data_ptr()
        bounce = nbytes if bounce_only else min(MAX_BOUNCE_BYTES, round_up(nbytes // 4))
        self.snapshots = Pool(self, 0, nbytes - bounce, "snapshot")
        self.bounce = Pool(self, nbytes - bounce, bounce, "bounce")


def check_cache_size(nbytes: int) -> None:
    """Raise ValueError unless ``nbytes`` is a usable host cache size."""
    if nbytes < 4 * ALIGN:
        raise ValueError(f"host_cache_size must be at least 16 KiB, got {nbytes} bytes")


def _check_shm_room(nbytes: int) -> None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    room = st.f_bavail * st.f_frsize
    if room < nbytes:
        raise ValueError(
            f"host_cache_size {format_size(nbytes)} does not fit in /dev/shm "
            f"({format_size(room)} free); lower host_cache_size or enlarge /dev/shm "
            f"(e.g. docker --shm-size)"
        )
