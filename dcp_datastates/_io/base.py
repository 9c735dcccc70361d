"""The contract every I/O backend meets: blocking batched reads and writes at absolute offsets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class IOReq:
    """One contiguous transfer: ``nbytes`` at memory address ``addr`` <-> file offset ``offset``."""

    addr: int
    nbytes: int
    offset: int


class IOBackend(Protocol):
    """A file I/O engine. Every call blocks until all of its requests are done (or one failed).

    Errors are raised as ``OSError(errno, message, path)``. A read that meets end of file
    before ``nbytes`` raises ``OSError(errno.EIO, "unexpected end of file ...", path)``.
    Calls may come from several threads at once.
    """

    name: str

    def register(self, addr: int, nbytes: int) -> None:
        """Tell the backend about a long-lived buffer (an engine arena) it may pre-register.

        A registration the kernel refuses is logged; I/O on the buffer then works as on any
        other memory."""

    def unregister(self, addr: int, nbytes: int) -> None:
        """Forget a buffer passed to :meth:`register`, before its memory is freed and with no
        I/O in flight on it. Afterwards nothing of the backend refers to (or pins) the range,
        so memory mapped later at the same address is never taken for the old buffer."""

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Write every request in full."""

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Read every request in full."""

    def fsync(self, fd: int, path: str) -> None:
        """Make the file's data durable."""

    def close(self) -> None:
        """Release rings, threads and registrations; call it with no I/O in flight."""
