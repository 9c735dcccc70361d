"""A copy job: a committed checkpoint's data files copied into another directory, then committed.

Each data file goes through the engine's I/O path (with O_DIRECT where the target's file system
allows), straight from a mapping of the source file; meanwhile the checksum threads check every
block of every item in that mapping against ``.metadata``'s checksums (the load path's check,
:func:`~dcp_datastates._format.checksums.verify_span`), so the bytes copied are read once more from
memory, never from disk again. A file with a block that does not match is removed and the copy
fails naming the file and the item: a copy never commits bytes whose checksums fail. No checksum
covers a file's header: it is checked first, as a load checks it. The copy
is committed by the same code as any save (:mod:`.commit`): as a whole checkpoint, or as a
*part* (its metadata in a directory of its own, its data files beside other parts' in the
target), which a later commit merges with the other parts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from .._format.checksums import memory_at, verify_span
from .._format.data_file import entry_mismatch, layout_mismatch, read_file_header
from .._format.directory import DIR_MODE, fsync_dir, new_token, open_regular
from .._format.entries import stored_spec
from .._format.metadata_file import ItemLocation, read_metadata
from .._io.file_writer import DataFile, Piece
from .._memory.host_cache import map_private, unmap
from ..errors import CheckpointCorruptError
from .commit import commit, data_files

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .._engine import Engine

#: Item bytes one checksum task checks (whole blocks; small items are checked together).
VERIFY_BYTES = 64 << 20

#: An item of a data file: its index in ``.metadata`` and its location.
Item = tuple[MetadataIndex, ItemLocation]
#: Item bytes ``[b0, b1)`` of one item, to check.
_Span = tuple[str, ItemLocation, int, int]


def copy_checkpoint(engine: Engine, source: Path, target: Path, *,
                    part: Path | None = None) -> Metadata:
    """Copy the checkpoint committed in ``source`` into ``target`` (made if need be), checking
    every checksum of it as it goes, and commit it there; with ``part``, commit its metadata
    into that directory (made anew, after the copy) instead, as one part of the checkpoint
    ``target`` will hold. Returns the metadata. Raises ``CheckpointCorruptError`` naming the
    file and the item of a block that does not match (nothing of that file is left)."""
    metadata = read_metadata(source)
    items: dict[str, list[Item]] = defaultdict(list)
    for index, loc in metadata.storage_data.items():
        items[loc.file].append((index, loc))
    target.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if part is not None and part.exists():  # void first (durably): a part left committed
        shutil.rmtree(part, ignore_errors=True)  # must not name the files replaced here
        fsync_dir(target)
    for name in sorted(data_files(metadata)):
        what = f"checkpoint {source}, file {name}"
        _check_header(source / name, metadata, items[name], what)
        _copy_file(engine, source / name, target / name, items[name], what)
    if part is not None:
        part.mkdir(mode=DIR_MODE)
    commit(part or target, metadata, new_token(), data_dir=target if part else None)
    return metadata


def _copy_file(engine: Engine, source: Path, target: Path, items: list[Item],
              what: str) -> None:
    """Copy one data file through the engine's I/O backend, checking the checksums of its
    ``items`` on the way (``what``: the file, in errors); its directory entry is made durable
    by the commit."""
    target.unlink(missing_ok=True)  # what a copy that died left of this file
    with _mapped(source) as (addr, size):
        checks = _start_checks(engine, addr, size, items, what)
        file = None
        try:
            file = DataFile(target, None, engine.io, engine.arenas.bounce.pool, engine.submit)
            file.preallocate(size)
            file.write([Piece(0, addr, size)])
            _settle(checks)
        except BaseException:
            if file is not None:
                file.abort()
            _settle(checks)  # a damaged block says more than what the write then hit
            raise
        finally:
            wait(checks)  # nothing reads the mapping once it is gone
        file.finish(size)


def _check_header(path: Path, metadata: Metadata, items: list[Item], what: str) -> None:
    """Raise ``CheckpointCorruptError`` where a load would refuse the header of data file
    ``path``: not a header, an item's entry unlike ``.metadata``, entries not tiling the data."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        data_start, header = read_file_header(fd, size, what)
    finally:
        os.close(fd)
    for index, loc in items:
        where = f"{what}, item {index.fqn!r}"
        tensor = isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata)
        why = entry_mismatch(header, data_start, stored_spec(metadata, index, loc, tensor, where),
                             loc.offset)
        if why is not None:
            raise CheckpointCorruptError(f"{where}: the data file's header does not match "
                                         f".metadata: {why}")
    if (why := layout_mismatch(header, data_start, size)) is not None:
        raise CheckpointCorruptError(f"{what}: {why}")


def _start_checks(engine: Engine, addr: int, size: int, items: list[Item],
                  what: str) -> list[Future]:
    """Check the items' blocks at ``addr`` (a file of ``size`` bytes) on the checksum threads,
    ``VERIFY_BYTES`` a task."""
    tasks: list[list[_Span]] = [[]]
    load = 0
    for index, loc in items:
        fqn = index.fqn
        if loc.offset + loc.length > size:
            raise CheckpointCorruptError(
                f"{what}, item {fqn!r}: needs bytes {loc.offset}..{loc.offset + loc.length}, "
                f"the file has {size}")
        stride = max(1, VERIFY_BYTES // loc.block) * loc.block
        for b0 in range(0, max(loc.length, 1), stride):
            b1 = min(b0 + stride, loc.length)
            if load >= VERIFY_BYTES:
                tasks.append([])
                load = 0
            tasks[-1].append((fqn, loc, b0, b1))
            load += b1 - b0
    return [engine.compute(_check, addr, spans, what, background=True)
            for spans in tasks if spans]


def _check(addr: int, spans: list[_Span], what: str) -> None:
    for fqn, loc, b0, b1 in spans:
        mem = memory_at(addr + loc.offset + b0, b1 - b0) if b1 > b0 else memoryview(b"")
        verify_span([(b0, mem)], loc.checksums, loc.block, loc.length, f"{what}, item {fqn!r}")


def _settle(checks: list[Future]) -> None:
    """Wait for the checks; raise the first that failed (the others are not needed then)."""
    for f in checks:
        if (exc := f.exception()) is not None:
            for other in checks:
                other.cancel()
            raise exc


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[tuple[int, int]]:
    """(address, size) of a private mapping of ``path`` (``host_cache.map_private``: nothing
    writes it, so no page is copied), opened read-only (the source may be a file the caller
    cannot write)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            yield 0, 0
            return
        addr = map_private(fd, size, str(path))
        try:
            yield addr, size
        finally:
            unmap(addr, size)
    finally:
        os.close(fd)
