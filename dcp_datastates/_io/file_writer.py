"""Writes one data file from pieces of host memory, many large requests in flight.

Pieces that lie in one lease at the distances they have in the file (a snapshot is laid out as
its file) are merged into runs first, so thousands of small tensors leave in a few requests.
With O_DIRECT, the 4 KiB-aligned body of a run goes to the file straight from memory; every
other byte (unaligned pieces, run tails, the header) is gathered into bounce buffers, in
extents, and written from there. Without O_DIRECT (tmpfs, or turned off) every run is written
from where it lies. Batches written one after the other must not share a 4 KiB block.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from .._format.align import ALIGN, round_up
from .._format.directory import FILE_MODE, memory_backed
from .._memory.host_cache import Lease, Pool
from .base import IOBackend, IOReq

#: Bytes gathered into one bounce buffer, and the size of one write request.
EXTENT_BYTES = 16 << 20
#: Write tasks of one file queued on the I/O threads at once: a large file (a persist's) does
#: not queue the whole of itself ahead of another save's few small writes.
MAX_QUEUED = 16


@dataclass(frozen=True)
class Piece:
    """``nbytes`` at memory address ``addr`` belong at ``offset`` of the file.

    ``lease`` is the lease ``addr`` lies in, if any: its bytes between pieces are zero, so
    neighbouring pieces of one lease can be written as one run.
    """

    offset: int
    addr: int
    nbytes: int
    lease: Lease | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    """Sort ``pieces`` by file offset and merge neighbours that one lease holds in file order."""
    runs: list[Piece] = []
    for p in sorted((p for p in pieces if p.nbytes), key=lambda p: p.offset):
        last = runs[-1] if runs else None
        if (
            last is not None and p.lease is not None and last.lease is p.lease
            and p.offset >= last.end and p.offset - last.offset == p.addr - last.addr
        ):
            runs[-1] = Piece(last.offset, last.addr, p.end - last.offset, p.lease)
        else:
            runs.append(p)
    return runs


def _open_for_write(path: Path, direct: bool | None, create: bool = True) -> tuple[int, bool]:
    """Create ``path`` (it must not exist; with ``create`` False, open the file there);
    O_DIRECT when asked or, for None, when it helps.

    It does not help on memory file systems (tmpfs, ramfs): there the page cache is the file.
    """
    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    if direct is None and memory_backed(path.parent):
        direct = False
    if direct is not False:
        try:
            return os.open(path, flags | os.O_DIRECT, FILE_MODE), True
        except OSError as exc:
            if exc.errno != errno.EINVAL or direct:
                raise
    return os.open(path, flags, FILE_MODE), False


class DataFile:
    """One data file being written: created at once (or, with ``create`` False, one that
    exists, such as a memory-tier slot holding the data already), written in batches, then
    finished (truncated to size and fsynced) or aborted (removed). Nothing it submitted is
    still running when either returns."""

    def __init__(self, path: Path, direct: bool | None, io: IOBackend, bounce: Pool,
                 submit: Callable[..., Future], create: bool = True) -> None:
        self.path = path
        self.io = io
        self.bounce = bounce
        self.submit = submit
        self.extent = min(EXTENT_BYTES, max(ALIGN, bounce.capacity // 4 // ALIGN * ALIGN))
        self.fd, self.direct = _open_for_write(path, direct, create)
        self._cancel = threading.Event()
        self._queued = threading.BoundedSemaphore(MAX_QUEUED)
        self._futures: list[Future] = []

    def preallocate(self, nbytes: int) -> None:
        """Reserve the file's blocks first: O_DIRECT writes inside the file size stay async."""
        if not self.direct:
            return
        try:
            os.posix_fallocate(self.fd, 0, round_up(nbytes))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise

    def write(self, pieces: list[Piece]) -> None:
        """Start writing ``pieces`` (returns once the last batch is queued; :meth:`finish`
        waits for them)."""
        runs = _coalesce(pieces)
        if not self.direct:
            reqs = [IOReq(r.addr + s, min(self.extent, r.nbytes - s), r.offset + s)
                    for r in runs for s in range(0, r.nbytes, self.extent)]
            for k in range(0, len(reqs), 64):
                self._start(self._write, reqs[k : k + 64])
            return
        gathered: list[Piece] = []
        for i, r in enumerate(runs):
            body = 0
            if r.offset % ALIGN == 0 and r.addr % ALIGN == 0:
                next_start = runs[i + 1].offset if i + 1 < len(runs) else None
                whole = round_up(r.nbytes)
                lease_left = (r.lease.addr + r.lease.capacity - r.addr) if r.lease else 0
                fits = next_start is None or next_start >= r.offset + whole
                body = whole if lease_left >= whole and fits else r.nbytes - r.nbytes % ALIGN
            for s in range(0, body, self.extent):
                self._start(self._write, [IOReq(r.addr + s, min(self.extent, body - s),
                                                r.offset + s)])
            if body < r.nbytes:
                gathered.append(Piece(r.offset + body, r.addr + body, r.nbytes - body))
        for a, b, parts in _extents(gathered, self.extent):
            self._start(self._gather_write, a, b, parts)

    def finish(self, file_size: int) -> None:
        """Wait for every write, cut the file to ``file_size``, fsync, close. On error the
        file is removed and the first error raised."""
        try:
            self._wait()
            os.ftruncate(self.fd, file_size)  # O_DIRECT wrote whole blocks
            self.io.fsync(self.fd, str(self.path))
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = -1

    def abort(self) -> None:
        """Stop, wait for what was submitted, close and remove the file (idempotent)."""
        self._cancel.set()
        for f in self._futures:
            f.exception()  # waits; errors are reported by whoever called finish
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)

    def _start(self, fn: Callable, *args: object) -> None:
        """Submit ``fn(*args)``, waiting while ``MAX_QUEUED`` of this file's are queued."""
        self._queued.acquire()
        try:
            self._futures.append(self.submit(self._guarded, fn, *args))
        except BaseException:
            self._queued.release()
            raise

    def _guarded(self, fn: Callable, *args: object) -> None:
        try:
            if not self._cancel.is_set():
                fn(*args)
        except BaseException:
            self._cancel.set()
            raise
        finally:
            self._queued.release()

    def _write(self, reqs: list[IOReq]) -> None:
        self.io.write(self.fd, str(self.path), reqs)

    def _gather_write(self, a: int, b: int, parts: list[Piece]) -> None:
        """Copy the parts' bytes in ``[a, b)`` into a bounce buffer, zero the rest, write it."""
        lease = self.bounce.allocate(b - a)
        try:
            cursor = a
            for p in parts:
                lo, hi = max(p.offset, a), min(p.end, b)
                if lo > cursor:
                    ctypes.memset(lease.addr + cursor - a, 0, lo - cursor)
                ctypes.memmove(lease.addr + lo - a, p.addr + lo - p.offset, hi - lo)
                cursor = hi
            if cursor < b:
                ctypes.memset(lease.addr + cursor - a, 0, b - cursor)
            self._write([IOReq(lease.addr, b - a, a)])
        finally:
            lease.release()

    def _wait(self) -> None:
        error: BaseException | None = None
        for f in self._futures:
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error


def _extents(pieces: list[Piece], extent: int) -> list[tuple[int, int, list[Piece]]]:
    """Block-aligned ``[a, b)`` extents covering ``pieces`` (sorted by offset), each with the
    pieces that overlap it."""
    ranges: list[list[int]] = []
    for p in pieces:
        lo, hi = p.offset - p.offset % ALIGN, round_up(p.end)
        if ranges and lo <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], hi)
        else:
            ranges.append([lo, hi])
    out: list[tuple[int, int, list[Piece]]] = []
    k = 0
    for lo, hi in ranges:
        for a in range(lo, hi, extent):
            b = min(a + extent, hi)
            while k < len(pieces) and pieces[k].end <= a:
                k += 1
            j, parts = k, []
            while j < len(pieces) and pieces[j].offset < b:
                parts.append(pieces[j])
                j += 1
            out.append((a, b, parts))
    return out
