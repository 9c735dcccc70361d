"""Host memory the engine owns: page-aligned arenas carved into leases.

An :class:`Arena` is memory mapped once (``mmap``, so it is 4 KiB aligned whatever torch's
allocator or sharing strategy does): anonymous, or a shared mapping of a file (a memory-tier
slot, whose pages are the file's), unmapped only by an explicit :meth:`Arena.free`.
A :class:`Pool` hands out :class:`Lease` ranges of it, first fit, each starting on a 4 KiB
boundary and spanning a multiple of 4 KiB, so a lease serves O_DIRECT and io_uring fixed-buffer
transfers as it is. A lease goes back to its pool only through :meth:`Lease.release`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .._format.align import ALIGN, round_up
from .._sizes import format_size

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux; not in Python's mmap module
_MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


MAP_PIECE = 16 << 20
"""Bytes populated per ``mmap`` call, or unmapped per ``munmap``: the kernel holds the
process's memory-map lock while it populates or takes down a mapping's pages, so every other
thread's ``mmap``, thread start or page fault waits for one piece, not for gigabytes."""

POPULATE_THREADS = 4
"""Threads that fault in a new arena's pages, each a piece at a time: one thread is bound by
the kernel's zeroing and mapping of each page, and more gained nothing where it was measured
(``benchmarks/RESULTS.md`` at 1d2b20c). Fewer on a machine with fewer than twice as many cores."""


def map_private(fd: int, nbytes: int, what: str) -> int:
    """Address of a private mapping of the first ``nbytes`` of file ``fd``, not populated
    (writable only so that ctypes and torch take its address: written, a page is copied).
    Undo with :func:`unmap`."""
    return _map(None, nbytes, mmap.MAP_PRIVATE, fd, 0, what)


def unmap(addr: int, nbytes: int) -> None:
    """Unmap ``nbytes`` at ``addr``, one :data:`MAP_PIECE` at a time."""
    for offset in range(0, nbytes, MAP_PIECE):
        _libc.munmap(addr + offset, min(MAP_PIECE, nbytes - offset))


def _map(addr: int | None, nbytes: int, flags: int, fd: int, offset: int, what: str) -> int:
    got = _libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise MemoryError(
            f"cannot map {format_size(nbytes)} of host memory for {what}: {os.strerror(err)}")
    return got


def _populate(addr: int, nbytes: int, flags: int, fd: int, what: str) -> None:
    """Fault in the pages of a fresh mapping, one :data:`MAP_PIECE` per call, on up to
    :data:`POPULATE_THREADS` threads. A file's pages are allocated first (:func:`_allocate`:
    a tmpfs file without room fails here, not with SIGBUS at a copy): the kernel zeroes them
    under the file's lock, not under the process's memory-map lock, which every other thread's
    page fault and ``mmap`` (the training's CUDA calls) would wait for; faulting them in then
    only maps them. ``madvise(MADV_POPULATE_WRITE)`` keeps the bytes a file holds; where the
    kernel lacks it, each piece is mapped again over itself with ``MAP_POPULATE``."""
    pieces = range(0, nbytes, MAP_PIECE)
    if fd >= 0:
        _allocate(fd, nbytes, pieces, what)
    threads = max(1, min(POPULATE_THREADS, (os.cpu_count() or 1) // 2, len(pieces)))

    def advise(offset: int) -> int:
        got = _libc.madvise(addr + offset, min(MAP_PIECE, nbytes - offset),
                            _MADV_POPULATE_WRITE)
        return 0 if got == 0 else ctypes.get_errno()

    if threads == 1:
        errors: Iterable[int] = map(advise, pieces)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="dcp_datastates-populate") as pool:
            errors = list(pool.map(advise, pieces))
    err = next((e for e in errors if e), 0)
    if err == errno.EINVAL:  # a kernel before 5.14
        fixed = flags | _MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0)
        for offset in pieces:
            _map(addr + offset, min(MAP_PIECE, nbytes - offset), fixed, fd, offset, what)
    elif err:  # EFAULT: a page would raise SIGBUS (a full tmpfs); ENOMEM
        room = "no room on its file system" if fd >= 0 else "out of memory"
        raise OSError(errno.ENOSPC if fd >= 0 else err,
                      f"cannot populate {format_size(nbytes)} of host memory for {what}: "
                      f"{room} ({os.strerror(err)})")


def _allocate(fd: int, nbytes: int, pieces: range, what: str) -> None:
    """Allocate the first ``nbytes`` of file ``fd``, one piece per ``posix_fallocate`` call:
    older kernels stop a tmpfs allocation at any signal and undo it, and one call for
    gigabytes, retried, could start over at every tick of a profiler's timer. On failure, the
    pages allocated here go back where the file had none before (a new slot's file)."""
    fresh = os.fstat(fd).st_blocks == 0
    done = 0
    try:
        for offset in pieces:
            os.posix_fallocate(fd, offset, min(MAP_PIECE, nbytes - offset))
            done = offset + MAP_PIECE
    except OSError as exc:
        if fresh and done:
            _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, 0, done)
        raise OSError(exc.errno, f"cannot allocate {format_size(nbytes)} of host memory for "
                      f"{what} on its file system: {exc.strerror}") from exc


#: CPU tensors smaller than this are copied with one ``memmove`` (less overhead than torch): by
#: a snapshot's copies and by the copies aside alike.
MEMMOVE_BYTES = 1 << 20


def nbytes_of(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (its view's, not its storage's)."""
    return t.numel() * t.element_size()


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` whose memory holds its values, the tensor whose bytes a checkpoint stores: a
    conjugate or negative view (whose bit torch applies only as it reads the memory) resolved
    into a copy, as ``torch.save`` stores it; any other tensor itself."""
    return t.resolve_conj().resolve_neg()


def set_storage(tensor: torch.Tensor, storage: torch.UntypedStorage, offset: int,
                size: torch.Size) -> torch.Tensor:
    """``tensor.set_(storage, offset, size)``: ``tensor`` over ``storage`` (contiguous)."""
    # torch's stub makes the stride required; the op defaults it (contiguous)
    return tensor.set_(storage, offset, size)  # type: ignore[call-overload]


@dataclass(eq=False)
class Lease:
    """``nbytes`` of an arena at ``offset``, with ``capacity`` (a multiple of 4 KiB) reserved."""

    pool: Pool
    offset: int
    nbytes: int
    capacity: int
    released: bool = field(default=False)

    @property
    def addr(self) -> int:
        return self.pool.arena.addr + self.offset

    def as_tensor(self, nbytes: int | None = None, start: int = 0) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of the lease as a flat uint8 tensor."""
        n = self.nbytes - start if nbytes is None else nbytes
        return self.pool.arena.mapped()[self.offset + start : self.offset + start + n]

    def storage(self) -> torch.UntypedStorage:
        """A storage of the lease's own (offset 0), which torch can pickle and share."""
        return self.pool.arena.mapped().untyped_storage()[self.offset : self.offset + self.capacity]

    def release(self) -> None:
        """Give the lease back to its pool (idempotent)."""
        self.pool.release(self)


class Pool:
    """First-fit allocator over an arena, with blocking allocation (backpressure)."""

    def __init__(self, arena: Arena, name: str) -> None:
        self.arena = arena
        self.name = name
        self.capacity = arena.nbytes
        self.used = 0
        self.live = 0
        self._free: list[list[int]] = [[0, arena.nbytes]]
        self._cond = threading.Condition()

    def try_allocate(self, nbytes: int) -> Lease | None:
        """A lease of at least ``nbytes``, or None if no free block is large enough now."""
        need = round_up(max(nbytes, 1))
        with self._cond:
            for block in self._free:
                if block[1] >= need:
                    lease = Lease(self, block[0], nbytes, need)
                    block[0] += need
                    block[1] -= need
                    if not block[1]:
                        self._free.remove(block)
                    self.used += need
                    self.live += 1
                    return lease
        return None

    def try_allocate_at(self, offset: int, nbytes: int) -> Lease | None:
        """The lease of ``nbytes`` at ``offset`` (4 KiB aligned), or None if any of that range
        is taken."""
        need = round_up(max(nbytes, 1))
        with self._cond:
            for k, (begin, size) in enumerate(self._free):
                if begin <= offset and offset + need <= begin + size:
                    tail = [offset + need, begin + size - offset - need]
                    self._free[k : k + 1] = [b for b in ([begin, offset - begin], tail) if b[1]]
                    self.used += need
                    self.live += 1
                    return Lease(self, offset, nbytes, need)
        return None

    def allocate(self, nbytes: int, timeout: float = 0.1) -> Lease:
        """A lease of at least ``nbytes``, waiting for releases while the pool is full."""
        if round_up(max(nbytes, 1)) > self.capacity:
            raise ValueError(
                f"{format_size(nbytes)} does not fit in the {self.name} pool of "
                f"{format_size(self.capacity)}"
            )
        while (lease := self.try_allocate(nbytes)) is None:
            self.wait_for_release(timeout)
        return lease

    def wait_for_release(self, timeout: float) -> None:
        """Block until some lease is released, or ``timeout`` seconds pass."""
        with self._cond:
            self._cond.wait(timeout)

    def release(self, lease: Lease) -> None:
        with self._cond:
            if lease.released:
                return
            lease.released = True
            self.used -= lease.capacity
            self.live -= 1
            self._insert_free(lease.offset, lease.capacity)
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


class Arena:
    """``nbytes`` of page-aligned memory with one pool over it: anonymous, or with ``fd`` the
    file's first ``nbytes`` mapped shared (the file must be at least that long: else
    ValueError).

    The pages are touched when mapped (:func:`_populate`), off the training path. Whoever made
    the arena frees it with :meth:`free` once no lease is live, after undoing any pinning or
    I/O registration of its address range.
    """

    def __init__(self, nbytes: int, name: str, fd: int | None = None) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"an arena needs at least {ALIGN} bytes, got {nbytes}")
        self.nbytes = round_up(nbytes)
        held = os.fstat(fd).st_size if fd is not None else self.nbytes
        if round_up(held) < self.nbytes:  # a page past the file's end: SIGBUS when touched
            raise ValueError(f"cannot map {format_size(self.nbytes)} of {name}: the file holds "
                             f"only {format_size(held)}")
        flags = mmap.MAP_SHARED if fd is not None else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        fd = -1 if fd is None else fd
        addr = _map(None, self.nbytes, flags, fd, 0, f"the {name} cache")
        try:
            _populate(addr, self.nbytes, flags, fd, f"the {name} cache")
        except BaseException:
            unmap(addr, self.nbytes)
            raise
        self.addr: int = addr
        self.tensor: torch.Tensor | None = torch.frombuffer(
            (ctypes.c_char * self.nbytes).from_address(addr), dtype=torch.uint8
        )
        self.pool = Pool(self, name)
        self.freed = False

    def mapped(self) -> torch.Tensor:
        """The memory as a flat uint8 tensor; raises RuntimeError once freed."""
        if self.tensor is None:
            raise RuntimeError(f"the {self.pool.name} cache is freed")
        return self.tensor

    def free(self) -> None:
        """Unmap the memory. Raises RuntimeError while a lease is live."""
        if self.freed:
            return
        if self.pool.live:
            raise RuntimeError(
                f"cannot free the {self.pool.name} cache: {self.pool.live} lease(s) still live"
            )
        self.freed = True
        self.tensor = None
        unmap(self.addr, self.nbytes)
