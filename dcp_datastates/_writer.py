"""``DataStatesWriter``: DCP's StorageWriter and AsyncStager, handing each save to a job."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ._arguments import checked_keywords
from ._engine import Engine, default_engine
from ._format.directory import check_direct_io, checkpoint_path, is_url
from ._jobs.groups import Began, began_for
from ._jobs.ordering import CALLS
from ._jobs.save import SaveJob, new_save_job
from ._jobs.staged import StagedSaves
from ._stats import SaveStats

__all__ = ["DataStatesWriter"]


def _ends_job_on_error(method: Callable) -> Callable:
    """A storage step that fails ends its save: what the save holds is released at once. A
    save whose process group is gone fails at its next step."""
    call = CALLS.index(method.__name__)

    @functools.wraps(method)
    def wrapper(self: DataStatesWriter, *args: object, **kwargs: object) -> object:
        job = self._current(call)
        try:
            job.check_group()
            return method(self, job, *args, **kwargs)
        except BaseException as exc:
            job.end(exc)
            self._running.pop(threading.get_ident(), None)
            raise

    return wrapper


class DataStatesWriter(StorageWriter, AsyncStager):
    """Saves DCP checkpoints: one safetensors data file per rank, then ``.metadata``.

    Make one per save, as DCP does (``storage_writer=DataStatesWriter()``): it holds no memory
    and costs nothing; the host cache, streams and I/O live in the engine. As an AsyncStager it
    snapshots the state on the engine's staging thread, so ``dcp.async_save`` returns at once
    and its ``staging_completion`` tells when training may change the state again. A save
    staged by another stager began, for this writer, when it was made (``_jobs/groups.py``).

    Args:
        path: checkpoint directory; may instead be given as ``checkpoint_id`` to ``dcp.save``.
        engine: the :class:`~dcp_datastates.Engine` to use (default: the process's engine).
        overwrite: replace a checkpoint already in the directory (the old one stays intact
            until the new ``.metadata`` is committed).
        direct_io: O_DIRECT for data files: None uses it where the file system allows and it
            helps (not on tmpfs), True requires it (checked here, or when the path is known),
            False never uses it.
    """

    _synchronize_after_execute = False

    @checked_keywords
    def __init__(self, path: str | os.PathLike | None = None, *, engine: Engine | None = None,
                 overwrite: bool = False, direct_io: bool | None = None) -> None:
        super().__init__()
        self.path = checkpoint_path(path) if path is not None else None
        self.overwrite = overwrite
        self.direct_io = direct_io
        self._engine = engine
        self._staged = StagedSaves()
        self._running: dict[int, SaveJob] = {}  # thread ident -> its save
        self._last: SaveJob | None = None
        self._made: Began | None = Began.here()  # a save it did not stage began then, or later
        if direct_io and self.path is not None:
            check_direct_io(self.path)

    @property
    def engine(self) -> Engine:
        return self._engine if self._engine is not None else default_engine()

    # -- DCP's PROCESS checkpointer sends the writer to its own process -------------------------
    def __getstate__(self) -> dict:
        job = self._staged.take()  # DCP pickled the snapshot just before: a copy of it
        if job is not None:
            job.hand_off()
        state = self.__dict__.copy()
        state.update(_engine=None, _staged=None, _running={}, _last=None, _made=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _staged=StagedSaves())

    # -- AsyncStager ----------------------------------------------------------------------------
    def stage(self, state_dict: dict) -> Future:
        """Start snapshotting ``state_dict``; the Future gives the staged copy."""
        job = self._last = new_save_job(self.engine)
        self._staged.add(job)
        return job.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Wait for the latest snapshot's copies (DCP's older protocol)."""
        self.wait_for_staging()

    def wait_for_staging(self) -> None:
        """Block until the latest snapshot is staged (at once if none is pending).

        A failed snapshot does not raise here: its error reaches the save's future.
        """
        if self._last is not None:
            self._last.staging.wait()

    def staging_done(self) -> bool:
        """Whether the latest snapshot is staged (True where none was)."""
        return self._last is None or self._last.staging.is_set()

    def staging_ordered(self) -> bool:
        """Whether the latest snapshot's staging is ordered (:meth:`order_after_staging` returns
        at once): its copies over, or queued on the GPU (True where none was staged)."""
        return self._last is None or self._last.staging.ordered()

    def order_after_staging(self) -> None:
        """Hold the work the calling thread queues next until the latest snapshot is staged:
        on the GPU where its copies were queued there (see
        :meth:`Engine.order_after_staging`)."""
        if self._last is not None:
            self._last.order_after(self.engine.cuda)

    def close(self) -> None:
        """Discard snapshots this writer staged that no save has taken (their cache memory is
        freed); saves in progress are not affected."""
        self._staged.discard()

    # -- StorageWriter --------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a save: take the staged job it belongs to (or a new one), wait for its turn;
        refuse one whose process group is gone, before DCP's first collective of it."""
        job = self._staged.take()
        if job is None:  # a plain save: no snapshot, nothing for the training to wait for
            job = self._last = new_save_job(self.engine)
            job.staging.set()
            job.began = began_for(self._made)
        self._running[threading.get_ident()] = job
        try:
            if checkpoint_id is not None:
                self.path = checkpoint_path(checkpoint_id)
            job.run_here()
            job.directory = self._checkpoint_dir()
            if self.direct_io:
                check_direct_io(job.directory)
            job.order.wait_turn(job)
            job.check_group()
        except BaseException as exc:
            job.end(exc)
            raise

    @_ends_job_on_error
    def set_up_storage_writer(self, job: SaveJob, is_coordinator: bool, *args: object,
                              **kwargs: object) -> None:
        job.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta:
        job = self._running.get(threading.get_ident())
        if job is None:
            return StorageMeta(checkpoint_id=str(self.path))
        return StorageMeta(checkpoint_id=str(job.directory), save_id=job.token)

    @_ends_job_on_error
    def prepare_local_plan(self, job: SaveJob, plan: SavePlan) -> SavePlan:
        job.prepare(self.overwrite)
        return plan

    @_ends_job_on_error
    def prepare_global_plan(self, job: SaveJob, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    @_ends_job_on_error
    def write_data(self, job: SaveJob, plan: SavePlan,
                   planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(job.flush(plan, planner, self.direct_io))
        if not job.is_coordinator:
            self._running.pop(threading.get_ident(), None)
        return future

    @_ends_job_on_error
    def finish(self, job: SaveJob, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job.commit(metadata, results, self.storage_meta())
        self._running.pop(threading.get_ident(), None)

    def last_stats(self) -> SaveStats | None:
        """Figures of this writer's latest save on this rank (bytes, times, backend)."""
        return self._last.stats if self._last is not None else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and not is_url(checkpoint_id)

    # -- internals ------------------------------------------------------------------------------
    def _current(self, call: int) -> SaveJob:
        """This thread's save, running DCP call ``call`` (an index in ``CALLS``). DCP calls
        ``reset`` only when given a ``checkpoint_id``, so a call of a new save may come first:
        the last one is then over (``_jobs/ordering.py`` says when)."""
        job = self._running.get(threading.get_ident())
        if job is None or job.ended or job.tie.abandoned() or not job.tie.follows(call):
            self.reset()
            job = self._running[threading.get_ident()]
            job.tie.follows(call)
        return job

    def _checkpoint_dir(self) -> Path:
        if self.path is None:
            raise ValueError(
                "no checkpoint directory: pass path= to DataStatesWriter or checkpoint_id= to "
                "dcp.save / dcp.async_save"
            )
        return self.path
