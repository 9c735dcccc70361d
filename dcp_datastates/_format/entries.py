"""A DCP item in the files: its data file entry name, its spec as ``.metadata`` describes it,
and the checks of ``.metadata``'s items, their locations and how their chunks tile them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar, overload

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorruptError, brief
from .data_file import ItemSpec, bounded_numel
from .metadata_file import (
    METADATA_NAME,
    FileSystemWriterLocation,
    ItemLocation,
    written_by_filesystem_writer,
)

#: Largest size, offset or element count a tensor may have (torch's are 64-bit).
MAX_ELEMENTS = 2**63 - 1


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
    shape = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offset), None)
    if shape is None:
        raise CheckpointCorruptError(f"{what}: no stored chunk at offsets {index.offset}")
    dtype = md.properties.dtype
    numel = bounded_numel(shape, MAX_ELEMENTS)
    if numel is None or numel * dtype.itemsize != loc.length:
        raise CheckpointCorruptError(
            f"{what}: {loc.length} bytes stored for a {dtype} chunk of shape {list(shape)}")
    return ItemSpec(name, dtype, shape, loc.length)


#: Cells of the grid the chunks' edges cut a tensor into, beyond which an error does not
#: name the first region no chunk covers (it is found only once a load is refused).
_MAX_CELLS = 1 << 16


def tiling_problem(tmd: TensorStorageMetadata, whole: bool = True) -> str | None:
    """How a tensor's stored chunks fail to tile its shape (a DCP save's always do): one lying
    outside it, two overlapping, or (``whole``) elements no chunk covers, the first such
    region named. ``whole=False``: one rank's part of a checkpoint, whose sharded tensors hold
    that rank's chunks only. The chunks' fields are as :func:`check_locations` checks them."""
    size = tuple(tmd.size)
    boxes = []
    for c in tmd.chunks:
        off, n = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(size) or len(n) != len(size) or any(
                o < 0 or k < 0 or o + k > d for o, k, d in zip(off, n, size, strict=True)):
            return (f"chunk at {list(off)} of shape {list(n)} lies outside the tensor's shape "
                    f"{list(size)}")
        if math.prod(n):
            boxes.append((off, n))
    # sweep along the dimension the chunks split most: a chunk overlaps only the chunks that
    # start before its end there
    axis = max(range(len(size)), key=lambda i: len({o[i] for o, _ in boxes}), default=None)
    boxes.sort(key=lambda b: b[0] if axis is None else b[0][axis])
    for i, (o, n) in enumerate(boxes):
        for o2, n2 in boxes[i + 1:]:
            if axis is not None and o2[axis] >= o[axis] + n[axis]:
                break
            if all(a < b + m and b < a + k for a, k, b, m in zip(o, n, o2, n2, strict=True)):
                return f"chunks at {list(o)} and {list(o2)} overlap"
    covered, numel = sum(math.prod(n) for _, n in boxes), math.prod(size)
    if whole and covered != numel:
        region = _uncovered(size, boxes) if size else None
        return f"chunks cover {covered} of its {numel} elements" + (
            f"; elements {region} are in no stored chunk" if region else "")
    return None


def _uncovered(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
               ) -> str | None:
    """The first region (``[a:b, ...]``) of a tensor of ``size`` that no chunk of ``boxes``
    (in bounds, not overlapping) covers, or None where the chunks cut it into too many
    cells to look."""
    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + n[i] for o, n in boxes)})
            for i, d in enumerate(size)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_CELLS:
        return None
    for cell in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        if not any(all(a <= lo < a + k for (lo, _), a, k in zip(cell, o, n, strict=True))
                   for o, n in boxes):
            return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in cell) + "]"
    return None


def tiling_problems(path: Path, md: Metadata, fqns: Iterable[str], whole: bool = True
                    ) -> list[str]:
    """:func:`tiling_problem` of each tensor of ``fqns`` in ``md`` (checkpoint ``path``), as
    "<path>: item '<fqn>': <why>"."""
    problems = []
    for fqn in fqns:
        tmd = md.state_dict_metadata.get(fqn)
        if isinstance(tmd, TensorStorageMetadata) and (
                why := tiling_problem(tmd, whole)) is not None:
            problems.append(f"{path}: item {fqn!r}: {why}")
    return problems


#: A stored item as the checks know it: its fqn and its chunk's offsets (None: bytes).
_Key = tuple[str, "tuple[int, ...] | None"]


def check_locations(directory: Path, metadata: Metadata) -> None:
    """Reject a ``.metadata`` that a load could not use, before anything computes with its
    numbers: fields that are not what DCP's classes hold (the unpickler builds objects of the
    allowed classes with whatever fields the file gives), sizes and offsets beyond 64 bits, a
    stored chunk without a location or a location of no stored chunk, and locations that
    point outside the checkpoint directory or make no sense. The locations are all this
    package's, or all DCP FileSystemWriter's."""
    path = directory / METADATA_NAME
    state = _field(metadata, "state_dict_metadata", dict, path)
    storage = _field(metadata, "storage_data", dict, path)
    _field(metadata, "planner_data", (dict, type(None)), path)
    _field(metadata, "storage_meta", (StorageMeta, type(None)), path)
    expected: set[_Key] = set()
    for fqn, md in state.items():
        if type(fqn) is not str:
            raise CheckpointCorruptError(
                f"{path}: an item is named {brief(fqn, 100)}, not a string")
        if isinstance(md, TensorStorageMetadata):
            expected.update((fqn, tuple(c.offsets)) for c in _chunks(md, path, fqn))
        elif isinstance(md, BytesStorageMetadata):
            expected.add((fqn, None))
        else:
            raise CheckpointCorruptError(
                f"{path}: item {fqn!r} is a {type(md).__name__}, not a tensor or bytes item")
    check = _check_dcp_location if written_by_filesystem_writer(metadata) else _check_location
    for index, loc in storage.items():
        check(path, _key(path, index), loc, expected)
    if len(storage) < len(expected):  # each location is of one stored item, its own
        missing = expected.difference(_key(path, index) for index in storage)
        fqn, offsets = min(missing, key=lambda k: (k[0], k[1] or ()))
        at = "" if offsets is None else f" (chunk at {list(offsets)})"
        raise CheckpointCorruptError(f"{path}: item {fqn!r}{at} has no location: "
                                     f"{len(missing)} stored chunk(s) have none")


def _key(path: Path, index: object) -> _Key:
    """The stored item a location's key names."""
    fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
    hint = getattr(index, "index", None)
    if not isinstance(index, MetadataIndex) or type(fqn) is not str or not (
            offset is None or isinstance(offset, tuple)) or not (
            hint is None or type(hint) is int):
        raise CheckpointCorruptError(f"{path}: a location's key is {brief(index)}, not an item")
    return fqn, None if offset is None else tuple(offset)


def _chunks(md: TensorStorageMetadata, path: Path, fqn: str) -> list[ChunkStorageMetadata]:
    """Tensor ``fqn``'s stored chunks, its properties, size and chunks checked."""
    what = f"item {fqn!r}"
    properties = _field(md, "properties", TensorProperties, path, what)
    _field(properties, "dtype", torch.dtype, path, f"{what}, properties")
    size = _sizes(_field(md, "size", tuple, path, what), None, path, what, "size")
    chunks = _field(md, "chunks", list, path, what)
    for k, c in enumerate(chunks):
        where = f"{what}, chunk {k}"
        if not isinstance(c, ChunkStorageMetadata):
            raise CheckpointCorruptError(f"{path}: {where} is a {type(c).__name__}, not a "
                                         f"ChunkStorageMetadata")
        _sizes(_field(c, "offsets", tuple, path, where), len(size), path, where, "offsets")
        _sizes(_field(c, "sizes", tuple, path, where), len(size), path, where, "sizes")
    return chunks


def _sizes(values: tuple, ndim: int | None, path: Path, what: str, name: str) -> tuple:
    """Field ``name`` of ``what``: ``ndim`` (if given) ints of 0..``MAX_ELEMENTS``, and, for
    sizes, their product too."""
    if ndim is not None and len(values) != ndim:
        raise CheckpointCorruptError(f"{path}: {what}: its {name} {brief(values)} have "
                                     f"{len(values)} dimension(s) where the tensor has {ndim}")
    if values and not (set(map(type, values)) == {int} and min(values) >= 0
                       and max(values) <= MAX_ELEMENTS):  # bools are not sizes
        raise CheckpointCorruptError(f"{path}: {what}: its {name} {brief(values)} are not all "
                                     f"integers of 0..{MAX_ELEMENTS}")
    if name != "offsets" and bounded_numel(values, MAX_ELEMENTS) is None:
        raise CheckpointCorruptError(f"{path}: {what}: its {name} {brief(values)} make more "
                                     f"than {MAX_ELEMENTS} elements")
    return values


_T = TypeVar("_T")


@overload
def _field(obj: object, name: str, kind: type[_T], path: Path, what: str = "") -> _T: ...
@overload
def _field(obj: object, name: str, kind: tuple[type, ...], path: Path,
           what: str = "") -> object: ...
def _field(obj: object, name: str, kind: type | tuple[type, ...], path: Path,
           what: str = "") -> object:
    """``obj.name``, which must be a ``kind`` (``what``: how errors name ``obj``)."""
    at = f"{path}: {what}: " if what else f"{path}: "
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise CheckpointCorruptError(f"{at}no field {name!r}")
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        want = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise CheckpointCorruptError(f"{at}{name} is a {type(value).__name__}, not {want}")
    return value


_MISSING = object()
_KIND_NAMES = {dict: "a mapping", tuple: "a tuple", list: "a list", type(None): "None",
               torch.dtype: "a torch.dtype"}


def _check_held(path: Path, key: _Key, expected: set[_Key]) -> str:
    """Reject a location of no stored item (``key``); return the item's fqn."""
    fqn, offsets = key
    if key not in expected:
        at = "" if offsets is None else f" at offsets {brief(offsets)}"
        raise CheckpointCorruptError(f"{path}: a location names item {fqn!r}{at}, which the "
                                     f"metadata does not hold")
    return fqn


def _file_name_ok(file: object) -> bool:
    """Whether a location's ``file`` names a file in the checkpoint directory itself."""
    return isinstance(file, str) and file not in ("", ".", "..") and (
        "/" not in file and "\\" not in file and "\0" not in file)


def _span_ok(offset: object, length: object) -> bool:
    """Whether a location's ``offset`` and ``length`` are integers of 0..``MAX_ELEMENTS``."""
    return (type(offset) is int and type(length) is int  # bools are not offsets or lengths
            and 0 <= offset <= MAX_ELEMENTS and 0 <= length <= MAX_ELEMENTS)


def _check_dcp_location(path: Path, key: _Key, loc: object, expected: set[_Key]) -> None:
    """Reject a DCP FileSystemWriter location of no stored item (``key``), or one that makes
    no sense."""
    fqn = _check_held(path, key, expected)
    if not isinstance(loc, FileSystemWriterLocation):
        raise CheckpointCorruptError(
            f"{path}: item {fqn!r} is a {type(loc).__name__} where the other locations are DCP "
            f"FileSystemWriter's")
    file, offset = getattr(loc, "relative_path", None), getattr(loc, "offset", None)
    length = getattr(loc, "length", None)
    transforms = getattr(loc, "transform_descriptors", None)
    if not _file_name_ok(file) or not _span_ok(offset, length) or not (
            transforms is None or isinstance(transforms, (list, tuple))
            and all(type(t) is str for t in transforms)):
        raise CheckpointCorruptError(
            f"{path}: item {fqn!r} has an invalid location (file {brief(file, 100)}, offset "
            f"{brief(offset)}, length {brief(length)}, transforms {brief(transforms, 100)})")


def _check_location(path: Path, key: _Key, loc: object, expected: set[_Key]) -> None:
    """Reject a location of no stored item (``key``), or one that makes no sense."""
    fqn = _check_held(path, key, expected)
    if not isinstance(loc, ItemLocation):
        raise CheckpointCorruptError(
            f"{path}: item {fqn!r} has no DataStates location; was this checkpoint written by "
            f"another storage writer?"
        )
    file, offset = getattr(loc, "file", None), getattr(loc, "offset", None)
    length, block = getattr(loc, "length", None), getattr(loc, "block", None)
    name_ok = _file_name_ok(file)
    numbers_ok = _span_ok(offset, length) and type(block) is int and 0 < block <= MAX_ELEMENTS
    if not name_ok or not numbers_ok:
        raise CheckpointCorruptError(
            f"{path}: item {fqn!r} has an invalid location (file {brief(file, 100)}, "
            f"offset {brief(offset)}, length {brief(length)}, block {brief(block)})")
    checksums = getattr(loc, "checksums", None)
    assert isinstance(length, int) and isinstance(block, int)  # numbers_ok checked them
    need = max(1, -(-length // block))
    if (
        not isinstance(checksums, (tuple, list))
        or len(checksums) != need
        or set(map(type, checksums)) != {int}
    ):
        count = len(checksums) if isinstance(checksums, (tuple, list)) else type(checksums)
        raise CheckpointCorruptError(
            f"{path}: item {fqn!r} has {count} checksums where its {length} bytes in blocks "
            f"of {block} need {need}"
        )
