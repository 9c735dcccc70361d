"""Step directories of a tier: naming, listing, and what makes one committed and complete.

Each tier directory holds one sub-directory per checkpoint, ``step_<N>``. A memory-tier step
holds one rank's checkpoint (a one-process DCP checkpoint of that rank's state) and a
``.tier.json`` record (step, rank, world size) written before the save starts; it is committed
once its ``.metadata`` is. A durable step holds every rank's data files and a ``.metadata``
merged from the ranks' parts (``.part.<rank>``), committed last.

A tier may name its step directories ``step-<N>`` instead (torchtitan's naming, so that
torchtitan finds, loads and purges the persisted checkpoints in its checkpoint folder): a
``.dcp_datastates-steps`` file in the tier's directory, written by :func:`name_steps`, says so,
and every function here follows it.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from .._format.directory import DIR_MODE, DirectoryClaim, new_token, remove_unreferenced
from .._format.entries import check_locations
from .._format.metadata_file import METADATA_NAME, read_metadata
from .._jobs.commit import data_files
from ..errors import CheckpointCorruptError, CheckpointError, brief

STEP_RE = re.compile(r"^step_(\d+)$")
RECORD_NAME = ".tier.json"
#: The file in a tier's directory that names its step directories (absent: ``step_<N>``).
NAMING_NAME = ".dcp_datastates-steps"
#: The prefixes a tier may name its step directories with: ours, torchtitan's.
PREFIXES = {"step_": STEP_RE, "step-": re.compile(r"^step-(\d+)$")}
#: The mode of the directories of a memory tier, and of the tier: the user's alone.
PRIVATE_MODE = 0o700
#: A memory-tier step being saved again holds this file until every rank has committed the new
#: save: the save id of the ``.metadata`` that the new save replaces ("" where it held none).
#: A ``.metadata`` of another save there is one that not every rank took: not complete.
REPLACING_NAME = ".replacing"

log = logging.getLogger("dcp_datastates")

#: What reading a damaged or hostile step can raise besides CheckpointError and OSError: bad
#: values (a number of more than 4300 digits, bad UTF-8, a shape DCP refuses), numbers out of
#: range, a ``.metadata`` holding objects of the wrong shape (LookupError, TypeError,
#: AttributeError), a cut pickle, nesting too deep, a size too large to allocate. Errors of
#: no such kind (a RuntimeError, an AssertionError) are not taken for damage.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (
    CheckpointError, OSError, ValueError, ArithmeticError, LookupError, TypeError,
    AttributeError, EOFError, pickle.UnpicklingError, RecursionError, MemoryError)


def _step_prefix(root: Path) -> str:
    """How ``root`` names its step directories: ``step_`` unless its naming file says
    ``step-``."""
    path = root / NAMING_NAME
    try:
        prefix = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return "step_"
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
    if prefix not in PREFIXES:
        raise CheckpointCorruptError(f"{path}: unknown step naming {prefix!r} (known: "
                                     f"{', '.join(map(repr, PREFIXES))})")
    return prefix


def name_steps(root: Path, prefix: str) -> None:
    """Make the tier ``root`` (created if need be) name its step directories
    ``<prefix><N>``. Idempotent, and safe for several ranks at once; refused where ``root``
    holds step directories named otherwise."""
    if prefix not in PREFIXES:
        raise ValueError(f"step naming must be one of {sorted(PREFIXES)}, got {prefix!r}")
    root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    have = _step_prefix(root)
    if have == prefix:
        return
    if steps(root):
        raise ValueError(f"{root} holds step directories named {have}<N>; it cannot name "
                         f"them {prefix}<N>")
    tmp = root / f"{NAMING_NAME}.{new_token()}.tmp"
    tmp.write_text(prefix + "\n")
    os.replace(tmp, root / NAMING_NAME)


def make_private(directory: Path) -> None:
    """Make ``directory`` and its missing parents, each private (0700) whatever the umask:
    made with that mode, then set to it (a umask may take the owner's bits too) through a
    descriptor opened without following links. Directories that exist, or that another
    process makes meanwhile, are left as they are (:mod:`.private` checks a tier's)."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, PRIVATE_MODE)
        except FileExistsError:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, PRIVATE_MODE)
        finally:
            os.close(fd)


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_step_prefix(root)}{step}"


#: The bounds of a tier record's numbers: steps as the ranks exchange them (an int64), more ranks
#: than any job runs (few enough that listing them is quick), a ``pid_t`` (0: unknown).
MAX_STEP, MAX_RANKS, MAX_PID = (1 << 63) - 1, 1 << 20, (1 << 31) - 1


@dataclass(frozen=True)
class TierRecord:
    """Who wrote a memory-tier checkpoint: its step, the rank, the world size and the process
    (0: unknown, a record of an earlier version)."""

    step: int
    rank: int
    world_size: int
    pid: int = field(default_factory=os.getpid)

    def write(self, directory: Path) -> None:
        """Write the record into ``directory``; an error names the file (a file system full
        since the save checked its room fails here first)."""
        tmp = directory / f"{RECORD_NAME}.tmp"
        try:
            tmp.write_text(json.dumps(asdict(self)))
            os.replace(tmp, directory / RECORD_NAME)
        except OSError as exc:
            raise OSError(exc.errno, f"write failed: {exc.strerror}", str(tmp)) from exc

    @classmethod
    def read(cls, directory: Path, step: int | None = None) -> TierRecord:
        """The record of the step directory ``directory`` (of ``step``, if given); raise
        CheckpointCorruptError, naming the file, the number and its bounds, where it is
        unreadable or a number is not an integer within them."""
        path = directory / RECORD_NAME
        try:
            raw = json.loads(path.read_text(), parse_float=_Literal, parse_constant=_Literal)
            world = _bounded(raw["world_size"], "world_size", 1, MAX_RANKS, path)
            record = cls(_bounded(raw["step"], "step", 0, MAX_STEP, path),
                         _bounded(raw["rank"], "rank", 0, world - 1, path), world,
                         _bounded(raw.get("pid", 0), "pid", 0, MAX_PID, path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                RecursionError) as exc:
            raise CheckpointCorruptError(f"{path}: unreadable tier record ({exc})") from exc
        if step is not None and record.step != step:
            raise CheckpointCorruptError(f"{path}: step {record.step} where its directory is "
                                         f"step {step}'s")
        return record


class _Literal(str):
    """A JSON number no record holds (a fraction, ``1e400``, ``Infinity``, ``NaN``), as
    written."""

    def __repr__(self) -> str:
        return str(self)


def _bounded(value: object, name: str, low: int, high: int, path: Path) -> int:
    """``value`` if it is an integer from ``low`` to ``high``; else CheckpointCorruptError
    naming ``path`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CheckpointCorruptError(f"{path}: {name} {brief(value, 60)} is not an integer "
                                     f"from {low} to {high}")
    return value


def steps(root: Path) -> list[int]:
    """Steps with a directory under ``root`` (committed or not), oldest first."""
    try:
        names = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    pattern = PREFIXES[_step_prefix(root)]
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)))


def committed(directory: Path) -> bool:
    """Whether ``directory`` holds a committed checkpoint (its ``.metadata``)."""
    return (directory / METADATA_NAME).is_file()


def committed_steps(root: Path) -> list[int]:
    return [s for s in steps(root) if committed(step_dir(root, s))]


def check_complete(directory: Path) -> None:
    """Raise CheckpointCorruptError unless ``directory``'s metadata reads and every file it
    names is there and long enough (checksums are checked as the load reads); any error a
    damaged ``.metadata`` raises (:data:`DAMAGE_ERRORS`) is one, naming the directory."""
    try:
        _check_complete(directory)
    except (CheckpointError, OSError):
        raise
    except DAMAGE_ERRORS as exc:
        raise CheckpointCorruptError(
            f"{directory}: its .metadata is damaged ({type(exc).__name__}: {exc})") from exc


def _check_complete(directory: Path) -> None:
    metadata = read_metadata(directory)
    _check_settled(directory, metadata)
    check_locations(directory, metadata)
    ends: dict[str, int] = {}
    for loc in metadata.storage_data.values():
        ends[loc.file] = max(ends.get(loc.file, 0), loc.offset + loc.length)
    for name, end in ends.items():
        try:
            size = os.stat(directory / name, follow_symlinks=False).st_size
        except OSError as exc:
            raise CheckpointCorruptError(f"{directory}: data file {name} is missing") from exc
        if size < end:
            raise CheckpointCorruptError(
                f"{directory}/{name}: {size} bytes where .metadata needs {end}")


def _save_id(metadata: Metadata) -> str:
    meta = metadata.storage_meta
    return str(meta.save_id) if meta is not None and meta.save_id is not None else ""


def _check_settled(directory: Path, metadata: Metadata) -> None:
    """Raise CheckpointError where a save of this step again left ``metadata`` here without
    every rank having committed it (:data:`REPLACING_NAME`)."""
    try:
        replaced = (directory / REPLACING_NAME).read_text()
    except FileNotFoundError:
        return
    if replaced != _save_id(metadata):
        raise CheckpointError(
            f"{directory}: a save of this step again (save {_save_id(metadata)}) was not "
            f"committed on every rank ({REPLACING_NAME} names the copy it replaced, save "
            f"{replaced or 'none'}), so this copy is not part of a checkpoint")


def mark_replacing(directory: Path) -> None:
    """A save of the step ``directory`` again starts: mark the copy it replaces (none where
    the step is not committed), unless an earlier such save left a mark (it still names the
    copy every rank had)."""
    path = directory / REPLACING_NAME
    if path.exists():
        return
    try:
        replaced = _save_id(read_metadata(directory)) if committed(directory) else ""
    except DAMAGE_ERRORS:
        replaced = ""  # a damaged copy is none
    tmp = directory / f"{REPLACING_NAME}.{new_token()}.tmp"
    tmp.write_text(replaced)
    os.replace(tmp, path)


def settle_replacing(directory: Path) -> None:
    """Every rank committed the save of the step ``directory`` again: its mark goes."""
    (directory / REPLACING_NAME).unlink(missing_ok=True)


def keep_replaced(directory: Path) -> bool:
    """A save of the step ``directory`` again did not commit on every rank: keep the copy it
    replaced (the failed save's data files go, then the mark). False where the copy here is
    not that one (the new save's, or none): the caller drops the step."""
    try:
        replaced = (directory / REPLACING_NAME).read_text()
    except FileNotFoundError:
        return True  # the save wrote nothing here
    try:
        metadata = read_metadata(directory)
    except DAMAGE_ERRORS:
        return False
    if not replaced or _save_id(metadata) != replaced:
        return False
    claim = DirectoryClaim(directory)
    try:
        remove_unreferenced(directory, data_files(metadata))
    finally:
        claim.release()
    settle_replacing(directory)
    return True


def settle_killed_replacing(root: Path) -> list[int]:
    """Settle the steps of ``root`` that a save of them again left marked (a process killed
    meanwhile; the caller holds the tier's claim): each keeps the copy the save replaced
    where that copy is the one here (:func:`keep_replaced`), else it goes (no restart loads
    it). Returns the steps removed (logged)."""
    removed = []
    for s in steps(root):
        directory = step_dir(root, s)
        if (directory / REPLACING_NAME).exists() and not keep_replaced(directory):
            remove_step(directory)
            removed.append(s)
    if removed:
        log.warning("dcp_datastates: removed step(s) %s from %s: a save of them again was "
                    "killed before every rank had committed it", removed, root)
    return removed


def complete(directory: Path) -> bool:
    try:
        check_complete(directory)
    except (CheckpointError, OSError):
        return False
    return True


def uncommit(directory: Path) -> None:
    """Remove a step's ``.metadata``: from then on it is not a checkpoint."""
    (directory / METADATA_NAME).unlink(missing_ok=True)


def remove_step(directory: Path) -> None:
    """Delete a step directory: ``.metadata`` first, so a half-removed step is never taken
    for a committed one."""
    uncommit(directory)
    shutil.rmtree(directory, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host) is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_unfinished(root: Path) -> list[int]:
    """Remove the step directories of ``root`` that hold no committed checkpoint and whose
    writer is gone: its process (by the record) is not running and no save holds the
    directory's claim. Returns those steps (logged)."""
    removed = []
    for s in steps(root):
        directory = step_dir(root, s)
        if committed(directory):
            continue
        try:
            pid = TierRecord.read(directory).pid
        except CheckpointCorruptError:
            pid = 0  # killed before its record was written
        if pid and alive(pid):
            continue
        try:
            DirectoryClaim(directory).release()
        except (CheckpointError, OSError):
            continue  # a save holds it, or it cannot be claimed: left alone
        remove_step(directory)
        removed.append(s)
    if removed:
        log.info("dcp_datastates: removed unfinished step(s) %s from %s (their process is "
                 "gone)", removed, root)
    return removed


def size_of(directory: Path) -> int:
    """Bytes the files of a step directory take."""
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(directory)
                   if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0
