"""Persist: copy a memory-tier checkpoint to the durable tier and commit it there.

A persist is a copy job (:mod:`dcp_datastates._jobs.copy`) whose source is one rank's
memory-tier step: the rank's data file goes into the durable step directory through the
engine's I/O path, and its metadata is committed as a part, ``.part.<rank>`` (a directory
holding that rank's ``.metadata``). Whichever rank completes the set of parts merges them into
one ``.metadata`` under the directory's claim and commits it (the same commit as any save's),
so the durable checkpoint is an ordinary DataStates checkpoint of the whole job (it loads on
any number of ranks), and fsyncs the durable tier's directory, so that the new step's name is
durable before retention removes older steps. A persist that stops half-way leaves no
``.metadata``: the step is never taken for a checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._format.directory import DIR_MODE, DirectoryClaim, new_token
from .._format.metadata_file import read_metadata
from .._jobs.commit import commit
from .._jobs.copy import copy_checkpoint
from ..errors import CheckpointCorruptError, CheckpointError, DamagedStepError
from ._steps import check_complete, committed

if TYPE_CHECKING:
    from .._engine import Engine

log = logging.getLogger("dcp_datastates")

PART_PREFIX = ".part."
#: How long a rank waits for another rank's claim on the durable step to merge parts.
CLAIM_WAIT_S = 30.0


def persist_part(engine: Engine, source: Path, target: Path, rank: int, world_size: int) -> bool:
    """Copy ``rank``'s memory-tier checkpoint ``source`` into the durable step ``target`` of a
    job of ``world_size`` ranks, checking every checksum of it as it is copied; commit
    ``target`` if this completes its parts. Returns whether ``target`` is committed. Raises
    :class:`DamagedStepError` (naming the file and the item) where ``source`` is damaged."""
    try:
        check_complete(source)
        target.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        if committed(target):
            return True
        copy_checkpoint(engine, source, target, part=target / f"{PART_PREFIX}{rank}")
    except CheckpointCorruptError as exc:
        raise DamagedStepError(f"{source} is damaged, so it is not persisted: {exc}") from exc
    done = _commit_parts(target, world_size)
    if done:
        _sync_name(engine, target)
    return done


def _sync_name(engine: Engine, directory: Path) -> None:
    """Make ``directory``'s name in its parent durable (an fsync of the parent, through the
    engine's I/O path): a new step must survive a crash before retention removes the older
    ones, which a failure here keeps (it raises, naming the parent)."""
    parent = directory.parent
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        engine.io.fsync(fd, str(parent))
    finally:
        os.close(fd)


def _commit_parts(target: Path, world_size: int) -> bool:
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
        try:  # also deletes data files of an earlier persist of this step that died
            commit(target, merged, new_token())
        finally:  # merged, or the data files they name are gone: the parts are void
            for p in parts:
                shutil.rmtree(p, ignore_errors=True)
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

