"""The checkpoint's `.metadata`: written last and atomically, read without running pickles."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import torch
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

from .directory import fsync_dir
from .errors import CheckpointCorruptError

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


_ALLOWED = {(c.__module__, c.__qualname__): c for c in _SAFE_GLOBALS} | {
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and sizes, and nothing else."""

    def find_class(self, module: str, name: str) -> object:
        allowed = _ALLOWED.get((module, name))
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None),
                                                                torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            raise pickle.UnpicklingError(
                f"WeightsUnpickler error: {module}.{name} is not allowed in checkpoint metadata")
        return allowed


def write_metadata(directory: Path, metadata: Metadata, token: str) -> None:
    """Write ``directory/.metadata`` atomically: a temp name unique to the save (``token``),
    fsync, rename, fsync the directory."""
    if metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id is not None:
        metadata.storage_meta.checkpoint_id = str(metadata.storage_meta.checkpoint_id)
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    final = directory / METADATA_NAME
    tmp = directory / f"{METADATA_NAME}.tmp.{token}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def read_metadata(directory: Path) -> Metadata:
    """Load ``directory/.metadata``, allowing only DCP's metadata classes (no arbitrary pickle)."""
    path = directory / METADATA_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a checkpoint: {METADATA_NAME} is missing (an unfinished or "
            f"failed save leaves none)"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"PK":  # written by torch.save (dcp_datastates 0.1.0)
                with torch.serialization.safe_globals(_SAFE_GLOBALS):
                    metadata = torch.load(f, weights_only=True)
            else:
                metadata = _MetadataUnpickler(f).load()
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), first)
        raise CheckpointCorruptError(
            f"{path}: cannot read checkpoint metadata ({why or type(exc).__name__}). It is read "
            f"without running pickled code, allowing only DCP's metadata classes: was this "
            f"checkpoint written by another storage writer (e.g. FileSystemWriter), or is the "
            f"file damaged?"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


def metadata_stamp(directory: Path) -> tuple[int, int, int] | None:
    """Identity of ``directory/.metadata`` (inode, mtime, size): a commit replaces the file."""
    try:
        st = os.stat(directory / METADATA_NAME)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
