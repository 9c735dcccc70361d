"""A save job: one rank's part of one save, from snapshot to commit, owning what it holds.

States: planned -> staging -> staged -> flushing -> committed | failed (or handed_off, when
DCP's PROCESS checkpointer takes the snapshot to its own process). The job owns its snapshot
lease, the CUDA events and source tensors of its copies (until they are done), the directory
claim, its data file and its figures; ``end`` releases all of it, on success, failure and
cancellation alike. Saves take their storage steps in ticket order (see ``Engine.wait_turn``).
"""

from __future__ import annotations

import ctypes
import io
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..checksums import BLOCK_BYTES, block_checksums
from ..directory import DirectoryClaim, new_token
from ..errors import CheckpointError
from ..file_format import ItemSpec, plan_layout
from ..file_writer import DataFile, Piece
from ..host_cache import Lease
from ..metadata_file import METADATA_NAME, ItemLocation
from ..sizes import format_size
from ..snapshot import copy_into, layout, nbytes_of, rebuild, walk
from ..stats import SaveStats
from .caller import Caller
from .commit import commit

if TYPE_CHECKING:
    from ..tiers.slots import Slot

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # older torch: the version its own writer stamps
    CURRENT_DCP_VERSION = "1.0.0"

log = logging.getLogger("dcp_datastates")

#: A snapshot handed out this long ago that no save has taken no longer holds others up.
UNTAKEN_GRACE_S = 2.0
#: Stands for a bytes item's size before it is serialized (no real size has more digits).
_SIZE_BOUND = 10**15
#: Checksum tasks cover at least this many bytes or items.
_SUM_BYTES, _SUM_ITEMS = 16 << 20, 4096


class StagedFuture(Future):
    """The staged state dict; remembers which threads asked for it (DCP's upload thread does,
    before it starts the save), which ties a DCP save to its snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.takers: list[threading.Thread] = []

    def result(self, timeout: float | None = None) -> object:
        me = threading.current_thread()
        if me not in self.takers and not me.name.startswith("dcp_datastates-"):
            self.takers.append(me)
        return super().result(timeout)


class SaveJob:
    """One rank's part of one save. Made by ``Engine.new_save_job``."""

    def __init__(self, engine: object, ticket: int) -> None:
        self.engine = engine
        self.id = ticket
        self.state = "planned"
        self.stats = SaveStats(backend=engine.io.name)
        self.staged = StagedFuture()  # the staged state dict (async saves)
        self.copied = threading.Event()  # the snapshot's copies are over
        self.persisted: Future = Future()  # this rank's data durable (and committed: coordinator)
        self.caller: Caller | None = None  # the thread and DCP call running the save
        self.is_coordinator = True
        self.token = new_token()
        self.directory: Path | None = None
        self.slot: Slot | None = None  # a memory-tier slot to snapshot into (async saves)
        self._leases: list[Lease] = []
        self._claim: DirectoryClaim | None = None
        self._lock = threading.RLock()
        self._ended = False
        self._delivered_at: float | None = None  # when the staged dict was handed out
        self._stager: threading.Thread | None = None  # the thread that called stage()

    # -- staging (async saves) ------------------------------------------------------------------
    def stage(self, state_dict: dict) -> StagedFuture:
        """Start the snapshot; return a Future of the staged state dict.

        Runs on the caller's thread only to record the structure and a CUDA event; the copies
        run on the engine's staging thread.
        """
        self._stager = threading.current_thread()
        sources: list[torch.Tensor] = []
        dtensors: set[int] = set()
        try:
            skeleton = walk(state_dict, sources, {}, dtensors)
            devices = {t.device.index for t in sources if t.is_cuda}
            cuda = self.engine.cuda
            ready = cuda.record_current(devices) if devices and cuda is not None else None
            self.state = "staging"
            self.stats.blocking_s = time.perf_counter() - self.stats.start
            self.engine.stage_pool.submit(self._stage, skeleton, sources, dtensors, ready)
        except BaseException as exc:
            self.end(exc)
            raise
        return self.staged

    def _stage(self, skeleton: object, sources: list[torch.Tensor], dtensors: set[int],
               ready: dict | None) -> None:
        try:
            offsets, total = layout(sources)
            lease = self._hold(self._slot_lease(total, len(sources)) or self.engine.reserve(total))
            staged, overflow = copy_into(lease, sources, offsets, self.engine.cuda, ready,
                                         dtensors)
            sources.clear()  # the copies are done: the sources may be changed or freed
            state = rebuild(skeleton, staged, {})
        except BaseException as exc:  # noqa: BLE001 - the save's futures carry it
            self.end(exc)
            return
        finally:
            if ready is not None:
                self.engine.cuda.destroy_events(ready)
            self.copied.set()
        self.state = "staged"
        self.stats.overflow_bytes = overflow
        self.stats.staged_bytes = sum(nbytes_of(t) for t in staged) - overflow
        self.stats.snapshot_s = time.perf_counter() - self.stats.start
        if overflow:
            log.warning(
                "dcp_datastates: save %d: %s of the state did not fit in the host cache and was "
                "staged in pageable memory (slower); give the engine a larger host_cache_size",
                self.id, format_size(overflow))
        if not self.staged.done():
            self._delivered_at = time.monotonic()
            self.staged.set_result(state)

    def _slot_lease(self, total: int, entries: int) -> Lease | None:
        """The snapshot's lease in the job's memory-tier slot, if it has one that can take it."""
        if self.slot is None or total <= 0:
            return None
        try:
            return self.slot.lease(total, entries)
        except (OSError, RuntimeError) as exc:  # no room on the tier, pinning refused
            log.warning("dcp_datastates: save %d: memory-tier slot %s unusable (%s); the "
                        "snapshot goes to the host cache and is copied", self.id,
                        self.slot.home, exc)
            return None

    def _hold(self, lease: Lease | None) -> Lease | None:
        if lease is not None:
            with self._lock:
                self._leases.append(lease)
                if self._ended:  # ended meanwhile (engine closing): give it straight back
                    self._release()
                    raise CheckpointError(f"save {self.id} ended while it was staging")
        return lease

    # -- the DCP save ---------------------------------------------------------------------------
    def claim(self) -> None:
        """The calling thread runs this save now; any save it left unfinished is over."""
        self.caller = Caller.here()
        self.engine.end_saves_left_by(self.caller.thread, self)

    def set_up(self, is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator

    def taken_by(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` took this job's staged state dict (DCP's upload thread does)."""
        return not self._ended and self.caller is None and thread in self.staged.takers

    def prepare(self, overwrite: bool) -> None:
        """Create the directory; the coordinator claims it and checks for a checkpoint."""
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        if not self.is_coordinator:
            return
        self._claim = DirectoryClaim(directory)
        if (directory / METADATA_NAME).exists() and not overwrite:
            raise RuntimeError(
                f"Checkpoint already exists and overwrite=False: {directory} holds "
                f"{METADATA_NAME}; pass overwrite=True to DataStatesWriter to replace it (the "
                f"old checkpoint stays intact until the new one is committed)")

    def flush(self, plan: SavePlan, planner: SavePlanner,
              direct_io: bool | None) -> list[WriteResult]:
        """Write this rank's data file; return DCP's write results. Tensor I/O starts at once;
        bytes items are serialized meanwhile, then written with the header."""
        self.state = "flushing"
        start = time.perf_counter()
        name = f"{plan.storage_data}{self.token}.safetensors"
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        raw_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        serialized = [self.engine.compute(_serialize, planner, i) for i in raw_items]
        tensors = [planner.resolve_data(i).detach() for i in tensor_items]
        specs = [ItemSpec(entry_name(i.index), t.dtype, tuple(t.shape), nbytes_of(t))
                 for i, t in zip(tensor_items, tensors, strict=True)]
        entries = specs + [ItemSpec(entry_name(i.index), None, (_SIZE_BOUND,), _SIZE_BOUND)
                           for i in raw_items]
        draft = plan_layout(entries)
        if self.slot is not None and draft.data_start <= self.slot.room:
            draft = plan_layout(entries, header_len=self.slot.room)  # the data where it lies
        where = {p.spec.name: draft.data_start + p.begin for p in draft.placements if p.spec}
        offsets = [where[s.name] for s in specs]
        tensors = self._host_copies(tensors, [o - draft.data_start for o in offsets])
        in_slot = self._in_slot(tensors, offsets, draft.data_start)
        path = self.slot.adopt(self.directory / name) if in_slot else self.directory / name
        file = DataFile(path, direct_io, self.engine.io, self.engine.bounce.pool,
                        self.engine.submit, create=not in_slot)
        sums = _Sums([])
        try:
            if not in_slot:  # in the slot, the snapshot is the file's data already
                file.preallocate(max((o + nbytes_of(t) for o, t in zip(offsets, tensors,
                                                                      strict=True)),
                                     default=draft.data_start))
                file.write([Piece(o, t.data_ptr(), nbytes_of(t), self._lease_of(t))
                            for o, t in zip(offsets, tensors, strict=True)])
            sums += _checksums(self.engine, [(t.data_ptr(), nbytes_of(t)) for t in tensors])
            raws = [f.result() for f in serialized]
            final = draft if not raw_items else plan_layout(
                specs + [ItemSpec(entry_name(i.index), None, (len(r),), len(r))
                         for i, r in zip(raw_items, raws, strict=True)],
                header_len=draft.data_start)
            raw_at = {p.spec.name: final.data_start + p.begin
                      for p in final.placements if p.spec and p.spec.dtype is None}
            raw_offsets = [raw_at[entry_name(i.index)] for i in raw_items]
            memory = [_address(r) for r in (final.header, *raws)]
            file.write([Piece(o, a, n) for o, (a, n) in zip([0, *raw_offsets], memory,
                                                              strict=True)])
            sums += _checksums(self.engine, memory[1:])
            file.finish(final.file_size)
            checksums = sums.result()
        except BaseException:
            file.abort()
            raise
        finally:
            sums.wait()  # they read the memory released here
            self._release(claim=False)  # the bytes are in the file (or the save failed)
        self.stats.add_flush(final.file_size, time.perf_counter() - start, file.direct)
        items = tensor_items + raw_items
        sizes = [nbytes_of(t) for t in tensors] + [len(r) for r in raws]
        results = [
            WriteResult(index=i.index, size_in_bytes=n,
                        storage_data=ItemLocation(name, o, n, tuple(s), BLOCK_BYTES))
            for i, o, n, s in zip(items, offsets + raw_offsets, sizes, checksums, strict=True)
        ]
        if not self.is_coordinator:
            self.end(None)  # this rank's part is durable
        return results

    def commit(self, metadata: Metadata, results: list[list[WriteResult]],
               storage_meta: StorageMeta) -> None:
        """Commit ``.metadata`` (after every rank's file is durable) and end the save."""
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = storage_meta
        metadata.version = CURRENT_DCP_VERSION
        commit(self.directory, metadata, self.token)
        self.end(None)

    def hand_off(self) -> None:
        """DCP's PROCESS checkpointer has pickled (so copied) the snapshot to its process:
        the lease is free, and the rest of the save is that process's."""
        self.caller = Caller.here()
        self.state = "handed_off"
        self.end(None)

    # -- the end --------------------------------------------------------------------------------
    def end(self, error: BaseException | None) -> None:
        """Release everything the job holds and settle its futures (idempotent)."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._release()
        if self.state != "handed_off":
            self.state = "failed" if error is not None else "committed"
        if error is None:
            self.stats.durable_s = time.perf_counter() - self.stats.start
            if self.stats.bytes_written:
                self.stats.log()
        for future in (self.staged, self.persisted):
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        self.copied.set()
        self.engine.job_done(self)

    def _takers(self) -> list[threading.Thread]:
        return [t for t in self.staged.takers if t is not self._stager]

    def untaken_for(self) -> float:
        """Seconds since the snapshot was handed out with no save taking it (0 otherwise)."""
        at = self._delivered_at
        if at is None or self.caller is not None or self._ended or self._takers():
            return 0.0
        return time.monotonic() - at

    def holds_memory(self) -> bool:
        return bool(self._leases)

    def blocks_turns(self) -> bool:
        """Whether later saves wait for this one: it runs, its snapshot is still copying, a DCP
        thread took the snapshot and is on its way, or it was handed out only just now."""
        if self._ended:
            return False
        if self.caller is not None or not self.staged.done():
            return True
        if any(t.is_alive() for t in self._takers()):
            return True
        return not self._takers() and self.untaken_for() < UNTAKEN_GRACE_S

    def abandoned(self) -> bool:
        """Whether DCP left this save without ending it: the call that ran it returned (or
        its thread ended), or the thread that took its snapshot ended before starting it."""
        if self._ended:
            return False
        if self.caller is not None:
            return self.caller.gone()
        takers = self._takers()
        return bool(takers) and not any(t.is_alive() for t in takers)

    def end_abandoned(self) -> None:
        """DCP left the save: end it, releasing what it holds."""
        self.end(CheckpointError(
            f"save {self.id} stopped outside dcp_datastates (another rank, the planner or DCP "
            f"failed); what it held is released"))

    @property
    def ended(self) -> bool:
        return self._ended

    def _release(self, claim: bool = True) -> None:
        """Give back the leases and, with ``claim``, the directory claim."""
        with self._lock:
            leases, self._leases = self._leases, []
            claim, self._claim = (self._claim, None) if claim else (None, self._claim)
        for lease in leases:
            lease.release()
        if claim is not None:
            claim.release()

    def _in_slot(self, tensors: list[torch.Tensor], offsets: list[int], data_start: int) -> bool:
        """Whether every tensor lies in the job's slot where the data file puts it (the
        snapshot went there, in the file's order, and the header fits the slot's room)."""
        slot = self.slot
        if slot is None or slot.arena is None or not tensors:
            return False
        if data_start != slot.room:
            slot.need_room(data_start)
            log.info("dcp_datastates: save %d: the header (%d bytes) exceeds the room of "
                     "memory-tier slot %s; copied this time, room made for the next save",
                     self.id, data_start, slot.home)
            return False
        return all(t.data_ptr() == slot.addr + o for t, o in zip(tensors, offsets, strict=True))

    def _lease_of(self, t: torch.Tensor) -> Lease | None:
        ptr = t.data_ptr()
        for lease in self._leases:
            if lease.addr <= ptr < lease.addr + lease.capacity:
                return lease
        return None

    def _host_copies(self, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
        """CPU tensors to write: GPU ones (a plain ``dcp.save``) are copied on the side stream
        into a lease laid out as the file; non-contiguous ones made contiguous."""
        gpu = [k for k, t in enumerate(tensors) if t.is_cuda]
        out = [t if t.is_cuda or t.is_contiguous() else t.contiguous() for t in tensors]
        if not gpu:
            return out
        sources = [tensors[k].contiguous() for k in gpu]
        base = min(offsets[k] for k in gpu)
        end = max(offsets[k] + nbytes_of(tensors[k]) for k in gpu)
        lease = self._hold(self.engine.reserve(end - base + base % 4096, wait=False))
        shift = base - base % 4096  # keep the file's alignment inside the lease
        cuda = self.engine.cuda
        devices = {t.device.index for t in sources}
        ready = cuda.record_current(devices) if cuda is not None else None
        try:
            copies, _ = copy_into(lease, sources, [offsets[k] - shift for k in gpu], cuda, ready)
        finally:
            if ready is not None:
                cuda.destroy_events(ready)
        for k, c in zip(gpu, copies, strict=True):
            out[k] = c
        return out


def entry_name(index: MetadataIndex) -> str:
    """The data file entry of a DCP item: its fqn, plus chunk offsets for a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{'_'.join(str(o) for o in index.offset)}"


def _serialize(planner: SavePlanner, item: WriteItem) -> bytes | memoryview:
    data = planner.resolve_data(item)
    return data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)


def _address(data: bytes | memoryview) -> tuple[int, int]:
    """(address, length) of a buffer; the caller keeps it alive."""
    if not len(data):
        return 0, 0
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, len(data)
    return ctypes.addressof(ctypes.c_char.from_buffer(data)), len(data)


def _checksums(engine: object, spans: list[tuple[int, int]]) -> _Sums:
    """Start per-block checksums of ``spans`` on the checksum threads, in batches."""
    batches: list[list[tuple[int, int]]] = [[]]
    size = 0
    for span in spans:
        if batches[-1] and (size >= _SUM_BYTES or len(batches[-1]) >= _SUM_ITEMS):
            batches.append([])
            size = 0
        batches[-1].append(span)
        size += span[1]
    return _Sums([engine.compute(_sum_batch, b) for b in batches if b])


def _sum_batch(spans: list[tuple[int, int]]) -> list[list[int]]:
    return [block_checksums(a, n, BLOCK_BYTES) for a, n in spans]


class _Sums:
    """Checksum batches in flight, in item order."""

    def __init__(self, futures: list[Future]) -> None:
        self.futures = futures

    def __iadd__(self, other: _Sums) -> _Sums:
        self.futures += other.futures
        return self

    def result(self) -> list[list[int]]:
        return [s for f in self.futures for s in f.result()]

    def wait(self) -> None:
        for f in self.futures:
            f.exception()
