"""torchtitan: its ``CheckpointManager`` saving and loading through dcp_datastates.

torchtitan (0.2.x and 0.3.x) sends every DCP call of its ``CheckpointManager`` through two
public methods, ``dcp_save`` and ``dcp_load``. This module provides them; nothing private of
torchtitan is replaced. What differs between the two releases (how a manager and its config are
made, which methods a subclass overrides) is in one object per release, chosen once at import:
:data:`TORCHTITAN`. Two ways to use it:

* in a torchtitan 0.3 Python config, in place of ``CheckpointManager.Config`` (with 0.2.x, the
  same fields in the JobConfig's ``checkpoint`` section; see :class:`DataStatesCheckpointManager`)::

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

* ``"disabled"``: ``dcp.save`` with the writer (blocking, as torchtitan's; flushed by io_uring).
* ``"async"`` and ``"async_with_pinned_mem"``: ``dcp.async_save`` (thread mode) with the writer
  on the manager's gloo group. ``save()`` returns as soon as the snapshot has started; the
  snapshot copies into the engine's host cache while the next forward and backward run. The
  optimizer step waits for it: a step pre-hook on the manager's optimizers
  (:func:`dcp_datastates.guard`), which orders the step after the snapshot's copies (on the
  GPU where they run there; a snapshot waiting aside for the host cache to be made counts as
  copied). In ``"async_with_pinned_mem"`` torchtitan's own ``maybe_wait_for_staging()`` gets
  a done staging future where the hook is on (else the snapshot's, staged in host memory),
  so training never waits for host memory being made. The write to
  storage goes on in the background; the next save waits for it as torchtitan always does. The
  host cache is already pinned on GPU hosts, so no process-based upload or separate pinned
  stager is needed.
* Hugging Face exports and imports (``last_save_in_hf``, ``initial_load_in_hf``) keep
  torchtitan's own code.
* Loading: a checkpoint written by DataStatesWriter is read with DataStatesReader; any other
  (an older checkpoint of the same run written by stock torchtitan, a seed checkpoint) with
  DCP's default reader, so a running job can switch.

Memory tier (``DataStatesCheckpointManager.Config(memory_tier=True, ...)``): each save goes
into node memory through a :class:`dcp_datastates.CheckpointManager` (``save()`` waits for no
storage write, nor the next save for its memory commit: the manager orders its saves itself)
and some are persisted in the background to the checkpoint folder as ``step-<N>``, the name
torchtitan finds, loads and purges (``keep_latest_k`` counts them; the manager also applies it
as each persist commits).
``persist_interval`` picks which: 0 whenever the previous persist has finished, else every
``persist_interval / interval``-th save. The last step's save (model-only, HF) is written
straight to the folder as usual, and ``close()`` persists the newest step if the folder lacks
it. ``load()`` of the latest step restores the newest step complete on every rank from the
fastest tier (memory after a crash or a torchrun restart on the same nodes, else the folder),
so a restart takes the step in memory even when its persist had not happened; a step in memory
that was never persisted is persisted by the next run (or by ``python -m dcp_datastates
persist``). For this the subclass overrides torchtitan's ``_save`` and ``_load`` hooks (the
ones 0.3's ``BaseCheckpointManager`` names for subclasses; ``save`` and ``load`` in 0.2.x),
calling torchtitan's own for what it does not handle (seed checkpoints, checkpoints stock
torchtitan wrote, HF). A save the memory tier has no room for is logged and skipped; training
goes on. ``enable_datastates`` has no memory tier.

Limits: checkpoint folders must be on a POSIX file system (local or shared), not an fsspec URL.
State that forward or backward change in place (e.g. BatchNorm running statistics) would be
copied mid-change by an overlapped snapshot: pass ``overlap=False`` for such models, which
waits for the snapshot inside ``save()``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.utils.hooks import RemovableHandle

from .._engine import Engine, default_engine
from .._format.directory import DATA_FILE_RE
from .._guard import guard
from .._reader import DataStatesReader
from .._stats import SaveStats
from .._writer import DataStatesWriter
from ..errors import TierFullError, WorldSizeChangedError
from ..tiers import CheckpointManager as TierManager
from ..tiers._steps import name_steps, step_dir
from ._torchtitan_releases import TORCHTITAN, TorchtitanAPI

log = logging.getLogger("dcp_datastates")

#: torchtitan's keys of the model and the optimizers in ``CheckpointManager.states``.
MODEL, OPTIMIZER = "model", "optimizer"
#: How torchtitan names a step's checkpoint folder (``_create_checkpoint_id``).
TORCHTITAN_STEP = re.compile(r"^step-(\d+)$")

__all__ = ["TORCHTITAN", "DataStates", "DataStatesCheckpointManager", "TorchtitanAPI",
           "enable_datastates", "is_datastates_checkpoint"]


def is_datastates_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` holds DataStatesWriter's data files."""
    try:
        return any(DATA_FILE_RE.match(name) for name in os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return False


@dataclass(eq=False)
class DataStates:
    """What a manager saves and loads with (``manager.datastates``).

    ``engine`` serves every save and load; ``tiers`` is the memory tier's manager (None without
    one); ``staging`` and ``upload`` are the latest async save's futures (its snapshot copied;
    its checkpoint committed: in the memory tier, with one); ``last_stats()`` gives the latest
    direct save's figures (``tiers.history`` the memory tier's). ``close()`` (called when the
    manager closes: torchtitan closes its ``stager``, which this object stands in for) waits
    for the save in flight, closes the memory tier (persisting its newest step), takes the
    optimizer hook off and closes an engine the manager owns.
    """

    engine: Engine
    owns_engine: bool = False
    overwrite: bool = True
    direct_io: bool | None = None
    verify_checksums: bool = True
    overlap: bool = True
    tiers: TierManager | None = None
    budgeted: bool = False  # the memory tier has an overhead budget (max_overhead)
    staging: Future | None = None
    upload: Future | None = None
    commits: list[Future] = field(default_factory=list, repr=False)  # async, not seen over
    last_writer: DataStatesWriter | None = None
    direct: bool = False  # the save in progress bypasses the memory tier (the last step's)
    prepared: bool = False  # the memory tier's slots are being made for the trainer's state
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

    @property
    def guarded(self) -> bool:
        """Whether the optimizer hook is on (the optimizer step waits for the snapshots)."""
        return self._hook is not None

    def guard(self, optimizers: Any) -> None:
        """Make ``optimizers.step()`` wait for the snapshots staged so far (once); with the
        memory tier, through its manager (which counts the waits under ``max_overhead``)."""
        if self._hook is None and optimizers is not None:
            self._hook = guard(optimizers, self.tiers if self.tiers is not None else self.engine)

    def close(self) -> None:
        """Wait for the save in flight (raising its error), take the optimizer hook off, and
        close the engine if the manager owns it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            hook, self._hook = self._hook, None
            upload, self.upload = self.upload, None
            tiers, self.tiers = self.tiers, None
        try:
            if upload is not None:
                upload.result()
        finally:
            try:
                if tiers is not None:
                    _close_tiers(tiers)
            finally:
                if hook is not None:
                    hook.remove()
                if self.owns_engine:
                    self.engine.close()


def _close_tiers(tiers: TierManager) -> None:
    """Close the memory tier (it persists its newest step); a save it had no room for was
    logged when it failed and is no error of the run's."""
    if sys.is_finalizing():  # a manager never closed, collected at exit: its threads are gone
        return
    try:
        tiers.close()
    except TierFullError:
        pass


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
    # the memory tier takes the steps of the manager's folder; others (0.2.x's torchft
    # per-replica saves, <folder>/ft-replicat-<r>/step-<N>) go where torchtitan writes them
    in_folder = Path(checkpoint_id).absolute().parent == Path(manager.folder).absolute()
    if ds.tiers is not None and not ds.direct and in_folder:
        result = _tier_save(ds, state_dict, checkpoint_id, mode)
    elif mode == "disabled":
        dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=ds.writer())
        result = None
    else:
        response = dcp.async_save(
            state_dict, checkpoint_id=checkpoint_id, storage_writer=ds.writer(),
            process_group=manager.pg, async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        if not isinstance(response, AsyncSaveResponse):  # the writer stages asynchronously
            raise TypeError(f"dcp.async_save returned a {type(response).__name__}, not an "
                            "AsyncSaveResponse")
        ds.staging, ds.upload = response.staging_completion, response.upload_completion
        if not ds.overlap:
            response.staging_completion.result()
        # torchtitan expects a Future for "async" and an AsyncSaveResponse for the pinned mode
        # (whose staging future its maybe_wait_for_staging() then waits on: the guard's wait
        # is enough where it is on)
        result = response.upload_completion if mode == "async" else AsyncSaveResponse(
            _done() if ds.guarded else response.staging_completion,
            response.upload_completion)
    if enable_garbage_collection:  # torchtitan's own option: do what its checkpointer does
        from torchtitan.tools.utils import GarbageCollection

        GarbageCollection.collect("GC collection invoked by checkpointer.")
    return result


def _tier_save(ds: DataStates, state_dict: dict[str, Any], checkpoint_id: str,
               mode: str) -> Any:
    """A save into the memory tier (persisted later, maybe): what torchtitan expects back for
    ``mode``. In the async modes its upload future is done at once: the manager orders its
    saves itself, so torchtitan's wait before the next save (for this one's memory commit,
    seconds while the tier's first slots are made) would only stall training, unseen by an
    overhead budget. An earlier async save whose commit has failed raises here (the first save
    after it failed), as that wait would have (a save the tier had no room for is no error: the
    manager logged it; training goes on)."""
    match = TORCHTITAN_STEP.match(Path(checkpoint_id).name)
    if match is None:
        raise ValueError(f"{checkpoint_id}: not a torchtitan step folder (step-<N>)")
    assert ds.tiers is not None  # dcp_save saves into the tier only where there is one
    _raise_failed_commit(ds)
    handle = ds.tiers.save(int(match.group(1)), state_dict)
    ds.staging, ds.upload = _past_full(handle.staged), _past_full(handle.committed)
    if mode == "disabled":
        ds.upload.result()
        return None
    ds.commits.append(ds.upload)
    if not ds.overlap:
        ds.staging.result()
    if mode == "async":
        return _done()
    # the guard orders the optimizer step after the snapshot's copies (and, under an overhead
    # budget, counts its wait): torchtitan's own wait, for the snapshot in host memory, gets a
    # done future
    return AsyncSaveResponse(_done() if ds.budgeted or ds.guarded else ds.staging, _done())


def _raise_failed_commit(ds: DataStates) -> None:
    """Raise the error of the first memory commit of the async saves so far that failed since
    the previous save (each is raised here once: it may have failed after later saves began);
    forget the commits that are over."""
    pending, failed = [], None
    for commit in ds.commits:
        if not commit.done():
            pending.append(commit)
        elif failed is None and commit.exception() is not None:
            failed = commit
    ds.commits = pending
    if failed is not None:
        if failed is ds.upload:
            ds.upload = None
        failed.result()


def _done() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


def _past_full(future: Future) -> Future:
    """``future``, with a TierFullError (logged by the manager) turned into a plain result."""
    out: Future = Future()

    def settle(f: Future) -> None:
        exc = f.exception()
        if exc is None or isinstance(exc, TierFullError):
            out.set_result(None)
        else:
            out.set_exception(exc)

    future.add_done_callback(settle)
    return out


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


def _attach(manager: Any, ds: DataStates,
            memory_tier: Callable[[], TierManager] | None = None) -> DataStates:
    """Give an enabled manager ``ds`` (and its memory tier, made by ``memory_tier``): the
    optimizer hook, and the ``stager`` slot torchtitan closes in ``close()`` (it makes a DCP
    DefaultStager there for the pinned mode otherwise; the writer stages itself)."""
    try:
        if "://" in str(manager.folder):
            raise ValueError(f"dcp_datastates writes to POSIX paths; checkpoint folder "
                             f"{manager.folder!r} is a URL")
        if memory_tier is not None:
            ds.tiers = memory_tier()
    except BaseException:
        ds.close()
        raise
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
    # torchtitan has no hook for an existing manager's writer or reader (both releases make
    # them inside dcp_save and dcp_load), so these two are set on the instance: the one patch
    manager.dcp_save = functools.partial(_datastates_save, manager, manager.dcp_save)
    manager.dcp_load = functools.partial(_datastates_load, manager, manager.dcp_load)
    return ds


if TORCHTITAN.manager is not None:
    # torchtitan's classes, found at run time (as Any: a base class must be known statically)
    _Manager: Any = TORCHTITAN.manager
    _Config: Any = TORCHTITAN.config

    class DataStatesCheckpointManager(_Manager):
        """torchtitan's ``CheckpointManager`` saving and loading through dcp_datastates.

        ``engine=`` (an argument of ``build``) gives it an engine made elsewhere; otherwise it
        uses the process's engine, or one of its own where the config sets any of
        ``host_cache_size``, ``io_backend``, ``io_workers`` (closed with the manager).

        torchtitan 0.2.x makes its manager in ``Trainer.__init__``, as
        ``torchtitan.train.CheckpointManager(...)``: set that name to this class before the
        trainer is made, and give the JobConfig's ``checkpoint`` section the fields below with
        ``--job.custom_config_module`` (a module whose ``JobConfig`` dataclass has a field
        ``checkpoint: DataStatesCheckpointManager.Config``). A field the config lacks takes its
        default.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(_Config):
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

            memory_tier: bool = False
            """Save into node memory (dcp_datastates.CheckpointManager) and persist some of
            the saves to the checkpoint folder in the background; restart from memory."""

            memory_dir: str | None = None
            """With memory_tier: the job's memory root (rank r uses memory_dir/rank_<r>; give a
            node-local path, tmpfs or NVMe). None: /dev/shm/dcp_datastates-<uid>/<the
            folder's last names>-<hash>/rank_<r>."""

            memory_keep: int = 2
            """With memory_tier: checkpoints each rank keeps in memory (size the tier for one
            more, being written)."""

            memory_limit: str | None = None
            """With memory_tier: bytes the memory tier may hold ("48GiB"); None: as much as
            its file system has free. A save that would not fit is skipped (logged)."""

            memory_replicate: bool = False
            """With memory_tier: also keep each rank's checkpoints in the next rank's memory
            tier (another node's), so a lost node's state is restored from memory."""

            persist_interval: int = 0
            """With memory_tier: steps between checkpoints persisted to the folder, a multiple
            of interval (every persist_interval/interval-th save of the run is persisted; one
            due while a persist runs waits for the next save); 0: whenever the previous
            persist has finished."""

            max_overhead: float | None = None
            """With memory_tier: the fraction of training time checkpointing may cost the
            training (0.05: 5%); a save the budget cannot pay for is skipped (logged), so
            interval=1 takes a checkpoint as often as that allows. None: every save is
            taken."""

        def __init__(self, *args: Any, engine: Engine | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not self.enable:
                return
            config = _with_defaults(TORCHTITAN.config_of(args, kwargs), self.Config)
            engine_args = {k: v for k, v in (("host_cache_size", config.host_cache_size),
                                              ("io_backend", config.io_backend),
                                              ("io_workers", config.io_workers))
                           if v is not None}
            if engine is not None and engine_args:
                raise ValueError(f"pass engine= or {sorted(engine_args)} in the config, not both")
            if config.max_overhead is not None and not config.memory_tier:
                raise ValueError("checkpoint.max_overhead needs checkpoint.memory_tier")
            owns = engine is None and bool(engine_args)
            if owns:
                engine = Engine(**engine_args)
            ds = DataStates(
                engine=engine if engine is not None else default_engine(), owns_engine=owns,
                direct_io=config.direct_io, verify_checksums=config.verify_checksums,
                overlap=config.overlap, budgeted=config.max_overhead is not None)
            _attach(self, ds, (lambda: self._memory_tier(config, ds.engine))
                    if config.memory_tier else None)

        def _memory_tier(self, config: Any, engine: Engine) -> TierManager:
            """The memory tier's manager over this checkpoint folder (named as torchtitan
            names its steps)."""
            every = config.persist_interval
            if every < 0 or every % config.interval:
                raise ValueError(f"checkpoint.persist_interval must be 0 or a multiple of "
                                 f"checkpoint.interval ({config.interval}), got {every}")
            folder = Path(self.folder).absolute()
            name_steps(folder, "step-")
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            memory = (Path(os.path.expanduser(config.memory_dir)) / f"rank_{rank}"
                      if config.memory_dir else None)
            tiers = TierManager(folder, memory_dir=memory, keep_memory=config.memory_keep,
                                # as torchtitan's purge, but once each persist is done
                                keep_durable=config.keep_latest_k or None,
                                memory_limit=config.memory_limit,
                                persist=every // config.interval if every else "idle",
                                replicate=config.memory_replicate,
                                max_overhead=config.max_overhead, engine=engine)
            log.info("dcp_datastates: torchtitan checkpoints go to the memory tier %s and are "
                     "persisted to %s (%s)", tiers.memory, folder,
                     f"every {every} steps" if every else "whenever the last persist is done")
            return tiers

        def _tier_save(self, curr_step: int, last_step: bool = False) -> Any:
            """torchtitan's save (called every step; the first call has the memory tier's
            slots made for the trainer's state, in the background); the last step's
            checkpoint (model-only, export dtype, HF) goes straight to the folder, as
            torchtitan writes it."""
            stock = getattr(TORCHTITAN.manager, TORCHTITAN.save_hook)
            ds: DataStates | None = getattr(self, "datastates", None)
            if ds is None or ds.tiers is None:
                return stock(self, curr_step, last_step)
            if not ds.prepared:  # the trainer calls this every step: make the slots from the
                ds.prepared = True  # first (its optimizer state exists then), not the first save
                ds.tiers.prepare(self._flattened_model_states_sd())
            if not last_step:
                return stock(self, curr_step, last_step)
            ds.direct = True
            try:
                return stock(self, curr_step, last_step)
            finally:
                ds.direct = False

        def _tier_load(self, step: int = -1) -> bool:
            """The newest step complete on every rank, from the fastest tier; torchtitan's
            own load for the rest."""
            stock = getattr(TORCHTITAN.manager, TORCHTITAN.load_hook)
            ds: DataStates | None = getattr(self, "datastates", None)
            tiers = ds.tiers if ds is not None else None
            if tiers is None:
                return stock(self, step)
            if step == -1:
                try:
                    newest = tiers.latest_step()  # every rank, memory or folder
                except WorldSizeChangedError:  # memory steps of another number of ranks only
                    if self._find_load_step() < 0:  # nor any torchtitan's own load would take
                        raise
                    newest = None
                # torchtitan's own pick also counts HF exports (no .metadata) in the folder
                if newest is None or self._find_load_step() > newest:
                    return stock(self, step)
                step = newest
            folder = step_dir(Path(self.folder).absolute(), step)
            if step == 0 or (folder.is_dir() and not is_datastates_checkpoint(folder)):
                return stock(self, step)  # a seed checkpoint, or one stock torchtitan wrote
            TORCHTITAN.load_replica_state(self)
            states = self._states_to_load(model_only=False)
            tiers.load(states, step)
            if MODEL in self.states:  # as torchtitan does: the model's entries are flattened
                self.states[MODEL].load_state_dict(states)
            return True

        # the methods this release's trainer calls to save and load (0.3: the hooks behind
        # BaseCheckpointManager's guards; 0.2.x: save and load themselves)
        locals()[TORCHTITAN.save_hook], locals()[TORCHTITAN.load_hook] = _tier_save, _tier_load

        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
            return _datastates_save(self, super().dcp_save, state_dict, checkpoint_id,
                                    async_mode, enable_garbage_collection, to_hf)

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            return _datastates_load(self, super().dcp_load, state_dict, checkpoint_id,
                                    from_hf, from_quantized)

    def _with_defaults(config: Any, cls: type) -> types.SimpleNamespace:
        """Every field of ``cls`` (a config class), from ``config`` where it has it (a 0.2.x
        JobConfig section may lack the adapter's fields), else its default."""
        values = {}
        for f in fields(cls):
            if hasattr(config, f.name):
                values[f.name] = getattr(config, f.name)
            elif f.default is not MISSING:
                values[f.name] = f.default
            elif f.default_factory is not MISSING:
                values[f.name] = f.default_factory()
        return types.SimpleNamespace(**values)

else:

    def __getattr__(name: str) -> Any:
        if name == "DataStatesCheckpointManager":
            raise ImportError(
                f"DataStatesCheckpointManager needs torchtitan (pip install torchtitan; "
                f"importing it failed: {TORCHTITAN.error}); enable_datastates works on any "
                f"manager with the same methods"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
