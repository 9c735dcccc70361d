"""The claims of a manager's tier directories: one manager (one job) at a time on each.

Each rank claims its memory tier; the job claims its durable tier, through rank 0 (every rank
of a job shares the durable tier: one claim per job, not per process). A claim is a
:class:`~dcp_datastates.directory.DirectoryClaim` (an ``fcntl`` lock that dies with its
process, so a manager killed by SIGKILL leaves none behind) on a lock file beside the tier
directory, ``.<name>.dcp_datastates-tier.lock`` (the tier directory itself holds only steps);
the lock file holds the holder's pid. A second manager, in another process or in the same
one, fails at construction with an error naming the directory and that pid, on every rank.
A tier beside which this process may not write (a read-only durable tier a manager only loads
from) is not claimed: nothing of this process is written there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..directory import DirectoryClaim
from ..errors import CheckpointError
from .ranks import Ranks

log = logging.getLogger("dcp_datastates")

LOCK_SUFFIX = ".dcp_datastates-tier.lock"
#: How long a refused claim waits for the holder's pid to be in its lock file.
PID_WAIT_S = 1.0


def lock_path(directory: Path) -> Path:
    """The lock file of the tier ``directory`` (of its real path: links name one tier)."""
    real = Path(os.path.realpath(directory))
    return real.parent / f".{real.name}{LOCK_SUFFIX}"


class TierClaim(DirectoryClaim):
    """One manager's claim of the tier ``directory`` (``what``: "memory tier", ...): its lock
    file holds the holder's pid, which the error of a second manager names."""

    def __init__(self, directory: Path, what: str) -> None:
        self.what = what
        super().__init__(directory, lock_path(directory))
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(self._fd, pid, 0)  # then cut: never an empty file while held
        os.ftruncate(self._fd, len(pid))

    def refused(self, directory: Path) -> CheckpointError:
        holder = _holder(self.path)
        pid = f"pid {holder}" if holder is not None else "pid unknown"
        return CheckpointError(
            f"{self.what} {directory} is in use by another CheckpointManager ({pid}, holding "
            f"{self.path}): close that manager first, or give this one other directories")


def _holder(path: Path) -> int | None:
    """The pid in the lock file ``path``; the holder writes it just after locking, so a
    contender that finds it empty looks again for a moment."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        try:
            text = path.read_text().split("\n", 1)[0].strip()
        except OSError:
            text = ""
        if text.isdigit() or time.monotonic() >= deadline:
            return int(text) if text.isdigit() else None
        time.sleep(0.005)


def claim_tier(directory: Path, what: str) -> TierClaim | None:
    """Claim the tier ``directory``; raise CheckpointError naming it and the holder's pid
    where another manager holds it. None: read-only, not claimed."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        return TierClaim(directory, what)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        log.info("dcp_datastates: %s %s is not claimed: %s (read-only?)", what, directory, exc)
        return None


@contextlib.contextmanager
def claimed(directories: list[Path], what: str) -> Iterator[None]:
    """Hold the claims of the tiers ``directories`` meanwhile (an offline tool writing them
    while no manager does); raise as :func:`claim_tier` where a manager holds one."""
    with contextlib.ExitStack() as held:
        for directory in directories:
            claim = claim_tier(directory, what)
            if claim is not None:
                held.callback(claim.release)
        yield


class TierClaims:
    """This rank's memory tier and (rank 0's) the job's durable tier, claimed collectively:
    where any rank cannot claim its tier, every rank raises that rank's error."""

    def __init__(self, memory: Path, durable: Path | None, ranks: Ranks) -> None:
        self._held: list[TierClaim | None] = []
        error: Exception | None = None
        try:
            self._held.append(claim_tier(memory, "memory tier"))
            if durable is not None and ranks.rank == 0:
                self._held.append(claim_tier(durable, "durable tier"))
        except (CheckpointError, OSError) as exc:  # every rank must reach the gather
            error = exc
        errors = ranks.gather(None if error is None else str(error))
        failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            self.release()
            if error is not None:
                raise error
            raise CheckpointError(f"rank {failed[0]}: {failed[1]}")

    def release(self) -> None:
        """Drop the claims (idempotent)."""
        held, self._held = self._held, []
        for claim in held:
            if claim is not None:
                claim.release()
