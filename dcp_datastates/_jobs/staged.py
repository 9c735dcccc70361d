"""The snapshots one writer staged, kept until the DCP save that took each one starts."""

from __future__ import annotations

import threading

from ..errors import CheckpointError
from .save import SaveJob


class StagedSaves:
    """A writer's staged save jobs. DCP's upload thread asks for a job's staged state dict
    before it starts that save, so a save takes the job whose snapshot its thread took."""

    def __init__(self) -> None:
        self._jobs: list[SaveJob] = []
        self._lock = threading.Lock()

    def add(self, job: SaveJob) -> None:
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.ended] + [job]

    def take(self) -> SaveJob | None:
        """The job whose snapshot the calling thread took (None: this is a plain save)."""
        me = threading.current_thread()
        with self._lock:
            job = next((j for j in self._jobs if not j.ended and j.tie.taken_by(me)), None)
            if job is not None:
                self._jobs.remove(job)
        return job

    def discard(self) -> None:
        """End every job no save has taken; its cache memory is freed."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.quiet.wait()  # its staging must be done with the lease
            if job.tie.caller is None:
                job.end(CheckpointError(f"save {job.ticket}'s snapshot was discarded by close()"))
