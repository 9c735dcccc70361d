"""torchtitan: its ``CheckpointManager`` saving and loading through dcp_datastates.

torchtitan (0.3.x, ``torchtitan/components/checkpointer/dcp.py``) sends every DCP call of its
``CheckpointManager`` through two methods, ``dcp_save`` and ``dcp_load``. This module replaces
those two on a manager, plus ``_maybe_wait_for_staging`` (which the trainer calls right before
``optimizers.step()``) and ``_close``. Two ways to use it:

* on a manager that already exists (e.g. ``trainer.checkpointer``, before ``trainer.train()``)::

      from dcp_datastates.integrations.torchtitan import enable_datastates
      enable_datastates(trainer.checkpointer, host_cache_size="16GiB")

* in a torchtitan Python config, in place of ``CheckpointManager.Config``::

      from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager
      checkpoint=DataStatesCheckpointManager.Config(
          interval=500, async_mode="async", host_cache_size="16GiB")

What each ``checkpoint.async_mode`` does then:

* ``"disabled"``: ``dcp.save`` with the writer (blocking, as before; flushed through io_uring).
* ``"async"`` and ``"async_with_pinned_mem"``: ``dcp.async_save`` (thread mode) with the writer
  on the manager's gloo group. ``save()`` returns as soon as the snapshot has started; the
  snapshot copies into the writer's host cache while the next forward and backward run, and
  ``maybe_wait_for_staging()`` (called by torchtitan's trainer just before the optimizer step)
  waits for it. The write to storage goes on in the background; the next save waits for it as
  torchtitan always does. The two modes behave the same: the host cache is already pinned on
  GPU hosts, so no process-based upload or separate pinned stager is needed.
* Hugging Face exports and imports (``last_save_in_hf``, ``initial_load_in_hf``) keep
  torchtitan's own code.
* Loading: a checkpoint written by DataStatesWriter is read with DataStatesReader; any other
  (an older checkpoint of the same run written by stock torchtitan, a seed checkpoint) with
  DCP's default reader, so a running job can switch.

Limits: checkpoint folders must be on a POSIX file system (local or shared), not an fsspec URL.
State that forward or backward change in place (e.g. BatchNorm running statistics) would be
copied mid-change by an overlapped snapshot: pass ``overlap=False`` for such models, which
waits for the snapshot inside ``save()``.
"""

from __future__ import annotations

import gc
import logging
import os
import types
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..reader import DataStatesReader
from ..writer import DATA_FILE_RE, DataStatesWriter

log = logging.getLogger("dcp_datastates")

#: torchtitan's key of the model in ``CheckpointManager.states``.
MODEL = "model"

__all__ = ["DataStatesCheckpointManager", "enable_datastates", "is_datastates_checkpoint"]


@dataclass
class _Hooks:
    """What ``enable_datastates`` attaches to a manager (as ``manager._datastates``)."""

    writer: DataStatesWriter
    reader_kwargs: dict[str, Any]
    overlap: bool
    dcp_save: Callable[..., Any]
    dcp_load: Callable[..., Any]
    wait_for_staging: Callable[[], None]
    close: Callable[[], None]
    reader: DataStatesReader | None = None
    staging: Future | None = None


def is_datastates_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` holds DataStatesWriter's data files."""
    try:
        return any(DATA_FILE_RE.match(name) for name in os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return False


def enable_datastates(
    manager: Any,
    *,
    host_cache_size: int | str = "4GiB",
    io_backend: str = "auto",
    io_workers: int = 8,
    direct_io: bool | None = None,
    overwrite: bool = True,
    verify_checksums: bool = True,
    restore_cache_size: int | str = "1GiB",
    overlap: bool = True,
) -> DataStatesWriter | None:
    """Route a torchtitan ``CheckpointManager``'s saves and loads through dcp_datastates.

    Call it on every rank, once, before the first save or load. Returns the writer (its
    ``last_stats()`` gives the latest save's figures), or None for a disabled manager.

    Args:
        manager: a torchtitan ``CheckpointManager`` (``trainer.checkpointer``).
        host_cache_size: host memory per rank for snapshots, allocated once in ``/dev/shm``:
            about this rank's shard of model and optimizer state, plus headroom.
        io_backend, io_workers, direct_io: as for :class:`~dcp_datastates.DataStatesWriter`.
        overwrite: replace a step folder that already holds a checkpoint, as torchtitan's own
            writer does (the old one stays loadable until the new ``.metadata`` is committed).
        verify_checksums: check every byte read on load against the stored checksums.
        restore_cache_size: pinned host memory GPU restores read through.
        overlap: let the snapshot run during the next forward and backward (torchtitan's
            trainer waits before the optimizer step); False waits for it inside ``save()``.
    """
    if not getattr(manager, "enable", False):
        return None
    hooks: _Hooks | None = getattr(manager, "_datastates", None)
    if hooks is not None:
        return hooks.writer
    if "://" in str(manager.folder):
        raise ValueError(
            f"dcp_datastates writes to POSIX paths; checkpoint folder {manager.folder!r} is a URL"
        )
    writer = DataStatesWriter(
        host_cache_size=host_cache_size, io_backend=io_backend, overwrite=overwrite,
        direct_io=direct_io, io_workers=io_workers,
    )
    manager._datastates = _Hooks(
        writer=writer,
        reader_kwargs={"io_backend": io_backend, "io_workers": io_workers,
                       "verify_checksums": verify_checksums, "host_cache_size": restore_cache_size},
        overlap=overlap,
        dcp_save=manager.dcp_save,
        dcp_load=manager.dcp_load,
        wait_for_staging=manager._maybe_wait_for_staging,
        close=manager._close,
    )
    # The manager makes a DCP DefaultStager for "async_with_pinned_mem" unless it has one; the
    # writer stages itself, and the manager's close() then closes it.
    manager.stager = writer
    manager.dcp_save = types.MethodType(_dcp_save, manager)
    manager.dcp_load = types.MethodType(_dcp_load, manager)
    manager._maybe_wait_for_staging = types.MethodType(_maybe_wait_for_staging, manager)
    manager._close = types.MethodType(_close, manager)
    log.info("dcp_datastates: torchtitan checkpoints in %s go through DataStatesWriter "
             "(host cache %s, async_mode %s)", manager.folder, host_cache_size,
             getattr(manager.async_mode, "value", manager.async_mode))
    return writer


def _mode(async_mode: object) -> str:
    return str(getattr(async_mode, "value", async_mode))


def _dcp_save(self: Any, state_dict: dict[str, Any], checkpoint_id: str, async_mode: object,
              enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
    hooks: _Hooks = self._datastates
    if to_hf:
        return hooks.dcp_save(state_dict, checkpoint_id=checkpoint_id, async_mode=async_mode,
                              enable_garbage_collection=enable_garbage_collection, to_hf=True)
    mode = _mode(async_mode)
    if mode == "disabled":
        dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=hooks.writer)
        result = None
    else:
        response = dcp.async_save(
            state_dict, checkpoint_id=checkpoint_id, storage_writer=hooks.writer,
            process_group=self.pg, async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        hooks.staging = response.staging_completion
        if not hooks.overlap:
            response.staging_completion.result()
        # torchtitan expects a Future for "async" and an AsyncSaveResponse for the pinned mode
        result = response.upload_completion if mode == "async" else response
    if enable_garbage_collection:
        gc.collect(1)
    return result


def _dcp_load(self: Any, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
              from_quantized: bool) -> None:
    hooks: _Hooks = self._datastates
    if from_hf or not is_datastates_checkpoint(checkpoint_id):
        return hooks.dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf,
                              from_quantized=from_quantized)
    if hooks.reader is None:
        hooks.reader = DataStatesReader(**hooks.reader_kwargs)
    dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=hooks.reader)
    # as torchtitan does: the model's entries are flattened into state_dict
    if MODEL in self.states:
        self.states[MODEL].load_state_dict(state_dict)
    return None


def _maybe_wait_for_staging(self: Any) -> None:
    hooks: _Hooks = self._datastates
    staging, hooks.staging = hooks.staging, None
    if staging is not None:
        staging.result()
    hooks.wait_for_staging()


def _close(self: Any) -> None:
    hooks: _Hooks = self._datastates
    try:
        if getattr(self, "save_future", None) is not None:
            self.save_future.result()  # a save still uploading needs the writer
    finally:
        hooks.close()
        hooks.writer.close()


try:
    from torchtitan.components.checkpoint import CheckpointManager as _CheckpointManager
except ImportError:  # torchtitan is not installed: enable_datastates still works
    _CheckpointManager = None

if _CheckpointManager is not None:

    class DataStatesCheckpointManager(_CheckpointManager):
        """torchtitan's ``CheckpointManager`` with :func:`enable_datastates` applied."""

        @dataclass(kw_only=True, slots=True)
        class Config(_CheckpointManager.Config):
            host_cache_size: str = "4GiB"
            """Host memory per rank for snapshots (in /dev/shm): about this rank's shard of
            model and optimizer state, plus headroom."""

            io_backend: str = "auto"
            """"auto" (io_uring where usable, else threads), "uring" or "threads"."""

            io_workers: int = 8
            """Flush threads per rank, each with I/O requests in flight."""

            verify_checksums: bool = True
            """Check every byte read on load against the stored checksums."""

            restore_cache_size: str = "1GiB"
            """Pinned host memory that GPU restores read through."""

            overlap: bool = True
            """Let snapshots overlap the next forward/backward (False: wait inside save)."""

        def __init__(self, config: Config, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            enable_datastates(
                self, host_cache_size=config.host_cache_size, io_backend=config.io_backend,
                io_workers=config.io_workers, verify_checksums=config.verify_checksums,
                restore_cache_size=config.restore_cache_size, overlap=config.overlap,
            )

else:

    def __getattr__(name: str) -> Any:
        if name == "DataStatesCheckpointManager":
            raise ImportError(
                "DataStatesCheckpointManager needs torchtitan (pip install torchtitan); "
                "enable_datastates works on any manager with the same methods"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
