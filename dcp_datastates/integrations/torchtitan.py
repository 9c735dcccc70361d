"""torchtitan: its ``CheckpointManager`` saving and loading through dcp_datastates.

torchtitan (0.3.x, ``torchtitan/components/checkpointer/dcp.py``) sends every DCP call of its
``CheckpointManager`` through two public methods, ``dcp_save`` and ``dcp_load``. This module
provides them; nothing private of torchtitan is replaced. Two ways to use it:

* in a torchtitan Python config, in place of ``CheckpointManager.Config``::

      from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager
      checkpoint=DataStatesCheckpointManager.Config(
          interval=500, async_mode="async", host_cache_size="16GiB")

  a subclass overriding ``dcp_save`` and ``dcp_load``;

* on a manager that already exists (e.g. ``trainer.checkpointer``, before ``trainer.train()``)::

      from dcp_datastates.integrations.torchtitan import enable_datastates
      enable_datastates(trainer.checkpointer)

  which sets the manager's ``dcp_save`` and ``dcp_load`` to the same two methods.

Either way each save gets a fresh :class:`~dcp_datastates.DataStatesWriter` (and each load a
:class:`~dcp_datastates.DataStatesReader`) on an :class:`~dcp_datastates.Engine`: the process's
default engine, one passed in (``engine=``), or, where the config sets ``host_cache_size``,
``io_backend`` or ``io_workers``, an engine of the manager's own, closed with the manager.

What each ``checkpoint.async_mode`` does then:

* ``"disabled"``: ``dcp.save`` with the writer (blocking, as before; flushed through io_uring).
* ``"async"`` and ``"async_with_pinned_mem"``: ``dcp.async_save`` (thread mode) with the writer
  on the manager's gloo group. ``save()`` returns as soon as the snapshot has started; the
  snapshot copies into the engine's host cache while the next forward and backward run. The
  optimizer step waits for it: a step pre-hook on the manager's optimizers
  (:func:`dcp_datastates.guard`), and in ``"async_with_pinned_mem"`` also torchtitan's own
  ``maybe_wait_for_staging()``, which waits on the staging future returned to it. The write to
  storage goes on in the background; the next save waits for it as torchtitan always does. The
  host cache is already pinned on GPU hosts, so no process-based upload or separate pinned
  stager is needed.
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

import logging
import os
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.utils.hooks import RemovableHandle

from ..directory import DATA_FILE_RE
from ..engine import Engine, default_engine
from ..guard import guard
from ..reader import DataStatesReader
from ..stats import SaveStats
from ..writer import DataStatesWriter

log = logging.getLogger("dcp_datastates")

#: torchtitan's keys of the model and the optimizers in ``CheckpointManager.states``.
MODEL, OPTIMIZER = "model", "optimizer"

__all__ = ["DataStates", "DataStatesCheckpointManager", "enable_datastates",
           "is_datastates_checkpoint"]


def is_datastates_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` holds DataStatesWriter's data files."""
    try:
        return any(DATA_FILE_RE.match(name) for name in os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return False


@dataclass(eq=False)
class DataStates:
    """What a manager saves and loads with (``manager.datastates``).

    ``engine`` serves every save and load; ``staging`` and ``upload`` are the latest async
    save's futures (its snapshot copied; its checkpoint committed); ``last_stats()`` gives the
    latest save's figures. ``close()`` (called when the manager closes: torchtitan closes its
    ``stager``, which this object stands in for) waits for the save in flight, takes the
    optimizer hook off and closes an engine the manager owns.
    """

    engine: Engine
    owns_engine: bool = False
    overwrite: bool = True
    direct_io: bool | None = None
    verify_checksums: bool = True
    overlap: bool = True
    staging: Future | None = None
    upload: Future | None = None
    last_writer: DataStatesWriter | None = None
    _hook: RemovableHandle | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def writer(self) -> DataStatesWriter:
        """A fresh writer for one save (DCP's idiom: it holds no memory)."""
        self.last_writer = DataStatesWriter(engine=self.engine, overwrite=self.overwrite,
                                            direct_io=self.direct_io)
        return self.last_writer

    def reader(self) -> DataStatesReader:
        """A fresh reader for one load."""
        return DataStatesReader(engine=self.engine, verify_checksums=self.verify_checksums)

    def last_stats(self) -> SaveStats | None:
        """Figures of the latest save on this rank (None before the first)."""
        return self.last_writer.last_stats() if self.last_writer is not None else None

    def guard(self, optimizers: Any) -> None:
        """Make ``optimizers.step()`` wait for the snapshots staged so far (once)."""
        if self._hook is None and optimizers is not None:
            self._hook = guard(optimizers, self.engine)

    def close(self) -> None:
        """Wait for the save in flight (raising its error), take the optimizer hook off, and
        close the engine if the manager owns it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            hook, self._hook = self._hook, None
            upload, self.upload = self.upload, None
        try:
            if upload is not None:
                upload.result()
        finally:
            if hook is not None:
                hook.remove()
            if self.owns_engine:
                self.engine.close()


def _mode(async_mode: object) -> str:
    return str(getattr(async_mode, "value", async_mode))


def _datastates_save(manager: Any, stock_save: Callable[..., Any], state_dict: dict[str, Any],
                     checkpoint_id: str, async_mode: object,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
    """``CheckpointManager.dcp_save`` through a fresh DataStatesWriter."""
    ds: DataStates = manager.datastates
    if to_hf:
        return stock_save(state_dict, checkpoint_id=checkpoint_id, async_mode=async_mode,
                          enable_garbage_collection=enable_garbage_collection, to_hf=True)
    mode = _mode(async_mode)
    if mode == "disabled":
        dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=ds.writer())
        result = None
    else:
        response = dcp.async_save(
            state_dict, checkpoint_id=checkpoint_id, storage_writer=ds.writer(),
            process_group=manager.pg, async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        ds.staging, ds.upload = response.staging_completion, response.upload_completion
        if not ds.overlap:
            response.staging_completion.result()
        # torchtitan expects a Future for "async" and an AsyncSaveResponse for the pinned mode
        # (whose staging future its maybe_wait_for_staging() then waits on)
        result = response.upload_completion if mode == "async" else response
    if enable_garbage_collection:  # torchtitan's own option: do what its checkpointer does
        from torchtitan.tools.utils import GarbageCollection

        GarbageCollection.collect("GC collection invoked by checkpointer.")
    return result


def _datastates_load(manager: Any, stock_load: Callable[..., Any], state_dict: dict[str, Any],
                     checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
    """``CheckpointManager.dcp_load`` through a fresh DataStatesReader (DataStates checkpoints;
    others go to torchtitan's own code)."""
    if from_hf or not is_datastates_checkpoint(checkpoint_id):
        return stock_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf,
                          from_quantized=from_quantized)
    dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=manager.datastates.reader())
    # as torchtitan does: the model's entries are flattened into state_dict
    if MODEL in manager.states:
        manager.states[MODEL].load_state_dict(state_dict)
    return None


def _attach(manager: Any, ds: DataStates) -> DataStates:
    """Give an enabled manager ``ds``: the optimizer hook, and the ``stager`` slot torchtitan
    closes in ``close()`` (it makes a DCP DefaultStager there for the pinned mode otherwise;
    the writer stages itself)."""
    if "://" in str(manager.folder):
        ds.close()
        raise ValueError(
            f"dcp_datastates writes to POSIX paths; checkpoint folder {manager.folder!r} is a URL"
        )
    manager.datastates = ds
    ds.guard(manager.states.get(OPTIMIZER))
    manager.stager = ds
    log.info("dcp_datastates: torchtitan checkpoints in %s go through DataStatesWriter "
             "(async_mode %s)", manager.folder,
             getattr(manager.async_mode, "value", manager.async_mode))
    return ds


def enable_datastates(
    manager: Any,
    *,
    engine: Engine | None = None,
    direct_io: bool | None = None,
    overwrite: bool = True,
    verify_checksums: bool = True,
    overlap: bool = True,
) -> DataStates | None:
    """Route an existing torchtitan ``CheckpointManager``'s saves and loads through
    dcp_datastates, by setting its public ``dcp_save`` and ``dcp_load``.

    Call it on every rank, once, before the first save or load. Returns the manager's
    :class:`DataStates` (``last_stats()`` gives the latest save's figures), or None for a
    disabled manager. A :class:`DataStatesCheckpointManager` is returned its own.

    Args:
        manager: a torchtitan ``CheckpointManager`` (``trainer.checkpointer``).
        engine: the engine to save and load with (default: the process's engine); the caller
            closes it.
        direct_io: as for :class:`~dcp_datastates.DataStatesWriter`.
        overwrite: replace a step folder that already holds a checkpoint, as torchtitan's own
            writer does (the old one stays loadable until the new ``.metadata`` is committed).
        verify_checksums: check every byte read on load against the stored checksums.
        overlap: let the snapshot run during the next forward and backward (the optimizer
            step waits for it); False waits for it inside ``save()``.
    """
    if not getattr(manager, "enable", False):
        return None
    ds: DataStates | None = getattr(manager, "datastates", None)
    if ds is not None:
        return ds
    ds = _attach(manager, DataStates(
        engine=engine if engine is not None else default_engine(), overwrite=overwrite,
        direct_io=direct_io, verify_checksums=verify_checksums, overlap=overlap))
    stock_save, stock_load = manager.dcp_save, manager.dcp_load
    manager.dcp_save = types.MethodType(
        lambda self, *a, **k: _datastates_save(self, stock_save, *a, **k), manager)
    manager.dcp_load = types.MethodType(
        lambda self, *a, **k: _datastates_load(self, stock_load, *a, **k), manager)
    return ds


try:
    from torchtitan.components.checkpoint import CheckpointManager as _CheckpointManager
except ImportError:  # torchtitan is not installed: enable_datastates still works
    _CheckpointManager = None

if _CheckpointManager is not None:

    class DataStatesCheckpointManager(_CheckpointManager):
        """torchtitan's ``CheckpointManager`` saving and loading through dcp_datastates.

        ``engine=`` (an argument of ``build``) gives it an engine made elsewhere; otherwise it
        uses the process's engine, or one of its own where the config sets any of
        ``host_cache_size``, ``io_backend``, ``io_workers`` (closed with the manager).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(_CheckpointManager.Config):
            host_cache_size: str | None = None
            """Host memory per rank for snapshots and I/O buffers ("16GiB"; "auto" sizes it from
            the state). None (with io_backend and io_workers None): the process's engine."""

            io_backend: str | None = None
            """"auto" (io_uring where usable, else threads), "uring" or "threads"."""

            io_workers: int | None = None
            """I/O threads per rank, each with requests in flight."""

            direct_io: bool | None = None
            """O_DIRECT for data files: None where the file system allows and it helps."""

            verify_checksums: bool = True
            """Check every byte read on load against the stored checksums."""

            overlap: bool = True
            """Let snapshots overlap the next forward/backward (False: wait inside save)."""

        def __init__(self, config: Config, *, engine: Engine | None = None,
                     **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            if not self.enable:
                return
            engine_args = {k: v for k, v in (("host_cache_size", config.host_cache_size),
                                              ("io_backend", config.io_backend),
                                              ("io_workers", config.io_workers))
                           if v is not None}
            if engine is not None and engine_args:
                raise ValueError(f"pass engine= or {sorted(engine_args)} in the config, not both")
            owns = engine is None and bool(engine_args)
            if owns:
                engine = Engine(**engine_args)
            _attach(self, DataStates(
                engine=engine if engine is not None else default_engine(), owns_engine=owns,
                direct_io=config.direct_io, verify_checksums=config.verify_checksums,
                overlap=config.overlap))

        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
            return _datastates_save(self, super().dcp_save, state_dict, checkpoint_id,
                                    async_mode, enable_garbage_collection, to_hf)

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            return _datastates_load(self, super().dcp_load, state_dict, checkpoint_id,
                                    from_hf, from_quantized)

else:

    def __getattr__(name: str) -> Any:
        if name == "DataStatesCheckpointManager":
            raise ImportError(
                "DataStatesCheckpointManager needs torchtitan (pip install torchtitan); "
                "enable_datastates works on any manager with the same methods"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
