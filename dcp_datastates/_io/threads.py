"""Portable backend: ``os.pwritev``/``os.preadv`` (which release the GIL) on a thread pool."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from .base import IOReq

__all__ = ["ThreadPoolBackend"]

_Piece = tuple[int, int, int]  # addr, nbytes, offset: a piece of a request (one syscall)


def _view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class _EOF(Exception):
    """A read met end of file."""


def _do_piece(write: bool, fd: int, addr: int, nbytes: int, offset: int) -> None:
    done = 0
    while done < nbytes:
        buf = _view(addr + done, nbytes - done)
        try:
            n = (
                os.pwritev(fd, [buf], offset + done)
                if write
                else os.preadv(fd, [buf], offset + done)
            )
        except OSError as e:
            # O_DIRECT: some filesystems answer the unaligned rest after a short read with EINVAL.
            if not write and done and e.errno == errno.EINVAL:
                raise _EOF from e
            raise
        if n == 0:
            if write:
                raise OSError(errno.EIO, "wrote 0 bytes")
            raise _EOF
        done += n


class ThreadPoolBackend:
    """IOBackend over a thread pool. Requests are cut into pieces of at most ``piece`` bytes
    (one syscall each); small pieces are grouped so that each task moves about ``piece`` bytes.
    Zero-length requests are ignored."""

    name = "threads"

    def __init__(self, workers: int | None = None, piece: int = 8 << 20) -> None:
        self.workers = workers or min(16, 4 * (os.cpu_count() or 1))
        self.piece = piece
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        """Nothing to pre-register for plain syscalls."""

    def unregister(self, addr: int, nbytes: int) -> None:
        """Nothing was registered."""

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dcp-io")
            return self._pool

    def _tasks(self, reqs: Sequence[IOReq]) -> list[list[_Piece]]:
        tasks: list[list[_Piece]] = []
        cur: list[_Piece] = []
        size = 0
        for r in reqs:
            if r.nbytes < 0 or r.offset < 0 or r.addr < 0:
                raise ValueError(f"invalid I/O request {r}")
            for pos in range(0, r.nbytes, self.piece):
                n = min(self.piece, r.nbytes - pos)
                cur.append((r.addr + pos, n, r.offset + pos))
                size += n
                if size >= self.piece:
                    tasks.append(cur)
                    cur, size = [], 0
        if cur:
            tasks.append(cur)
        return tasks

    def _rw(self, write: bool, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        failed = threading.Event()

        def run(task: list[_Piece]) -> None:
            for addr, nbytes, offset in task:
                if failed.is_set():
                    return
                try:
                    _do_piece(write, fd, addr, nbytes, offset)
                except BaseException:
                    failed.set()
                    raise

        tasks = self._tasks(reqs)
        try:
            if len(tasks) == 1:
                run(tasks[0])
            elif tasks:
                pool = self._executor()
                futures = [pool.submit(run, t) for t in tasks]
                wait(futures)  # drain everything before reporting
                for f in futures:
                    if f.exception() is not None:
                        f.result()
        except _EOF:
            raise OSError(errno.EIO, "unexpected end of file while reading", path) from None
        except OSError as e:
            op = "write" if write else "read"
            code = e.errno or errno.EIO
            raise OSError(code, f"{op} failed: {os.strerror(code)}", path) from e

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Write every request in full."""
        self._rw(True, fd, path, reqs)

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Read every request in full; EOF before the end raises ``OSError(EIO)``."""
        self._rw(False, fd, path, reqs)

    def fsync(self, fd: int, path: str) -> None:
        """``os.fsync`` with the path in the error."""
        try:
            os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno, f"fsync failed: {e.strerror}", path) from e

    def close(self) -> None:
        """Stop the worker threads."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
