"""The checkpoint's `.metadata`: written last and atomically, read without running pickles.

The file is a pickle of DCP's ``Metadata`` followed by a seal: a magic and the XXH3-64 of
everything before the digest, so that any damage to the file is seen before it is unpickled.
``pickle.load`` stops where the pickle ends, so other readers ignore the seal. Files written
before the seal existed have none; they are read as they are. The ``.metadata`` of DCP's own
FileSystemWriter (a plain pickle whose locations are its ``_StorageInfo``) is read by the same
restricted unpickler, where the caller allows it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import NoReturn

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .._dcp_frames import READ_METADATA, dcp_locals
from ..errors import CheckpointCorruptError, CheckpointError, brief
from .directory import fsync_dir, open_regular, write_new

METADATA_NAME = ".metadata"


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item's bytes live: ``length`` bytes at ``offset`` of ``file``.

    ``checksums`` holds the XXH3-64 of each ``block``-byte block of those bytes.
    """

    file: str
    offset: int
    length: int
    checksums: tuple[int, ...]
    block: int


#: DCP FileSystemWriter's location of an item (file, offset, length) in its ``.metadata``.
FileSystemWriterLocation = _StorageInfo

_SAFE_GLOBALS = [
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    _MEM_FORMAT_ENCODING,
    ItemLocation,
    torch.Size,
]


WRONG_READER = (
    "this checkpoint was written by dcp_datastates.DataStatesWriter; DCP's default "
    "FileSystemReader cannot read it: load it with dcp.load(state, checkpoint_id=..., "
    "storage_reader=dcp_datastates.DataStatesReader())"
)


def written_by_datastates(metadata: Metadata) -> Metadata:
    """What a plain ``pickle.load`` of our ``.metadata`` calls (``_Sealed``), so that DCP's
    default FileSystemReader fails saying to use DataStatesReader; ``read_metadata`` returns
    ``metadata`` instead. Checkpoints name this function by :data:`ON_DISK_MODULE` and its
    name.

    A plain unpickling raises CheckpointError. Called from another StorageReader's
    ``read_metadata``, whose errors some torch versions only log (then fail with a bare
    "metadata is None"), it returns a stand-in that raises that error at its first use,
    outside DCP's ``try``: on every torch version the load fails saying what to do."""
    if dcp_locals(READ_METADATA) is not None:
        return _WrongReader()
    raise CheckpointError(WRONG_READER)


class _WrongReader(Metadata):
    """The metadata another reader gets from our ``.metadata``: every item access raises."""

    def __init__(self) -> None:
        pass  # storage_meta and version keep their class defaults; the reader may set them

    # a read-only property over Metadata's field, deliberately: the reader must not get items
    @property
    def state_dict_metadata(self) -> NoReturn:  # type: ignore[override]
        raise CheckpointError(WRONG_READER)

    storage_data = planner_data = state_dict_metadata

    def __repr__(self) -> str:
        return f"<{WRONG_READER}>"


class _Sealed:
    """Pickles as ``written_by_datastates(metadata)``."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def __reduce__(self) -> tuple[object, tuple[Metadata]]:
        return written_by_datastates, (self.metadata,)


def _unseal(metadata: Metadata) -> Metadata:
    return metadata


#: How many fields this torch pickles for a ``TensorProperties`` (5 up to torch 2.14; 2.15
#: appended ``strides``).
_PROPERTIES_FIELDS = len(TensorProperties().__getstate__())


class _NewerTensorProperties(TensorProperties):
    """Unpickles a ``TensorProperties`` that a newer torch wrote with fields appended (torch
    2.15's ``strides``, which no load here uses): they are dropped, so a checkpoint saved with
    a newer torch loads with this one. The object becomes a plain ``TensorProperties``."""

    def __setstate__(self, state: tuple) -> None:
        plain: TensorProperties = self
        plain.__class__ = TensorProperties
        self.__setstate__(tuple(state)[:_PROPERTIES_FIELDS])


def _path_string(*parts: str) -> str:
    """A pickled ``PosixPath`` (FileSystemWriter's ``storage_meta.checkpoint_id``) as a string,
    as this package's own metadata holds it."""
    if not all(type(part) is str for part in parts):
        raise pickle.UnpicklingError(f"a path of {brief(parts, 100)}, not of strings")
    return str(PurePosixPath(*parts))


#: Where a checkpoint's ``.metadata`` names ``written_by_datastates`` and ``ItemLocation``:
#: the file format's path (``dcp_datastates/format/metadata_file.py``), the same for every
#: checkpoint written, wherever this module lives
ON_DISK_MODULE = "dcp_datastates.format.metadata_file"
ItemLocation.__module__ = written_by_datastates.__module__ = ON_DISK_MODULE

_ALLOWED = {(c.__module__, c.__qualname__): c for c in _SAFE_GLOBALS} | {
    (_StorageInfo.__module__, _StorageInfo.__qualname__): _StorageInfo,
    ("pathlib", "PosixPath"): _path_string,
    ("pathlib._local", "PosixPath"): _path_string,  # pickled by Python 3.13 and later
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    (written_by_datastates.__module__, written_by_datastates.__qualname__): _unseal,
    (TensorProperties.__module__, TensorProperties.__qualname__): _NewerTensorProperties,
}


#: The enum classes whose members the metadata may name with ``builtins.getattr``.
_ENUMS = frozenset(c for c in _SAFE_GLOBALS if isinstance(c, type) and issubclass(c, enum.Enum))


def _enum_member(cls: object, name: object) -> enum.Enum:
    """``builtins.getattr`` as the metadata may use it: how CPython 3.11.0-3.11.2 pickle an
    enum member (``getattr(cls, name)``). Only a member, by its name, of an allowed enum."""
    member = None
    if isinstance(cls, type) and cls in _ENUMS and type(name) is str:
        member = cls.__members__.get(name)
    if member is None:
        what = cls.__qualname__ if isinstance(cls, type) else type(cls).__qualname__
        raise pickle.UnpicklingError(
            f"WeightsUnpickler error: builtins.getattr({what}, {brief(name, 100)}) is not allowed "
            f"in checkpoint metadata (only a member of an allowed enum, by its name)")
    return member


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and sizes, and nothing else."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        allowed = _ALLOWED.get((module, name))
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None),
                                                                torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            raise pickle.UnpicklingError(
                f"WeightsUnpickler error: {module}.{name} is not allowed in checkpoint metadata")
        return allowed


#: The seal after the pickle: a magic, then the XXH3-64 of the pickle and the magic.
_SEAL_MAGIC = b"DS-XXH3:"
_DIGEST = struct.Struct("<Q")


def sealed(data: bytes) -> bytes:
    """The bytes of ``.metadata`` for the pickle ``data``: ``data`` and its seal."""
    head = data + _SEAL_MAGIC
    return head + _DIGEST.pack(xxhash.xxh3_64_intdigest(head))


def _unsealed(data: bytes, path: Path) -> bytes:
    """The pickle in ``.metadata``'s bytes ``data``, its seal checked (a file without one, from
    before seals, is returned whole)."""
    cut = len(data) - _DIGEST.size
    if cut < len(_SEAL_MAGIC) or data[cut - len(_SEAL_MAGIC):cut] != _SEAL_MAGIC:
        return data
    (digest,) = _DIGEST.unpack(data[cut:])
    if xxhash.xxh3_64_intdigest(data[:cut]) != digest:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch: the file is damaged (its XXH3-64 seal does not match "
            f"its {len(data)} bytes)")
    return data[:cut - len(_SEAL_MAGIC)]


def write_metadata(directory: Path, metadata: Metadata, token: str,
                   fsync: Callable[[int], None] = os.fsync) -> None:
    """Write ``directory/.metadata`` atomically: a temp name unique to the save (``token``),
    fsync, rename, fsync the directory (``fsync`` syncs a descriptor; tests inject faults).

    Where only the last fsync fails, the new checkpoint is in place: the ``OSError`` says so."""
    if metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id is not None:
        metadata.storage_meta.checkpoint_id = str(metadata.storage_meta.checkpoint_id)
    data = pickle.dumps(_Sealed(metadata), protocol=pickle.HIGHEST_PROTOCOL)
    final = directory / METADATA_NAME
    tmp = directory / f"{METADATA_NAME}.tmp.{token}"
    write_new(tmp, final, [sealed(data)], fsync)
    try:
        fsync_dir(directory, fsync)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"{directory}: the new checkpoint is committed ({METADATA_NAME} is in place and "
            f"loads; it replaced any earlier one there), but syncing the directory failed "
            f"({exc.strerror}): a crash of the machine before the file system writes it back "
            f"may lose it") from exc


def _no_metadata(directory: Path) -> OSError:
    """Why ``directory`` has no ``.metadata``: it does not exist, it is a file, it holds a DCP
    checkpoint of per-rank metadata, or it holds no committed checkpoint."""
    if not directory.is_dir() and os.path.lexists(directory):
        return NotADirectoryError(f"{directory} is a file, not a checkpoint directory")
    if os.path.lexists(rank_local := directory / f"__0{METADATA_NAME}"):
        return FileNotFoundError(
            f"{directory} holds a DCP checkpoint of per-rank metadata ({rank_local.name}: "
            f"dcp.save(use_collectives=False)) and no {METADATA_NAME}, which DataStatesReader "
            f"reads: load it with torch.distributed.checkpoint.FileSystemReader")
    why = ("the directory does not exist" if not os.path.lexists(directory)
           else "an unfinished or failed save leaves none")
    return FileNotFoundError(
        f"{directory} is not a checkpoint: {METADATA_NAME} is missing ({why})")


def written_by_filesystem_writer(metadata: Metadata) -> bool:
    """Whether ``metadata`` is of a checkpoint of DCP's FileSystemWriter (its locations are)."""
    storage = getattr(metadata, "storage_data", None)
    return isinstance(storage, dict) and any(
        isinstance(loc, FileSystemWriterLocation) for loc in storage.values())


def read_metadata(directory: Path, *, filesystem_writer: bool = False) -> Metadata:
    """Load ``directory/.metadata``, allowing only DCP's metadata classes (no arbitrary pickle).

    A checkpoint of DCP's FileSystemWriter is refused, saying so, unless ``filesystem_writer``.
    """
    path = directory / METADATA_NAME
    try:
        fd = open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        raise _no_metadata(directory) from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{path} {exc.strerror}") from None
    try:
        with open(fd, "rb") as f:
            data = f.read()
        if data[:2] == b"PK":  # written by torch.save (dcp_datastates 0.1.0)
            with torch.serialization.safe_globals([*_SAFE_GLOBALS]):
                metadata = torch.load(io.BytesIO(data), weights_only=True)
        else:
            metadata = _unpickle(_unsealed(data, path))
    except CheckpointCorruptError:
        raise
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), first)
        raise CheckpointCorruptError(
            f"{path}: cannot read checkpoint metadata ({why or type(exc).__name__}). It is read "
            f"without running pickled code, allowing only DCP's metadata classes: was this "
            f"checkpoint written by another storage writer, or is the file damaged?"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    if not filesystem_writer and written_by_filesystem_writer(metadata):
        raise CheckpointError(filesystem_writer_refused(directory))
    return metadata


def filesystem_writer_refused(
        directory: Path, why: str = "only a DataStatesWriter checkpoint serves here") -> str:
    """The error of a DCP FileSystemWriter checkpoint where a DataStatesWriter one is needed
    (``why``: what needs it)."""
    return (f"{directory} is a DCP FileSystemWriter checkpoint (dcp.save without a "
            f"storage_writer), not a DataStatesWriter one: {why}. DataStatesReader loads it "
            f"(dcp.load(state, checkpoint_id=..., storage_reader=DataStatesReader())), through "
            f"DCP's FileSystemReader")


def _unpickle(data: bytes) -> object:
    """The object pickled in ``data``, which must end where the pickle does."""
    stream = io.BytesIO(data)
    obj = _MetadataUnpickler(stream).load()
    if stream.tell() != len(data):
        raise pickle.UnpicklingError(f"{len(data) - stream.tell()} bytes after the pickle's end")
    return obj


def metadata_stamp(directory: Path) -> tuple[int, int, int] | None:
    """Identity of ``directory/.metadata`` (inode, mtime, size): a commit replaces the file."""
    try:
        st = os.stat(directory / METADATA_NAME)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
