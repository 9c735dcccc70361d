"""Per-save figures: what was written, how long each phase took, through which backend."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .sizes import format_size

log = logging.getLogger("dcp_datastates")


@dataclass
class SaveStats:
    """One rank's figures for one save. Times are seconds; ``None`` where not measured."""

    backend: str
    start: float = field(default_factory=time.perf_counter)
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
            "dcp_datastates save: %s in %.3f s flush (%.2f GiB/s), durable after %s s, "
            "backend=%s, O_DIRECT=%s",
            format_size(self.bytes_written), self.flush_s, self.flush_gib_s,
            "?" if self.durable_s is None else f"{self.durable_s:.3f}",
            self.backend, self.direct_io,
        )
