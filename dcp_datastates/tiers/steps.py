"""Step directories of a tier: naming, listing, and what makes one committed and complete.

Each tier directory holds one sub-directory per checkpoint, ``step_<N>``. A memory-tier step
holds one rank's checkpoint (a one-process DCP checkpoint of that rank's state) and a
``.tier.json`` record (step, rank, world size) written before the save starts; it is committed
once its ``.metadata`` is. A durable step holds every rank's data files and a ``.metadata``
merged from the ranks' parts (``.part.<rank>``), committed last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointCorruptError
from ..jobs.load import check_locations
from ..metadata_file import METADATA_NAME, read_metadata

STEP_RE = re.compile(r"^step_(\d+)$")
RECORD_NAME = ".tier.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


@dataclass(frozen=True)
class TierRecord:
    """Who wrote a memory-tier checkpoint: its step, the rank and the world size."""

    step: int
    rank: int
    world_size: int

    def write(self, directory: Path) -> None:
        tmp = directory / f"{RECORD_NAME}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, directory / RECORD_NAME)

    @classmethod
    def read(cls, directory: Path) -> TierRecord:
        path = directory / RECORD_NAME
        try:
            raw = json.loads(path.read_text())
            return cls(int(raw["step"]), int(raw["rank"]), int(raw["world_size"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{path}: unreadable tier record ({exc})") from exc


def steps(root: Path) -> list[int]:
    """Steps with a directory under ``root`` (committed or not), oldest first."""
    try:
        names = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def committed(directory: Path) -> bool:
    """Whether ``directory`` holds a committed checkpoint (its ``.metadata``)."""
    return (directory / METADATA_NAME).is_file()


def committed_steps(root: Path) -> list[int]:
    return [s for s in steps(root) if committed(step_dir(root, s))]


def check_complete(directory: Path) -> None:
    """Raise CheckpointCorruptError unless ``directory``'s metadata reads and every file it
    names is there and long enough (checksums are checked as the load reads)."""
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
    except (CheckpointCorruptError, OSError):
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


def size_of(directory: Path) -> int:
    """Bytes the files of a step directory take."""
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(directory)
                   if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0
