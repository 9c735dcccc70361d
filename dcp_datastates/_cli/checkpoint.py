"""A checkpoint as the commands see it: ``.metadata``, its stored chunks by item, and whether
a data file is usable. A checkpoint of DCP's own FileSystemWriter is read too; the commands
that need this package's files refuse it."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .._format.data_file import ItemSpec
from .._format.directory import open_regular
from .._format.entries import check_locations, stored_spec
from .._format.metadata_file import (
    FileSystemWriterLocation,
    ItemLocation,
    filesystem_writer_refused,
    read_metadata,
    written_by_filesystem_writer,
)
from ..errors import CheckpointError


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of an item: its DCP index and its location."""

    index: MetadataIndex
    loc: ItemLocation  # a FileSystemWriterLocation in a DCP FileSystemWriter checkpoint

    @property
    def fqn(self) -> str:
        return self.index.fqn

    @property
    def file(self) -> str:
        """The data file that holds the chunk (either writer's)."""
        if isinstance(self.loc, FileSystemWriterLocation):
            return self.loc.relative_path
        return self.loc.file

    @property
    def offsets(self) -> tuple[int, ...] | None:
        """The chunk's offsets in the full tensor (None for bytes items)."""
        return None if self.index.offset is None else tuple(self.index.offset)


def load_checkpoint(path: Path, refuse_filesystem_writer: str | None = None
                    ) -> tuple[Metadata, dict[str, list[Chunk]]]:
    """The checkpoint's metadata (its locations checked) and its stored chunks by fqn. A DCP
    FileSystemWriter checkpoint is refused where ``refuse_filesystem_writer`` says why."""
    md = read_metadata(path, filesystem_writer=True)
    if refuse_filesystem_writer is not None and written_by_filesystem_writer(md):
        raise CheckpointError(filesystem_writer_refused(path, refuse_filesystem_writer))
    check_locations(path, md)
    chunks: dict[str, list[Chunk]] = defaultdict(list)
    for index, loc in md.storage_data.items():
        chunks[index.fqn].append(Chunk(index, loc))
    return md, chunks


def where(c: Chunk) -> str:
    """"file F, item 'fqn' (chunk at [..])": how the commands name a stored chunk."""
    at = "" if c.offsets is None else f" (chunk at {list(c.offsets)})"
    return f"file {c.loc.file}, item {c.fqn!r}{at}"


def chunk_spec(path: Path, md: Metadata, c: Chunk) -> ItemSpec:
    """The chunk as ``.metadata`` describes it (raises where ``.metadata`` contradicts itself)."""
    tensor = isinstance(md.state_dict_metadata.get(c.fqn), TensorStorageMetadata)
    return stored_spec(md, c.index, c.loc, tensor, f"{path}: {where(c)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def file_size(f: Path) -> tuple[int | None, str | None]:
    """(size, None) of a usable data file, else (None, what is wrong with it)."""
    try:
        fd = open_regular(f)
    except OSError as exc:
        return None, exc.strerror
    try:
        return os.fstat(fd).st_size, None
    finally:
        os.close(fd)
