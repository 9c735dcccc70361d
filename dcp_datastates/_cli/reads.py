"""Stored chunks read through the load job (:class:`~dcp_datastates._jobs.load.LoadJob`):
the package's one reader and one checksum path. The commands say what to read (DCP
``ReadItem``\\ s) and where to put it (a planner); the load job opens the data files, checks
their headers, reads, verifies and copies."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._engine import Engine
from .._jobs.load import LoadJob
from ..errors import CheckpointCorruptError
from .progress import Progress

#: The most bytes one read item asks for (a chunk larger than this is read in row slices).
SLICE_BYTES = 64 << 20
#: The most bytes one load job reads for a command (at least one item or tensor).
BATCH_BYTES = 128 << 20

T = TypeVar("T")


def chunk_reads(index: MetadataIndex, shape: Sequence[int], itemsize: int, block: int,
                dest_index: MetadataIndex, dest_offsets: Sequence[int],
                slice_bytes: int = SLICE_BYTES) -> list[ReadItem]:
    """Read items that read the stored tensor chunk ``index`` (of ``shape``) whole into a
    target ``dest_index`` that holds it at ``dest_offsets``, as DCP makes them: in slices of
    whole rows of at most ``slice_bytes`` (one row at least), cut where a checksum ``block``
    ends if the rows allow it, so that no block is read twice."""
    shape = list(shape)
    if not shape:
        return [_tensor_read(index, dest_index, [], [], [])]
    rows = _slice_rows(shape, math.prod(shape[1:]) * itemsize, block, slice_bytes)
    rest = [0] * (len(shape) - 1)
    reads = []
    for r0 in range(0, max(shape[0], 1), rows):
        dest = [dest_offsets[0] + r0, *dest_offsets[1:]]
        reads.append(_tensor_read(index, dest_index, dest, [r0, *rest],
                                  [min(rows, shape[0] - r0), *shape[1:]]))
    return reads


def _slice_rows(shape: list[int], row: int, block: int, slice_bytes: int) -> int:
    """Rows per slice: all of them if they fit; else a multiple of the rows that make whole
    blocks, if one fits; else as many as fit."""
    if row == 0 or shape[0] * row <= slice_bytes:
        return max(shape[0], 1)
    unit = math.lcm(row, block) // row
    if unit * row <= slice_bytes:
        return slice_bytes // (unit * row) * unit
    return max(1, slice_bytes // row)


def _tensor_read(index: MetadataIndex, dest_index: MetadataIndex, dest_offsets: list[int],
                 storage_offsets: list[int], lengths: list[int]) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, dest_index=dest_index,
                    dest_offsets=torch.Size(dest_offsets), storage_index=index,
                    storage_offsets=torch.Size(storage_offsets), lengths=torch.Size(lengths))


def bytes_read(index: MetadataIndex) -> ReadItem:
    """The read item of a stored bytes item, as DCP makes it."""
    zero = torch.Size([0])
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=zero,
                    storage_index=index, storage_offsets=zero, lengths=zero)


def batches(sized: Iterable[tuple[T, int]], limit: int) -> list[list[T]]:
    """Group things (in order, with their sizes) into runs of at most ``limit`` bytes each
    (one thing larger than ``limit`` makes a run of its own)."""
    groups: list[list[T]] = [[]]
    used = 0
    for thing, n in sized:
        if groups[-1] and used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(thing)
        used += n
    return groups


class Planner:
    """What a load job reads for: it hands out each tensor item's target (``target``) and
    counts what arrives on ``progress``; it keeps nothing."""

    def __init__(self, target: Callable[[ReadItem], torch.Tensor], progress: Progress) -> None:
        self._target = target
        self._progress = progress

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._target(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._progress.update(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._progress.update(value.getbuffer().nbytes)


def read(engine: Engine, path: Path, md: Metadata, items: list[ReadItem], planner: Planner,
         verify: bool, damaged: list[tuple[ReadItem, CheckpointCorruptError]] | None = None
         ) -> None:
    """Read ``items`` of the checkpoint at ``path`` with one load job; raise as a load does
    (with ``damaged``: put each item whose read or checksum fails there, and read on)."""
    job = LoadJob(engine, path, md, verify_checksums=verify, direct_io=False, damaged=damaged)
    job.read(LoadPlan(items), planner)
