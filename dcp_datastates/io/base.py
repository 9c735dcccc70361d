"""The contract every I/O backend meets: blocking batched reads and writes at absolute offsets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: Alignment that O_DIRECT and the host cache share (bytes).
ALIGN = 4096


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
        """Tell the backend about a long-lived buffer (the host cache) it may pre-register."""

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Write every request in full."""

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Read every request in full."""

    def fsync(self, fd: int, path: str) -> None:
        """Make the file's data durable."""

    def close(self) -> None:
        """Release rings, threads and registrations."""
