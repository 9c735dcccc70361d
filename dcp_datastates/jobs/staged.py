"""The snapshots one writer staged, kept in order until a DCP save takes each."""

from __future__ import annotations

import threading
from collections import deque

from ..errors import CheckpointError
from .save import SaveJob


class StagedSaves:
    """A writer's staged save jobs, oldest first. A DCP save takes the oldest whose staged
    state dict was handed out (``SaveJob.stage`` hands out one only after the writer's previous
    job was taken, so the DCP thread that asks is the one that got it)."""

    def __init__(self) -> None:
        self._jobs: deque[SaveJob] = deque()
        self._lock = threading.Lock()

    def add(self, job: SaveJob) -> SaveJob | None:
        """Queue ``job``; return the writer's previous job still running, if any."""
        with self._lock:
            before = next((j for j in reversed(self._jobs) if not j.ended), None)
            self._jobs.append(job)
        return before

    def take(self) -> SaveJob | None:
        """The oldest job a save may take now (None: this is a plain save)."""
        with self._lock:
            while self._jobs and self._jobs[0].ended:
                self._jobs.popleft()
            if self._jobs and self._jobs[0].staged.done():
                return self._jobs.popleft()
        return None

    def discard(self) -> None:
        """End every job no save has taken; its cache memory is freed."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job.copied.wait()  # its staging thread must be done with the lease
            if job.owner is None:
                job.end(CheckpointError(f"save {job.id}'s snapshot was discarded by close()"))
