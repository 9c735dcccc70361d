"""``DataStatesReader``: DCP's StorageReader, handing each load to a job on the engine."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ._arguments import checked_keywords
from ._dcp_frames import LOAD_STEP, dcp_locals
from ._engine import Engine, default_engine
from ._format.directory import checkpoint_path, is_url
from ._format.entries import check_locations, tiling_problems
from ._format.metadata_file import (
    METADATA_NAME,
    metadata_stamp,
    read_metadata,
    written_by_filesystem_writer,
)
from ._jobs.load import LoadJob
from ._mismatch import check_state_matches, planner_of
from ._stats import LoadStats, log
from .errors import CheckpointCorruptError

__all__ = ["DataStatesReader"]


class DataStatesReader(StorageReader):
    """Loads DCP checkpoints written by :class:`DataStatesWriter`, resharding included.

    Make one per load, as DCP does: it holds no memory; reads go through the engine's I/O
    backend and its pinned bounce buffers (for GPU targets).

    A checkpoint of DCP's own ``FileSystemWriter`` (``.distcp`` data files) loads too: its
    ``.metadata`` is read by this package's restricted unpickler (no pickled code runs), and
    the reads go to DCP's ``FileSystemReader``, which loads each tensor with
    ``torch.load(weights_only=True)``; there are no checksums to verify. As for this package's
    checkpoints, non-tensor items are unpickled by DCP's planner (``torch.load``): load only
    checkpoints you trust.

    A checkpoint whose stored chunks of a tensor do not tile its shape (a chunk outside it, two
    overlapping, elements no chunk holds) is refused as its ``.metadata`` is read, as
    ``verify`` refuses it: a load would leave part of the target as it was.

    Args:
        path: checkpoint directory; may instead be given as ``checkpoint_id`` to ``dcp.load``.
        engine: the :class:`~dcp_datastates.Engine` to use (default: the process's engine).
        verify_checksums: check every byte read against the checksums in ``.metadata``.
        direct_io: read GPU restores with O_DIRECT (straight from the disk into pinned memory)
            where the file system allows it.
        rank_part: the checkpoint is one rank's own (a ``CheckpointManager`` memory-tier step),
            whose sharded tensors hold that rank's chunks only: elements no chunk holds are
            not refused.
    """

    @checked_keywords
    def __init__(self, path: str | os.PathLike | None = None, *, engine: Engine | None = None,
                 verify_checksums: bool = True, direct_io: bool = True,
                 rank_part: bool = False) -> None:
        super().__init__()
        self.path = checkpoint_path(path) if path is not None else None
        self.verify_checksums = verify_checksums
        self.direct_io = direct_io
        self.rank_part = rank_part
        self._engine = engine
        self.load_id = str(uuid.uuid4())
        self.metadata: Metadata | None = None
        self._metadata: Metadata | None = None  # read by reset(), handed out once
        self._stats: LoadStats | None = None
        self._stamp: tuple | None = None  # the .metadata read
        self._dcp_reader: FileSystemReader | None = None  # reads a FileSystemWriter checkpoint

    @property
    def engine(self) -> Engine:
        return self._engine if self._engine is not None else default_engine()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point at ``checkpoint_id`` and read its ``.metadata`` now.

        Reading here, rather than only in ``read_metadata``, lets a missing or damaged
        checkpoint raise its own clear error: some torch versions replace errors from
        ``read_metadata`` with "metadata is None".
        """
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self._metadata = self._read_checked() if checkpoint_id is not None else None

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = self._metadata or self._read_checked()
        self._metadata = None
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object,
                              **kwargs: object) -> None:
        """Keep ``metadata``; where DCP's default planner holds the state dict (it is set up
        just before), check that the state fits the checkpoint, so that a state dict of
        another model fails naming the items that differ rather than the first one alone."""
        self.metadata = metadata
        load_step = dcp_locals(LOAD_STEP)
        planner = planner_of(load_step["planner"] if load_step is not None else None)
        if planner is not None:
            check_state_matches(planner.state_dict, metadata, self.path,
                                strict=not planner.allow_partial_load)
        self._dcp_reader = None
        if written_by_filesystem_writer(metadata):
            self._dcp_reader = FileSystemReader(self._checkpoint_dir())
            self._dcp_reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            if is_coordinator:
                log.info("dcp_datastates: %s is a DCP FileSystemWriter checkpoint: reading it "
                         "with DCP's FileSystemReader (tensors by torch.load(weights_only=True), "
                         "no checksums to verify)", self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        if self.metadata is None:
            raise RuntimeError("DataStatesReader: read_data came before set_up_storage_reader")
        if self._dcp_reader is not None:
            return self._read_filesystem_writer(plan, planner)
        job = LoadJob(self.engine, self._checkpoint_dir(), self.metadata, self.verify_checksums,
                      self.direct_io, self._stamp)
        self._stats = job.read(plan, planner)
        self._stats.log()
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_filesystem_writer(self, plan: LoadPlan, planner: LoadPlanner
                                ) -> torch.futures.Future[None]:
        """Read ``plan`` of a FileSystemWriter checkpoint with DCP's reader; the figures count
        the stored bytes of the items read."""
        assert self._dcp_reader is not None and self.metadata is not None
        stats = LoadStats("FileSystemReader", verified=False)
        start = time.perf_counter()
        future = self._dcp_reader.read_data(plan, planner)
        future.wait()
        stats.seconds = time.perf_counter() - start
        stats.bytes_read = sum(self.metadata.storage_data[item.storage_index].length
                               for item in plan.items)
        self._stats = stats
        stats.log()
        return future

    def last_stats(self) -> LoadStats | None:
        """Figures of the latest load on this rank (bytes, seconds, GiB/s, backend)."""
        return self._stats

    @property
    def checkpoint_id(self) -> Path | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if is_url(checkpoint_id):
            return False
        return (checkpoint_path(checkpoint_id) / METADATA_NAME).is_file()

    def _read_checked(self) -> Metadata:
        directory = self._checkpoint_dir()
        self._stamp = metadata_stamp(directory)
        metadata = read_metadata(directory, filesystem_writer=True)
        check_locations(directory, metadata)
        self._check_tiling(directory, metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_tiling(self, directory: Path, metadata: Metadata) -> None:
        """Refuse a checkpoint whose stored chunks do not tile a tensor (as ``verify`` does):
        a load would leave part of its target as it was."""
        problems = tiling_problems(directory, metadata, metadata.state_dict_metadata,
                                   whole=not self.rank_part)
        if problems:
            raise CheckpointCorruptError("\n  ".join([*problems, (
                "(a checkpoint meant to hold one rank's shards only, saved with no_dist=True, "
                "loads them with DataStatesReader(rank_part=True))")]))

    def _checkpoint_dir(self) -> Path:
        if self.path is None:
            raise ValueError(
                "no checkpoint directory: pass path= to DataStatesReader or checkpoint_id= to "
                "dcp.load"
            )
        return self.path
