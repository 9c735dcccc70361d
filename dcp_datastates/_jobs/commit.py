"""The commit of a checkpoint: what ends every save (and every copy of a checkpoint).

A commit makes a directory's data files durable (an fsync of the directory holding them), then
writes ``.metadata`` atomically under a name unique to the save (its token), the token stamped
in it as the save's id: from then on the directory holds a checkpoint. Where that fails, and
the directory's ``.metadata`` is not this save's (its token is not in it), the data files the
metadata names are removed (no metadata will ever name them). Once
committed, data files that no ``.metadata`` names (an earlier save's that died) are deleted; the
caller holds the directory's claim.

A *part* is the metadata of one share of a checkpoint whose data files lie in a directory that
other shares use too (each rank's share of a persisted step): it is committed the same way,
except that it deletes nothing of the other shares.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .._format.directory import fsync_dir, remove_unreferenced
from .._format.metadata_file import METADATA_NAME, write_metadata


def data_files(metadata: Metadata) -> set[str]:
    """The data files ``metadata`` names."""
    return {loc.file for loc in metadata.storage_data.values()}


def committed_by(directory: Path, token: str) -> bool:
    """Whether ``directory``'s ``.metadata`` is the save's with ``token`` (the token is in it)."""
    try:
        return token.encode() in (directory / METADATA_NAME).read_bytes()
    except OSError:
        return False


def commit(directory: Path, metadata: Metadata, token: str, *,
           data_dir: Path | None = None) -> None:
    """Commit ``metadata`` as ``directory``'s checkpoint, for the save with ``token`` (its
    ``storage_meta.save_id`` from now on).

    ``data_dir``: where the data files lie, if not in ``directory`` (a part: ``directory`` holds
    only its metadata); then no data file of other saves is deleted.
    """
    where = directory if data_dir is None else data_dir
    ours = data_files(metadata)
    meta = metadata.storage_meta
    metadata.storage_meta = (dataclasses.replace(meta, save_id=token) if meta is not None
                             else StorageMeta(checkpoint_id=str(directory), save_id=token))
    try:
        fsync_dir(where)
        write_metadata(directory, metadata, token)
    except BaseException:
        if not committed_by(directory, token):  # no .metadata names them: nothing will
            for name in ours:
                (where / name).unlink(missing_ok=True)
        raise
    if data_dir is None and remove_unreferenced(directory, ours):
        fsync_dir(directory)
