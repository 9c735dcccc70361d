"""A copy job: a committed checkpoint's data files copied into another directory, then committed.

Each data file goes through the engine's I/O path (with O_DIRECT where the target's file system
allows), straight from a mapping of the source file; the copy is committed by
the same code as any save (:mod:`.commit`): as a whole checkpoint, or as a *part* (its metadata
in a directory of its own, its data files beside other parts' in the target), which a later
commit merges with the other parts.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..directory import fsync_dir, new_token
from ..file_writer import DataFile, Piece
from ..metadata_file import read_metadata
from .commit import commit, data_files

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..engine import Engine


def copy_checkpoint(engine: Engine, source: Path, target: Path, *,
                    part: Path | None = None) -> Metadata:
    """Copy the checkpoint committed in ``source`` into ``target`` (made if need be) and commit
    it there; with ``part``, commit its metadata into that directory (made anew, after the copy)
    instead, as one part of the checkpoint ``target`` will hold. Returns the metadata."""
    metadata = read_metadata(source)
    target.mkdir(parents=True, exist_ok=True)
    if part is not None and part.exists():  # void first (durably): a part left committed
        shutil.rmtree(part, ignore_errors=True)  # must not name the files replaced here
        fsync_dir(target)
    for name in sorted(data_files(metadata)):
        copy_file(engine, source / name, target / name)
    if part is not None:
        part.mkdir()
    commit(part or target, metadata, new_token(), data_dir=target if part else None)
    return metadata


def copy_file(engine: Engine, source: Path, target: Path) -> None:
    """Copy one data file through the engine's I/O backend (its directory entry is made
    durable by the commit)."""
    target.unlink(missing_ok=True)  # what a copy that died left of this file
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
    """(address, size) of a mapping of ``path``, opened read-only (the source may be a file
    the caller cannot write). The mapping is private and writable only so that ctypes gives
    its address; nothing writes it, so no page is copied (and it is not populated up front,
    which would copy every page of a private writable mapping)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            yield 0, 0
            return
        with mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
            first = ctypes.c_char.from_buffer(mapping)
            try:
                yield ctypes.addressof(first), size
            finally:
                del first  # its hold on the mapping ends here, so the mapping can close
    finally:
        os.close(fd)
