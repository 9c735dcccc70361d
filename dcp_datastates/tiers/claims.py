"""The claims of a manager's tier directories: one manager (one job) at a time on each.

Each rank claims its memory tier; the job claims its durable tier, through rank 0 (every rank
of a job shares the durable tier: one claim per job, not per process). A claim is a
:class:`~dcp_datastates.directory.DirectoryClaim` (an ``fcntl`` lock that dies with its
process, so a manager killed by SIGKILL leaves none behind) on a lock file beside the tier
directory, ``.<name>.dcp_datastates-tier.lock`` (the tier directory itself holds only steps);
the lock file holds the holder's pid. A second manager, in another process or in the same
one, fails at construction with an error naming the directory and that pid, on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..directory import ClaimedError, DirectoryClaim
from .ranks import Ranks

LOCK_SUFFIX = ".dcp_datastates-tier.lock"


def lock_path(directory: Path) -> Path:
    """The lock file of the tier ``directory`` (of its real path: links name one tier)."""
    real = Path(os.path.realpath(directory))
    return real.parent / f".{real.name}{LOCK_SUFFIX}"


def claim_tier(directory: Path, what: str) -> DirectoryClaim:
    """Claim the tier ``directory`` (``what``: "memory tier", ...); raise ClaimedError naming
    it and the holder's pid where another manager holds it."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        return DirectoryClaim(directory, lock_path(directory))
    except ClaimedError as exc:
        pid = f"pid {exc.holder}" if exc.holder is not None else "pid unknown"
        raise ClaimedError(
            f"{what} {directory} is in use by another CheckpointManager ({pid}, holding "
            f"{lock_path(directory)}): close that manager first, or give this one other "
            f"directories", exc.holder) from None


class TierClaims:
    """This rank's memory tier and (rank 0's) the job's durable tier, claimed collectively:
    where any rank cannot claim its tier, every rank raises that rank's error."""

    def __init__(self, memory: Path, durable: Path | None, ranks: Ranks) -> None:
        self._held: list[DirectoryClaim] = []
        error: ClaimedError | None = None
        try:
            self._held.append(claim_tier(memory, "memory tier"))
            if durable is not None and ranks.rank == 0:
                self._held.append(claim_tier(durable, "durable tier"))
        except ClaimedError as exc:
            error = exc
        errors = ranks.gather(None if error is None else str(error))
        failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            self.release()
            if error is not None:
                raise error
            raise ClaimedError(f"rank {failed[0]}: {failed[1]}", None)

    def release(self) -> None:
        """Drop the claims (idempotent)."""
        held, self._held = self._held, []
        for claim in held:
            claim.release()
