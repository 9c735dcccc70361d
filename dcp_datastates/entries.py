"""A DCP item in the files: its data file entry name, its spec as ``.metadata`` describes it,
and the checks of ``.metadata``'s item locations."""

from __future__ import annotations

import math
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .errors import CheckpointCorruptError
from .file_format import ItemSpec
from .metadata_file import ItemLocation


def entry_name(index: MetadataIndex) -> str:
    """The data file entry of a DCP item: its fqn, plus chunk offsets for a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{'_'.join(str(o) for o in index.offset)}"


def stored_spec(metadata: Metadata, index: MetadataIndex, loc: ItemLocation, tensor: bool,
                what: str) -> ItemSpec:
    """A stored item (a tensor chunk, or bytes) as ``.metadata`` describes it: its data file
    entry name, dtype, shape and bytes. Raises ``CheckpointCorruptError`` naming ``what``
    where ``.metadata`` contradicts itself."""
    name = entry_name(index)
    if not tensor:
        return ItemSpec(name, None, (loc.length,), loc.length)
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointCorruptError(f"{what}: not a tensor in .metadata")
    offset = None if index.offset is None else tuple(index.offset)
    shape = next((tuple(c.sizes) for c in md.chunks if offset is None or c.offsets == offset),
                 None)
    if shape is None:
        raise CheckpointCorruptError(f"{what}: no stored chunk at offsets {index.offset}")
    dtype = md.properties.dtype
    if math.prod(shape) * dtype.itemsize != loc.length:
        raise CheckpointCorruptError(
            f"{what}: {loc.length} bytes stored for a {dtype} chunk of shape {list(shape)}")
    return ItemSpec(name, dtype, shape, loc.length)


def check_locations(directory: Path, metadata: Metadata) -> None:
    """Reject locations that point outside the checkpoint directory or make no sense."""
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptError(f"{directory}/.metadata: storage data is not a mapping")
    for index, loc in metadata.storage_data.items():
        if not isinstance(loc, ItemLocation):
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has no DataStates location; was "
                f"this checkpoint written by another storage writer?"
            )
        name_ok = isinstance(loc.file, str) and loc.file not in ("", ".", "..") and (
            "/" not in loc.file and "\\" not in loc.file and "\0" not in loc.file
        )
        numbers_ok = all(_is_int(v) for v in (loc.offset, loc.length, loc.block)) and (
            loc.offset >= 0 and loc.length >= 0 and loc.block > 0
        )
        if not name_ok or not numbers_ok:
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has an invalid location {loc!r}"
            )
        checksums = loc.checksums
        need = max(1, -(-loc.length // loc.block))
        if (
            not isinstance(checksums, (tuple, list))
            or len(checksums) != need
            or not all(_is_int(c) for c in checksums)
        ):
            count = len(checksums) if isinstance(checksums, (tuple, list)) else type(checksums)
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has {count} checksums where its "
                f"{loc.length} bytes in blocks of {loc.block} need {need}"
            )


def _is_int(value: object) -> bool:
    return type(value) is int  # bools are not offsets or lengths
