"""The claims of the tier directories: one manager (one job), or one ``persist`` command, at a
time on each.

Each rank claims its memory tier; the job claims its durable tier, through rank 0 (every rank
of a job shares the durable tier: one claim per job, not per process). A claim is a
:class:`~dcp_datastates._format.directory.DirectoryClaim` (an ``fcntl`` lock that dies with its
process, so a manager killed by SIGKILL leaves none behind) on a lock file inside the tier,
``.dcp_datastates-tier.lock``: a tier that may be written can be claimed, whoever owns its
parent, and nothing is left beside it. The lock file holds the holder's pid and what it is (a
CheckpointManager, the ``persist`` command); a second one, in another process or in the same
one, fails naming the directory, the holder and its pid, on every rank.

The ``persist`` command claims the memory tiers it reads and the durable tier it writes;
``persist`` commands on one durable tier (one per node, ``--partial``) take turns there.

Before a tier is claimed it is made if need be, opened and checked (:mod:`.private`: owned by
this user, writable by no one else, and so is every directory above it), and it must be
writable where the holder is to write it: a durable tier a manager only loads from
(``persist=None``) may be read-only, and is then not claimed (nothing of this process is
written there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .._format.directory import DirectoryClaim
from ..errors import CheckpointError
from ._private import TierDirectory, open_tier, writable
from ._ranks import Ranks
from ._steps import PRIVATE_MODE, make_private

log = logging.getLogger("dcp_datastates")

LOCK_NAME = ".dcp_datastates-tier.lock"
#: How long a refused claim waits for the holder's pid to be in its lock file.
PID_WAIT_S = 1.0
#: How often a ``persist`` command looks again for its turn on a durable tier.
TURN_WAIT_S = 0.1
#: What holds a claim, as the error of a refused one names it.
MANAGER = "another CheckpointManager"
PERSIST_COMMAND = "a `python -m dcp_datastates persist` command"
#: Modes of the tier directories a claim makes: memory tiers private, durable ones readable.
MEMORY_MODE, DURABLE_MODE = PRIVATE_MODE, 0o755


class TierClaim(DirectoryClaim):
    """The claim of the tier ``directory`` (``what``: "memory tier", ...) by ``holder``
    (:data:`MANAGER`, ...): its lock file holds the pid and the holder, which the error of a
    second claim names."""

    def __init__(self, directory: Path, what: str, holder: str) -> None:
        self.what = what
        super().__init__(directory, directory / LOCK_NAME)
        mine = f"{os.getpid()}\n{holder}\n".encode()
        os.pwrite(self._fd, mine, 0)  # then cut: never an empty file while held
        os.ftruncate(self._fd, len(mine))

    def refused(self, directory: Path) -> CheckpointError:
        pid, holder = _holder(self.path)
        todo = ("close that manager first, or give this one other directories"
                if holder == MANAGER else "let it end first, or use other directories")
        if holder == MANAGER and self.what == "memory tier":  # a peer rank's, often
            todo += " (each rank of a job needs a memory_dir of its own, e.g. one per rank)"
        return CheckpointError(
            f"{self.what} {directory} is in use by {holder or 'another process'} (pid "
            f"{pid if pid is not None else 'unknown'}, holding {self.path}): {todo}")


def _holder(path: Path) -> tuple[int | None, str]:
    """The pid and the holder in the lock file ``path``; the holder writes them just after
    locking, so a contender that finds no pid looks again for a moment."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        try:
            lines = path.read_text().split("\n")
        except (OSError, UnicodeDecodeError):
            lines = [""]
        pid = lines[0].strip()
        if pid.isdigit() or time.monotonic() >= deadline:
            holder = lines[1].strip()[:100] if len(lines) > 1 else ""
            return (int(pid) if pid.isdigit() and len(pid) < 10 else None), holder
        time.sleep(0.005)


def _ready_tier(directory: Path, what: str, mode: int, *,
                required: bool) -> tuple[TierDirectory, bool]:
    """Open the tier ``directory`` (:func:`~.private.open_tier`: it and every directory above
    it checked), and return it and whether this process may write it; a tier it may write is
    narrowed to ``mode`` (:meth:`~.private.TierDirectory.narrow`). ``required``: it is to be
    written, so it is made (with ``mode``) if need be, and CheckpointError (saying why and
    what to do) is raised where it cannot be made or written; else a tier that does not exist
    is left alone (not open, False)."""
    if required:
        try:
            if mode == MEMORY_MODE:
                make_private(directory)
            else:
                directory.mkdir(parents=True, exist_ok=True, mode=mode)
        except OSError as exc:
            raise CheckpointError(f"{what} {directory} cannot be made: {exc}") from exc
    tier = open_tier(directory, what)
    if tier.fd is None:
        return tier, False
    try:
        if writable(directory):
            tier.narrow(mode)
            return tier, True
        if required:
            raise CheckpointError(
                f"{what} {directory} is not writable by this user: checkpoints could not be "
                f"written there. Make it writable (chmod u+w {directory}), or give another "
                f"directory" + (" (or persist=None to only load from it)"
                                if what == "durable tier" else ""))
    except BaseException:
        tier.close()
        raise
    log.info("dcp_datastates: %s %s is not writable by this user: read only, not claimed",
             what, directory)
    return tier, False


def _claim_tier(directory: Path, what: str, holder: str) -> TierClaim:
    """Claim the tier ``directory`` (ready: :func:`_ready_tier`) for ``holder``; raise
    CheckpointError naming it, the holder and its pid where another holds it."""
    try:
        return TierClaim(directory, what, holder)
    except OSError as exc:
        raise CheckpointError(f"{what} {directory} cannot be claimed: {exc}") from exc


@contextlib.contextmanager
def claimed(directories: list[Path], what: str) -> Iterator[None]:
    """Hold the claims of the tiers ``directories`` for the ``persist`` command meanwhile
    (it writes them while no manager does); raise as :func:`_claim_tier` where another holds
    one. A tier it may not write (another user's job left it readable) is read unclaimed."""
    with contextlib.ExitStack() as held:
        for directory in directories:
            tier, mine = _ready_tier(directory, what, MEMORY_MODE, required=False)
            held.callback(tier.close)
            if mine:
                held.callback(_claim_tier(directory, what, PERSIST_COMMAND).release)
        yield


@contextlib.contextmanager
def claimed_durable(directory: Path) -> Iterator[None]:
    """Hold the claim of the durable tier ``directory`` (checked as a manager's) for the
    ``persist`` command meanwhile: where a manager holds it, raise CheckpointError naming it
    and its pid; where another ``persist`` command does (a ``--partial`` run of another node),
    wait for it to end. A tier that does not exist yet (no manager holds it) or that this
    user may not write (the write fails, naming it) is not claimed."""
    tier, mine = _ready_tier(directory, "durable tier", DURABLE_MODE, required=False)
    try:
        if not mine:
            yield
            return
        while True:
            try:
                claim = _claim_tier(directory, "durable tier", PERSIST_COMMAND)
                break
            except CheckpointError:
                if _holder(directory / LOCK_NAME)[1] != PERSIST_COMMAND:
                    raise
                time.sleep(TURN_WAIT_S)
        try:
            yield
        finally:
            claim.release()
    finally:
        tier.close()


class TierClaims:
    """This rank's memory tier and (rank 0's) the job's durable tier, checked, held open
    (:class:`~.private.TierDirectory`) and claimed collectively: where any rank cannot, every
    rank raises that rank's error. ``persists``: the manager writes the durable tier (else it
    may be read-only, and is then not claimed). ``durable_new``: no manager had claimed the
    durable tier before (its lock file, which stays, was missing on rank 0): a tier made anew,
    or removed and made again; never where the manager does not persist and the tier does not
    exist (a ``persist=None`` run never makes it)."""

    def __init__(self, memory: Path, durable: Path | None, ranks: Ranks, *,
                 persists: bool) -> None:
        self._held: list[TierClaim] = []
        self._tiers: list[TierDirectory] = []
        self._ranks = ranks
        error: Exception | None = None
        self.durable_new = durable is not None and ranks.rank == 0 and (
            persists or durable.exists()) and not (durable / LOCK_NAME).exists()
        # rank 0's, the rank that claims it: gathered below
        try:
            self._tiers.append(_ready_tier(memory, "memory tier", MEMORY_MODE,
                                           required=True)[0])
            self._held.append(_claim_tier(memory, "memory tier", MANAGER))
            if durable is not None:
                tier, mine = _ready_tier(durable, "durable tier", DURABLE_MODE,
                                         required=persists)
                self._tiers.append(tier)
                if mine and ranks.rank == 0:
                    self._held.append(_claim_tier(durable, "durable tier", MANAGER))
        except (CheckpointError, OSError) as exc:  # every rank must reach the gather
            error = exc
        gathered = ranks.gather((None if error is None else str(error), self.durable_new))
        self.durable_new = gathered[0][1]
        self._raise_first(error, [e for e, _ in gathered], self.release)

    def _together(self, error: Exception | None, first: Callable[[], None]) -> None:
        """Where any rank has an ``error`` (collective: one all-reduce where none has), call
        ``first``, then raise this rank's, or the first failed rank's."""
        if self._ranks.all(error is None):
            return
        self._raise_first(error, self._ranks.gather(None if error is None else str(error)),
                          first)

    @staticmethod
    def _raise_first(error: Exception | None, errors: list[str | None],
                     first: Callable[[], None]) -> None:
        """Where a rank failed (``errors``, by rank), call ``first``, then raise this rank's
        ``error``, or the first failed rank's."""
        failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            first()
            if error is not None:
                raise error
            raise CheckpointError(f"rank {failed[0]}: {failed[1]}")

    def verify(self) -> None:
        """Raise CheckpointError where a tier's path no longer names the directory held
        (:meth:`~.private.TierDirectory.verify`): call before each use of the tiers."""
        for tier in self._tiers:
            tier.verify()

    def verify_together(self) -> None:
        """:meth:`verify` on every rank (collective): where it fails on one, every rank
        raises."""
        error: Exception | None = None
        try:
            self.verify()
        except (CheckpointError, OSError) as exc:
            error = exc
        self._together(error, lambda: None)

    def release(self) -> None:
        """Drop the claims and close the tiers (idempotent)."""
        held, self._held = self._held, []
        tiers, self._tiers = self._tiers, []
        for claim in held:
            claim.release()
        for tier in tiers:
            tier.close()
