"""Writes one data file from pieces of host memory, through an I/O backend, many extents at once.

With O_DIRECT, a piece that owns a whole 4 KiB-aligned cache region (a staged snapshot of a large
item) goes to the file straight from the cache; every other byte range is gathered into bounce
buffers of the cache, in extents, and written from there. Without O_DIRECT (tmpfs, or turned
off), every piece is written straight from where it lies.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import torch

from .host_cache import Pool, Region, round_up
from .io.base import ALIGN, IOBackend, IOReq

#: Bytes gathered into one bounce buffer, and the size of one write request.
EXTENT_BYTES = 16 << 20


@dataclass(frozen=True)
class Piece:
    """``data`` (a flat uint8 CPU tensor) belongs at ``offset`` of the file.

    ``region`` is set when ``data`` is exactly the start of that cache region, whose tail up to
    the 4 KiB boundary is zero: then it can be written from the cache directly.
    """

    offset: int
    data: torch.Tensor
    region: Region | None = None

    @property
    def end(self) -> int:
        return self.offset + self.data.numel()


def open_for_write(path: Path, direct: bool | None) -> tuple[int, bool]:
    """Create ``path`` (it must not exist); O_DIRECT when asked or, for None, when it helps.

    It does not help on memory file systems (tmpfs, ramfs): there the page cache is the file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct is None and memory_backed(path.parent):
        direct = False
    if direct is not False:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL or direct:
                raise
    return os.open(path, flags, 0o644), False


class FileWriter:
    """Writes data files with a shared executor, backend and bounce pool."""

    def __init__(self, backend: IOBackend, bounce: Pool, executor: Executor) -> None:
        self.backend = backend
        self.bounce = bounce
        self.executor = executor
        self.extent = min(EXTENT_BYTES, max(ALIGN, bounce.capacity // 4 // ALIGN * ALIGN))

    def write(self, path: Path, pieces: list[Piece], file_size: int, direct: bool | None) -> bool:
        """Write ``pieces`` into a new file of ``file_size`` bytes and fsync it.

        Returns whether O_DIRECT was used. On any error the partial file is removed.
        """
        pieces = sorted((p for p in pieces if p.data.numel()), key=lambda p: p.offset)
        fd, is_direct = open_for_write(path, direct)
        cancel = threading.Event()
        try:
            if is_direct:
                _preallocate(fd, round_up(file_size))
            jobs = self._direct_jobs(pieces) if is_direct else self._buffered_jobs(pieces)
            futures = [self.executor.submit(job, fd, str(path), cancel) for job in jobs]
            _wait_all(futures, cancel)
            os.ftruncate(fd, file_size)  # O_DIRECT wrote whole blocks; a trailing pad wrote nothing
            self.backend.fsync(fd, str(path))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return is_direct

    def _buffered_jobs(self, pieces: list[Piece]) -> list:
        batches: list[list[IOReq]] = [[]]
        size = 0
        for p in pieces:
            for start in range(0, p.data.numel(), self.extent):
                n = min(self.extent, p.data.numel() - start)
                if size + n > self.extent and batches[-1]:
                    batches.append([])
                    size = 0
                batches[-1].append(IOReq(p.data.data_ptr() + start, n, p.offset + start))
                size += n
        keep = [p.data for p in pieces]
        return [_write_job(reqs, self.backend, keep) for reqs in batches if reqs]

    def _direct_jobs(self, pieces: list[Piece]) -> list:
        jobs = []
        spans: list[list[int]] = []
        gathered: list[Piece] = []
        for i, p in enumerate(pieces):
            padded_end = round_up(p.end)
            next_start = pieces[i + 1].offset if i + 1 < len(pieces) else padded_end
            if (
                p.region is not None
                and p.offset % ALIGN == 0
                and next_start >= padded_end
                and p.region.capacity >= padded_end - p.offset
            ):
                reqs = [
                    IOReq(p.region.addr + s, min(self.extent, padded_end - p.offset - s),
                          p.offset + s)
                    for s in range(0, padded_end - p.offset, self.extent)
                ]
                jobs += [_write_job([r], self.backend, p.data) for r in reqs]
                continue
            gathered.append(p)
            start = p.offset - p.offset % ALIGN
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], padded_end)
            else:
                spans.append([start, padded_end])
        for lo, hi in spans:
            for a in range(lo, hi, self.extent):
                b = min(a + self.extent, hi)
                parts = [p for p in gathered if p.offset < b and p.end > a]
                jobs.append(_gather_job(a, b, parts, self.bounce, self.backend))
        return jobs


def _write_job(reqs: list[IOReq], backend: IOBackend, keep: object):
    """A job writing ``reqs``; ``keep`` (the memory they point at) lives as long as the job."""

    def job(fd: int, path: str, cancel: threading.Event) -> None:
        if not cancel.is_set() and keep is not None:
            backend.write(fd, path, reqs)

    return job


def _gather_job(a: int, b: int, parts: list[Piece], bounce: Pool, backend: IOBackend):
    """A job copying the pieces' bytes in ``[a, b)`` into a bounce buffer, then writing it."""

    def job(fd: int, path: str, cancel: threading.Event) -> None:
        if cancel.is_set():
            return
        region = bounce.allocate(b - a)
        try:
            buf = region.as_tensor(b - a)
            cursor = a
            for p in parts:
                lo, hi = max(p.offset, a), min(p.end, b)
                if lo > cursor:
                    buf[cursor - a : lo - a].zero_()
                buf[lo - a : hi - a].copy_(p.data[lo - p.offset : hi - p.offset])
                cursor = hi
            if cursor < b:
                buf[cursor - a :].zero_()
            backend.write(fd, path, [IOReq(region.addr, b - a, a)])
        finally:
            region.release()

    return job


def _wait_all(futures: list[Future], cancel: threading.Event) -> None:
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest stop
            cancel.set()
            error = error or exc
    if error is not None:
        raise error


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks first: O_DIRECT writes inside the file size stay asynchronous."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


_MEMORY_FS = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC
_libc = ctypes.CDLL(None, use_errno=True)


def memory_backed(directory: Path) -> bool:
    """Whether ``directory`` lives on a memory file system (statfs ``f_type``)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field (a long)
    if _libc.statfs(os.fsencode(directory), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FS
