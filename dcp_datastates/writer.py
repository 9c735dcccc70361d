"""``DataStatesWriter``: a DCP StorageWriter and AsyncStager writing safetensors data files."""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import cuda_copy
from .checksums import BLOCK_BYTES, block_checksums
from .cuda_copy import SideStreams
from .file_format import ItemSpec, plan_layout
from .file_writer import FileWriter, Piece
from .host_cache import MAX_BOUNCE_BYTES, HostCache, check_cache_size
from .io import check_backend_name, get_backend
from .metadata_file import METADATA_NAME, ItemLocation, fsync_dir, write_metadata
from .sizes import parse_size
from .staging import Stager
from .stats import SaveStats
from .turns import SaveTurns

log = logging.getLogger("dcp_datastates")

DATA_FILE_RE = re.compile(r"^__\d+_[0-9a-f]+\.safetensors$")


class _Engine:
    """What a writer builds once and reuses: host cache, stager, I/O backend, flush threads."""

    def __init__(self, cache_bytes: int, io_backend: str, io_workers: int) -> None:
        self.cache = HostCache(cache_bytes)
        self.streams = SideStreams() if cuda_copy.available() else None
        self.unpin = cuda_copy.pin(self.cache) if self.streams is not None else None
        self.backend = get_backend(io_backend)
        self.backend.register(self.cache.addr, self.cache.nbytes)
        self.stager = Stager(self.cache.snapshots, self.streams)
        self.executor = ThreadPoolExecutor(io_workers, thread_name_prefix="dcp_datastates-io")
        self.files = FileWriter(self.backend, self.cache.bounce, self.executor)

    def close(self) -> None:
        self.stager.close()
        self.executor.shutdown(wait=True)
        if self.unpin is not None:
            self.unpin()


def _ends_turn_on_error(method: Callable) -> Callable:
    """A save whose storage call fails is over: give up its turn before raising."""

    @functools.wraps(method)
    def wrapper(self: DataStatesWriter, *args: object, **kwargs: object) -> object:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._turns.release()
            raise

    return wrapper


class DataStatesWriter(StorageWriter, AsyncStager):
    """Saves DCP checkpoints: one safetensors data file per rank, then ``.metadata``.

    Use one writer for a whole training run. As an ``AsyncStager`` it snapshots the state into a
    host cache on a background thread, so ``dcp.async_save`` returns at once and its
    ``staging_completion`` tells when training may change the state again.

    Args:
        path: checkpoint directory; may instead be given as ``checkpoint_id`` to ``dcp.save``.
        host_cache_size: bytes (or a string like ``"16GiB"``) of host memory, allocated once,
            for snapshots and flush buffers. A state larger than the free cache still saves.
        io_backend: ``"auto"`` (io_uring if usable, else threads), ``"uring"`` or ``"threads"``;
            the environment variable ``DCP_DATASTATES_IO`` overrides it.
        overwrite: replace a checkpoint already in the directory (the old one stays intact
            until the new ``.metadata`` is committed).
        direct_io: O_DIRECT for data files: None tries it and falls back where the file system
            refuses it (tmpfs), True requires it, False never uses it.
        io_workers: flush threads (each keeps I/O requests in flight).
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        host_cache_size: int | str = "4GiB",
        io_backend: str = "auto",
        overwrite: bool = False,
        direct_io: bool | None = None,
        io_workers: int = 8,
    ) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.host_cache_size = parse_size(host_cache_size, name="host_cache_size")
        check_cache_size(self.host_cache_size)
        self.io_backend = check_backend_name(io_backend)
        self.overwrite = overwrite
        self.direct_io = direct_io
        self.io_workers = io_workers
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = True
        self._in_child = False
        self._engine: _Engine | None = None
        self._engine_lock = threading.Lock()
        # Allocating (and on GPUs pinning) the cache is slow: do it now, off the training path.
        self._init = threading.Thread(target=self._build_quietly, name="dcp_init", daemon=True)
        self._init.start()
        self._turns = SaveTurns()
        self._stats: SaveStats | None = None
        self._next_stats: deque[SaveStats] = deque()  # one per staged, not yet started save
        self._staged: Future | None = None

    # -- pickling: DCP's PROCESS checkpointer sends the writer to a child process ---------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_engine", "_engine_lock", "_turns", "_staged", "_init"):
            state[key] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._in_child = True
        self._engine_lock = threading.Lock()
        self._turns = SaveTurns()

    @property
    def engine(self) -> _Engine:
        with self._engine_lock:
            if self._engine is None:
                size = min(self.host_cache_size, 4 * MAX_BOUNCE_BYTES) if self._in_child else (
                    self.host_cache_size
                )
                self._engine = _Engine(size, self.io_backend, self.io_workers)
            return self._engine

    def wait_ready(self) -> None:
        """Block until the host cache is allocated and pinned (the writer starts this at once).

        Raises the error that made it fail (e.g. no room in ``/dev/shm``).
        """
        _ = self.engine

    def _build_quietly(self) -> None:
        try:
            self.wait_ready()
        except Exception:  # noqa: BLE001 - raised again where the engine is first used
            pass

    # -- AsyncStager ----------------------------------------------------------------------------
    def stage(self, state_dict: dict) -> Future:
        """Start snapshotting ``state_dict`` into the host cache; the Future gives the copy."""
        self._turns.release()
        stats = SaveStats(backend=self.engine.backend.name)
        self._staged = self.engine.stager.stage(state_dict, stats)
        stats.blocking_s = time.perf_counter() - stats.start
        self._next_stats.append(stats)
        return self._staged

    def synchronize_staging(self) -> None:
        """Wait for the last ``stage`` to finish (DCP's older protocol)."""
        if self._staged is not None:
            self._staged.result()

    def wait_for_snapshot(self) -> None:
        """Block until the latest snapshot's copies are done (at once if none is pending).

        A failed snapshot does not raise here: its error reaches the save's future.
        """
        staged = self._staged
        if staged is not None and not staged.done():
            wait([staged])

    def close(self) -> None:
        """Stop background threads; the writer must not be used afterwards."""
        if self._init is not None:
            self._init.join()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # -- StorageWriter --------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._turns.acquire()  # DCP calls reset first: the save before must be done with path
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    @_ends_turn_on_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        self._turns.acquire()
        self.is_coordinator = is_coordinator
        self._stats = (self._next_stats.popleft() if self._next_stats
                       else SaveStats(backend=self.engine.backend.name))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @_ends_turn_on_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._checkpoint_dir().mkdir(parents=True, exist_ok=True)
        return plan

    @_ends_turn_on_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        directory = self._checkpoint_dir()
        if (directory / METADATA_NAME).exists() and not self.overwrite:
            raise FileExistsError(
                f"{directory} already holds a checkpoint ({METADATA_NAME} exists); pass "
                f"overwrite=True to DataStatesWriter to replace it"
            )
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    @_ends_turn_on_error
    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        results = self._write_file(plan, planner)
        if not self.is_coordinator:  # this rank's part of the save is over
            self._log_durable()
            self._turns.release()
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            directory = self._checkpoint_dir()
            metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
            metadata.storage_meta = self.storage_meta()
            fsync_dir(directory)
            write_metadata(directory, metadata)
            _remove_unreferenced(directory, metadata.storage_data.values())
            self._log_durable()
        finally:
            self._turns.release()

    def _log_durable(self) -> None:
        if self._stats is not None:
            self._stats.durable_s = time.perf_counter() - self._stats.start
            self._stats.log()

    def last_stats(self) -> SaveStats | None:
        """Figures of the latest save on this rank (bytes, times, backend)."""
        return self._stats

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- internals ------------------------------------------------------------------------------
    def _checkpoint_dir(self) -> Path:
        if self.path is None:
            raise ValueError(
                "no checkpoint directory: pass path= to DataStatesWriter or checkpoint_id= to "
                "dcp.save / dcp.async_save"
            )
        return self.path

    def _write_file(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        engine = self.engine
        file_name = f"{plan.storage_data}{secrets.token_hex(4)}.safetensors"
        specs, datas = [], []
        for item in plan.items:
            spec, data = _resolve(item, planner)
            specs.append(spec)
            datas.append(data)
        layout = plan_layout(specs)
        by_name = {
            spec.name: (item, data)
            for spec, item, data in zip(specs, plan.items, datas, strict=True)
        }
        header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
        pieces = [Piece(0, header)]
        hashes: list[tuple[WriteItem, int, int, Future]] = []
        for placement in layout.placements:
            if placement.spec is None:
                continue
            item, data = by_name[placement.spec.name]
            offset = layout.data_start + placement.begin
            pieces.append(Piece(offset, data, engine.stager.region_of(data)))
            hashes.append((item, offset, placement.nbytes, engine.executor.submit(
                block_checksums, data.data_ptr(), data.numel(), BLOCK_BYTES)))
        path = self._checkpoint_dir() / file_name
        nbytes = sum(p.data.numel() for p in pieces)
        start = time.perf_counter()
        try:
            direct = engine.files.write(path, pieces, layout.file_size, self.direct_io)
        finally:
            wait([future for *_, future in hashes])  # they read the regions released below
            for piece in pieces:
                if piece.region is not None:
                    piece.region.release()
        if self._stats is not None:
            self._stats.add_flush(nbytes, time.perf_counter() - start, direct)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=ItemLocation(
                    file_name, offset, length, tuple(future.result()), BLOCK_BYTES
                ),
            )
            for item, offset, length, future in hashes
        ]


def _resolve(item: WriteItem, planner: SavePlanner) -> tuple[ItemSpec, torch.Tensor]:
    """The item's file entry and its bytes as a flat uint8 CPU tensor."""
    name = _entry_name(item.index)
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else (
            torch.empty(0, dtype=torch.uint8)
        )
        return ItemSpec(name, None, (flat.numel(),), flat.numel()), flat
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    flat = tensor.reshape(-1).view(torch.uint8)
    return ItemSpec(name, tensor.dtype, tuple(tensor.shape), flat.numel()), flat


def _entry_name(index: MetadataIndex) -> str:
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{'_'.join(str(o) for o in index.offset)}"


def _remove_unreferenced(directory: Path, locations: object) -> None:
    """Delete data files in ``directory`` that the committed metadata does not name."""
    keep = {loc.file for loc in locations}
    stale = [p for p in directory.iterdir() if DATA_FILE_RE.match(p.name) and p.name not in keep]
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        fsync_dir(directory)
