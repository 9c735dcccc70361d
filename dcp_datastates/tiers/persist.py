"""Persist: copy memory-tier checkpoints to the durable tier and commit them there.

Each rank copies its own memory-tier checkpoint into the durable step directory (its data file
goes through the engine's I/O path, straight from a mapping of the memory file, with O_DIRECT
where the file system allows), then leaves its metadata there as a part: ``.part.<rank>``, a
directory holding that rank's ``.metadata`` (written and read like any ``.metadata``).
Whichever rank completes the set of parts merges them into one ``.metadata`` under the
directory's claim and commits it atomically, so the durable checkpoint is an ordinary
DataStates checkpoint of the whole job (it loads on any number of ranks). A persist that stops
half-way leaves no ``.metadata``: the step is never taken for a checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..directory import DirectoryClaim, fsync_dir, new_token, remove_unreferenced
from ..errors import CheckpointError
from ..file_writer import DataFile, Piece
from ..host_cache import _MAP_FAILED, _libc
from ..metadata_file import read_metadata, write_metadata
from .steps import TierRecord, check_complete, committed, committed_steps, step_dir

log = logging.getLogger("dcp_datastates")

PART_PREFIX = ".part."
#: How long a rank waits for another rank's claim on the durable step to merge parts.
CLAIM_WAIT_S = 30.0


def persist_part(engine: object, source: Path, target: Path) -> bool:
    """Copy this rank's memory-tier checkpoint ``source`` into the durable step ``target``;
    commit ``target`` if this completes its parts. Returns whether ``target`` is committed."""
    check_complete(source)
    record = TierRecord.read(source)
    metadata = read_metadata(source)
    target.mkdir(parents=True, exist_ok=True)
    if committed(target):
        return True
    for name in sorted({loc.file for loc in metadata.storage_data.values()}):
        copy_file(engine, source / name, target / name)
    fsync_dir(target)
    part = target / f"{PART_PREFIX}{record.rank}"
    shutil.rmtree(part, ignore_errors=True)  # what a persist that died left of this rank's part
    part.mkdir()
    write_metadata(part, metadata, new_token())
    fsync_dir(target)
    return commit_parts(target, record.world_size)


def copy_file(engine: object, source: Path, target: Path) -> None:
    """Copy one data file through the engine's I/O backend; durable when this returns."""
    target.unlink(missing_ok=True)  # what a persist that died left of this rank's file
    with _mapped(source) as (addr, size):
        file = DataFile(target, None, engine.io, engine.bounce.pool, engine.submit)
        try:
            file.preallocate(size)
            file.write([Piece(0, addr, size)])
        except BaseException:
            file.abort()
            raise
        file.finish(size)


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[tuple[int, int]]:
    """(address, size) of a read-only shared mapping of ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            yield 0, 0
            return
        populate = getattr(mmap, "MAP_POPULATE", 0)  # one fault pass, not a fault per page
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | populate, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(f"cannot map {path}")
        try:
            yield addr, size
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def commit_parts(target: Path, world_size: int) -> bool:
    """Merge and commit ``target``'s parts if all ``world_size`` are there (under the
    directory's claim, so one rank does it). Returns whether ``target`` is committed."""
    claim = _claim(target)
    try:
        if committed(target):
            return True
        parts = [target / f"{PART_PREFIX}{r}" for r in range(world_size)]
        if not all(committed(p) for p in parts):
            return False
        merged = merge([read_metadata(p) for p in parts], target)
        write_metadata(target, merged, new_token())
        for p in parts:
            shutil.rmtree(p, ignore_errors=True)
        # data files of an earlier persist of this step that died (another save's): garbage
        remove_unreferenced(target, {loc.file for loc in merged.storage_data.values()})
        fsync_dir(target)
        return True
    finally:
        claim.release()


def _claim(directory: Path) -> DirectoryClaim:
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        try:
            return DirectoryClaim(directory)
        except CheckpointError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def merge(parts: list[Metadata], directory: Path) -> Metadata:
    """One job-wide metadata from the ranks' one-process metadata: each tensor's chunks are
    united; an item several ranks hold (a replicated one) is taken from the lowest rank."""
    state: dict = {}
    storage: dict = {}
    planner: dict = {}
    for part in parts:
        for fqn, md in part.state_dict_metadata.items():
            have = state.get(fqn)
            if have is None:
                state[fqn] = md if not isinstance(md, TensorStorageMetadata) else (
                    TensorStorageMetadata(md.properties, md.size, list(md.chunks)))
            elif isinstance(have, TensorStorageMetadata):
                if not isinstance(md, TensorStorageMetadata) or md.size != have.size:
                    raise CheckpointError(
                        f"{directory}: ranks disagree on item {fqn!r}: "
                        f"{_shape(have)} vs {_shape(md)}")
                known = {tuple(c.offsets) for c in have.chunks}
                have.chunks += [c for c in md.chunks if tuple(c.offsets) not in known]
        for index, loc in part.storage_data.items():
            storage.setdefault(index, loc)
        if isinstance(part.planner_data, dict):
            for key, value in part.planner_data.items():
                planner.setdefault(key, value)
    first = parts[0]
    meta = first.storage_meta
    if meta is not None:
        meta.checkpoint_id = str(directory)
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                    storage_meta=meta, version=first.version)


def _shape(md: object) -> str:
    return f"tensor {list(md.size)}" if isinstance(md, TensorStorageMetadata) else "bytes"


def parts_of(target: Path) -> list[int]:
    """Ranks whose part ``target`` holds (an uncommitted persist)."""
    try:
        names = os.listdir(target)
    except FileNotFoundError:
        return []
    return sorted(int(n[len(PART_PREFIX):]) for n in names
                  if n.startswith(PART_PREFIX) and n[len(PART_PREFIX):].isdigit())



def persist_leftover(engine: object, memory: Path, durable: Path,
                     step: int | None = None) -> tuple[int, bool] | None:
    """Persist ``step`` (default: the newest committed in ``memory``, if ``durable`` has no
    newer committed step) from one rank's memory tier. Returns (step, whether the durable step
    is committed now: False until every rank's part is there), or None if nothing is due."""
    held = committed_steps(memory)
    if step is None:
        newest = committed_steps(durable)
        if not held or (newest and newest[-1] >= held[-1]):
            return None
        step = held[-1]
    elif step not in held:
        raise CheckpointError(f"{memory} holds no committed checkpoint of step {step}")
    return step, persist_part(engine, step_dir(memory, step), step_dir(durable, step))
