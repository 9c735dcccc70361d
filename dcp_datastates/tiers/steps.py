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

from ..errors import CheckpointCorruptError, CheckpointError, brief
from ..format.directory import DirectoryClaim, new_token
from ..format.entries import check_locations
from ..format.metadata_file import METADATA_NAME, read_metadata

STEP_RE = re.compile(r"^step_(\d+)$")
RECORD_NAME = ".tier.json"
#: The file in a tier's directory that names its step directories (absent: ``step_<N>``).
NAMING_NAME = ".dcp_datastates-steps"
#: The prefixes a tier may name its step directories with: ours, torchtitan's.
PREFIXES = {"step_": STEP_RE, "step-": re.compile(r"^step-(\d+)$")}
#: The mode of the directories of a memory tier, and of the tier: the user's alone.
PRIVATE_MODE = 0o700

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
    root.mkdir(parents=True, exist_ok=True)
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
        tmp = directory / f"{RECORD_NAME}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, directory / RECORD_NAME)

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
