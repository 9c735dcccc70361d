"""Per-save and per-load figures: bytes, how long each phase took, through which backend."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ._sizes import format_size

__all__ = ["LoadStats", "SaveStats"]

log = logging.getLogger("dcp_datastates")


@dataclass
class SaveStats:
    """*Stats*: one rank's figures for one storage save (a DCP save through the writer). Times are
    seconds from ``start`` (the ``async_save`` call, or the set-up of a plain ``dcp.save``);
    ``None`` where not measured (a plain save takes no snapshot). ``copy_s``: the GPU time of the
    snapshot's device-to-host copies, from their first byte (``snapshot_s`` also counts the wait for
    the work queued on the GPU before the call, whose results the snapshot copies).
    ``overflow_bytes`` were staged outside the cache, which was full."""

    backend: str
    start: float = field(default_factory=time.perf_counter)
    blocking_s: float | None = None
    snapshot_s: float | None = None
    copy_s: float | None = None
    staged_bytes: int = 0
    overflow_bytes: int = 0
    bytes_written: int = 0
    flush_s: float = 0.0
    durable_s: float | None = None
    direct_io: bool = False

    def add_flush(self, nbytes: int, seconds: float, direct: bool) -> None:
        self.bytes_written += nbytes
        self.flush_s += seconds
        self.direct_io = direct

    @property
    def flush_gib_s(self) -> float:
        return self.bytes_written / max(self.flush_s, 1e-9) / 2**30

    def log(self) -> None:
        log.info(
            "dcp_datastates save: %s written; blocked %s s, snapshot %s s (%s staged, %s over "
            "the cache), flush %.3f s (%.2f GiB/s), durable after %s s; backend=%s O_DIRECT=%s",
            format_size(self.bytes_written), _s(self.blocking_s), _s(self.snapshot_s),
            format_size(self.staged_bytes), format_size(self.overflow_bytes), self.flush_s,
            self.flush_gib_s, _s(self.durable_s), self.backend, self.direct_io,
        )


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


@dataclass
class LoadStats:
    """One rank's figures for one load: bytes delivered to the state dict, and seconds."""

    backend: str
    bytes_read: int = 0
    seconds: float = 0.0
    verified: bool = True

    @property
    def gib_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 2**30

    def log(self) -> None:
        log.info(
            "dcp_datastates load: %s read in %.3f s (%.2f GiB/s), checksums %s; backend=%s",
            format_size(self.bytes_read), self.seconds, self.gib_s,
            "verified" if self.verified else "not checked", self.backend,
        )
