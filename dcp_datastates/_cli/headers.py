"""What ``verify`` finds in a data file before reading its items' bytes: its safetensors
header against ``.metadata`` (each item's dtype, shape and data offsets, entries ``.metadata``
does not list, the file's size) and items lying past its end. A load refuses the same."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from .._format.data_file import (
    PAD_PREFIX,
    ItemSpec,
    entry_key,
    entry_mismatch,
    layout_mismatch,
    read_file_header,
)
from .._format.directory import open_regular
from .._format.entries import entry_name
from ..errors import CheckpointCorruptError
from .checkpoint import Chunk, chunk_spec, where


@dataclass
class FileCheck:
    """A data file's problems, and its chunks that a load would read (the rest are named in
    ``problems``, or the file is refused whole)."""

    problems: list[str]
    readable: list[tuple[Chunk, ItemSpec]]  # each with its spec


def check_file(path: Path, md: Metadata, name: str, chunks: list[Chunk]) -> FileCheck:
    """Check data file ``name`` of the checkpoint at ``path``, where ``chunks`` live."""
    try:
        fd = open_regular(path / name)
    except OSError as exc:
        return FileCheck([f"file {name} {exc.strerror} ({len(chunks)} stored chunks live there)"],
                         [])
    try:
        size = os.fstat(fd).st_size
        try:
            header, whole = read_file_header(fd, size, f"file {name}"), None
        except CheckpointCorruptError as exc:
            header, whole = None, str(exc)
    finally:
        os.close(fd)
    problems, readable = [], []
    for c in chunks:
        spec_or_why = _chunk_problem(path, md, c, header, size)
        if isinstance(spec_or_why, str):
            problems.append(spec_or_why)
        else:
            readable.append((c, spec_or_why))
    if header is not None:
        problems += _unlisted(name, header[1], chunks)
        if (why := layout_mismatch(header[1], header[0], size)) is not None:
            whole = f"file {name}: {why}"
    if whole is not None:
        return _refused(name, [whole, *problems], readable)
    return FileCheck(problems, readable)


def _chunk_problem(path: Path, md: Metadata, c: Chunk, header: tuple[int, dict] | None,
                   size: int) -> ItemSpec | str:
    """Why a load would refuse chunk ``c`` of a file of ``size`` bytes, whose header is
    (data start, entries), or None where it is unreadable; else the chunk's spec."""
    try:
        spec = chunk_spec(path, md, c)
    except CheckpointCorruptError as exc:  # .metadata contradicts itself
        return str(exc)
    if header is not None and (why := entry_mismatch(header[1], header[0], spec,
                                                     c.loc.offset)) is not None:
        return f"{where(c)}: header does not match .metadata: {why}"
    end = c.loc.offset + c.loc.length
    if end > size:
        return f"{where(c)}: truncated: needs file bytes {c.loc.offset}..{end}, the file has {size}"
    return spec


def _unlisted(name: str, header: dict[str, object], chunks: list[Chunk]) -> list[str]:
    """Header entries of file ``name`` that no chunk of ``.metadata`` there explains."""
    known = {entry_key(entry_name(c.index)) for c in chunks}
    return [f"file {name}: the header has an entry {key!r} that .metadata does not list"
            for key in header if key != "__metadata__" and key not in known
            and not key.startswith(PAD_PREFIX)]


def _refused(name: str, problems: list[str], unread: list) -> FileCheck:
    """A file a load refuses whole: none of its chunks is read, which ``problems`` says for
    those (``unread``) that had no problem of their own."""
    if unread:
        problems.append(f"file {name}: the bytes of {len(unread)} stored chunk(s) there were "
                        f"not read: a load refuses this file")
    return FileCheck(problems, [])
