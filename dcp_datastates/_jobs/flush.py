"""The flush of a save job: its rank's data file, written from the snapshot (or the state).

The file's tensors lie where the snapshot put them: the placements kept by staging (one call of
``data_file.place_tensors``) are the file's, whenever the plan's tensors are the snapshot's
copies; otherwise (a plain save) the plan's tensors are placed here. Tensor I/O starts at once;
bytes items are serialized meanwhile, then written with the header. A snapshot in a snapshot
target is already the file's data: only the header and the bytes items are written there.
"""

from __future__ import annotations

import ctypes
import io
import logging
import pickle
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._cuda.gpu_sums import GPU_SUM_BLOCK
from .._format.align import round_up
from .._format.checksums import BLOCK_BYTES, deal_blocks, regions_checksums
from .._format.data_file import (
    FileLayout,
    ItemSpec,
    Placement,
    file_layout,
    place_bytes,
    place_tensors,
)
from .._format.entries import entry_name
from .._format.metadata_file import ItemLocation
from .._io.file_writer import DataFile, Piece
from .._memory.host_cache import Lease, nbytes_of, resolved
from .._stats import SaveStats
from .snapshot import Snapshot, SnapshotTarget, copy_into, meta_error

if TYPE_CHECKING:
    from .._engine import Engine

log = logging.getLogger("dcp_datastates")

#: Stands for a bytes item's size before it is serialized (no real size has more digits).
_SIZE_BOUND = 10**15
#: Checksum tasks cover at least this many bytes; each thread gets about this many tasks.
_SUM_BYTES, _TASKS_PER_THREAD = BLOCK_BYTES, 2


class FlushedSave(Protocol):
    """What the flush reads of a save job (``_jobs/save.py``'s ``SaveJob``)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def ticket(self) -> int: ...

    @property
    def token(self) -> str: ...

    @property
    def snapshot(self) -> Snapshot | None: ...

    @property
    def target(self) -> SnapshotTarget | None: ...

    @property
    def stats(self) -> SaveStats: ...

    @property
    def leases(self) -> list[Lease]: ...

    def hold(self, lease: Lease | None) -> Lease | None: ...

    def checkpoint_directory(self) -> Path: ...


def write_data_file(job: FlushedSave, plan: SavePlan, planner: SavePlanner,
                    direct_io: bool | None) -> list[WriteResult]:
    """Write ``job``'s data file for ``plan``; return DCP's write results. The caller releases
    the job's leases afterwards."""
    start = time.perf_counter()
    name = f"{plan.storage_data}{job.token}.safetensors"
    tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    raw_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
    serialized = [job.engine.compute(_serialize, planner, i) for i in raw_items]
    tensors = [_resolve_tensor(planner, i) for i in tensor_items]
    specs = [ItemSpec(entry_name(i.index), t.dtype, tuple(t.shape), nbytes_of(t))
             for i, t in zip(tensor_items, tensors, strict=True)]
    placed, in_place = _tensor_placements(job.snapshot, tensors, specs)
    raw_names = [entry_name(i.index) for i in raw_items]
    draft, in_place = _draft(job, placed, raw_names, in_place)
    where = {p.spec.name: draft.data_start + p.begin for p in placed if p.spec is not None}
    offsets = [where[s.name] for s in specs]
    tensors = _host_copies(job, tensors, [o - draft.data_start for o in offsets])
    path = job.checkpoint_directory() / name
    if in_place:
        assert job.target is not None  # in place: the snapshot lies in the target
        path = job.target.adopt(path)
    file = DataFile(path, direct_io, job.engine.io, job.engine.arenas.bounce.pool,
                    job.engine.submit, create=not in_place)
    final, raw_offsets, sizes, checksums = _write(job, file, draft, placed, tensors, offsets,
                                                  raw_names, serialized, in_place)
    job.stats.add_flush(final.file_size, time.perf_counter() - start, file.direct)
    return [
        WriteResult(index=i.index, size_in_bytes=n,
                    storage_data=ItemLocation(name, o, n, tuple(s), block))
        for i, o, n, (block, s) in zip(tensor_items + raw_items, offsets + raw_offsets, sizes,
                                       checksums, strict=True)
    ]


def _resolve_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """The tensor of a tensor item (detached, a conjugate or negative view resolved)."""
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"the planner resolved tensor item {item.index} to a "
                        f"{type(data).__name__}")
    if data.is_meta:
        raise meta_error(item.index.fqn)
    return resolved(data.detach())


def _tensor_placements(snapshot: Snapshot | None, tensors: list[torch.Tensor],
                       specs: list[ItemSpec]) -> tuple[list[Placement], bool]:
    """Where the file puts each tensor: the snapshot's placements when the tensors are its
    copies (each once), else placed now, in the plan's order. Also whether the snapshot lies
    in its target in full (the file's data is there already)."""
    order = _sources_of(snapshot, tensors, specs)
    if order is None:
        return place_tensors(specs), False
    assert snapshot is not None  # _sources_of gives an order only for a snapshot
    spec_of = {k: specs[i] for i, k in enumerate(order)}
    placed = [Placement(spec_of[int(p.spec.name)] if p.spec is not None else None,
                        p.begin, p.nbytes) for p in snapshot.placements]
    return placed, snapshot.in_target and not snapshot.overflow and bool(tensors)


def _sources_of(snapshot: Snapshot | None, tensors: list[torch.Tensor],
                specs: list[ItemSpec]) -> list[int] | None:
    """The snapshot source each tensor is the copy of, if the tensors are the snapshot's
    copies, each once (empty ones are told apart by nothing: any empty source will do). A
    view that is not contiguous (a transpose: the copy's address and size, not its bytes'
    order) is no copy."""
    if snapshot is None or len(tensors) != len(snapshot.placements) - sum(
            p.spec is None for p in snapshot.placements):
        return None
    sizes = {int(p.spec.name): p.nbytes for p in snapshot.placements if p.spec is not None}
    empty = iter(k for k, n in sizes.items() if n == 0)
    order: list[int] = []
    for t, spec in zip(tensors, specs, strict=True):
        k = next(empty, None) if spec.nbytes == 0 else snapshot.copies.get(t.data_ptr())
        if k is None or sizes[k] != spec.nbytes or not t.is_contiguous():
            return None
        order.append(k)
    return order if len(set(order)) == len(order) else None


def _draft(job: FlushedSave, placed: list[Placement], raw_names: list[str],
           in_place: bool) -> tuple[FileLayout, bool]:
    """The layout with bytes items at their largest size: the header's length. In place, the
    header must fit before the data in the snapshot target; if not, the data is copied."""
    end = placed[-1].end if placed else 0
    raw = [ItemSpec(n, None, (_SIZE_BOUND,), _SIZE_BOUND) for n in raw_names]
    draft = file_layout(placed + place_bytes(raw, end))
    if not in_place:
        return draft, False
    # in place: the snapshot lies in a lease of the target
    assert job.snapshot is not None and job.snapshot.lease is not None
    assert job.target is not None
    data_start = job.snapshot.lease.offset
    if draft.data_start <= data_start:
        return file_layout(draft.placements, header_len=data_start), True
    job.target.need_room(draft.data_start)
    log.info("dcp_datastates: save %d: the header (%d bytes) does not fit before the data in "
             "%s; copied this time, room made for the next save", job.ticket,
             draft.data_start, job.target)
    return draft, False


def _write(job: FlushedSave, file: DataFile, draft: FileLayout, placed: list[Placement],
           tensors: list[torch.Tensor], offsets: list[int], raw_names: list[str],
           serialized: list[Future], in_place: bool,
           ) -> tuple[FileLayout, list[int], list[int], list[tuple[int, list[int]]]]:
    """Write the tensors (unless in place), the bytes items and the header; return the final
    layout, the bytes items' offsets, every item's size and (block, checksums)."""
    sums = _Sums()
    made = _made_on_gpu(job.snapshot, tensors)
    try:
        if not in_place:  # in place, the snapshot is the file's data already
            file.preallocate(max((o + nbytes_of(t) for o, t in zip(offsets, tensors,
                                                                  strict=True)),
                                 default=draft.data_start))
            file.write([Piece(o, t.data_ptr(), nbytes_of(t), _lease_of(job.leases, t))
                        for o, t in zip(offsets, tensors, strict=True)])
        sums.start(job.engine, [(t.data_ptr(), nbytes_of(t))
                                for t, m in zip(tensors, made, strict=True) if m is None])
        raws = [f.result() for f in serialized]
        final = draft
        if raw_names:
            end = placed[-1].end if placed else 0
            final = file_layout(placed + place_bytes(
                [ItemSpec(n, None, (len(r),), len(r)) for n, r in zip(raw_names, raws,
                                                                      strict=True)], end),
                header_len=draft.data_start)
        raw_at = {p.spec.name: final.data_start + p.begin
                  for p in final.placements if p.spec and p.spec.dtype is None}
        raw_offsets = [raw_at[n] for n in raw_names]
        memory = [_address(r) for r in (final.header, *raws)]
        file.write([Piece(o, a, n) for o, (a, n) in zip([0, *raw_offsets], memory,
                                                          strict=True)])
        sums.start(job.engine, memory[1:])
        file.finish(final.file_size)
        here = iter(sums.result())
        checksums = [(BLOCK_BYTES, next(here)) if m is None else (GPU_SUM_BLOCK, m)
                     for m in made] + [(BLOCK_BYTES, c) for c in here]
    except BaseException:
        file.abort()
        raise
    finally:
        sums.wait()  # they read the memory the caller releases
    sizes = [nbytes_of(t) for t in tensors] + [len(r) for r in raws]
    return final, raw_offsets, sizes, checksums


def _made_on_gpu(snapshot: Snapshot | None, tensors: list[torch.Tensor]
                 ) -> list[list[int] | None]:
    """Each tensor's block digests made on the GPU as its source was copied, where the tensor
    is that copy in full (None: it is hashed here)."""
    if snapshot is None or not snapshot.sums:
        return [None] * len(tensors)
    sizes = {int(p.spec.name): p.nbytes for p in snapshot.placements if p.spec is not None}
    made: list[list[int] | None] = []
    for t in tensors:
        k = snapshot.copies.get(t.data_ptr())
        if k is not None and sizes.get(k) == nbytes_of(t) and t.is_contiguous():  # whole
            made.append(snapshot.sums.get(k))
        else:
            made.append(None)
    return made


def _lease_of(leases: list[Lease], t: torch.Tensor) -> Lease | None:
    ptr = t.data_ptr()
    for lease in leases:
        if lease.addr <= ptr < lease.addr + lease.capacity:
            return lease
    return None


def _host_copies(job: FlushedSave, tensors: list[torch.Tensor],
                 offsets: list[int]) -> list[torch.Tensor]:
    """CPU tensors to write: GPU ones (a plain ``dcp.save``) are copied on the side stream
    into a lease laid out as the file; non-contiguous ones made contiguous."""
    gpu = [k for k, t in enumerate(tensors) if t.is_cuda]
    out = [t if t.is_cuda or t.is_contiguous() else t.contiguous() for t in tensors]
    if not gpu:
        return out
    sources = [tensors[k].contiguous() for k in gpu]
    base = min(offsets[k] for k in gpu)
    end = max(offsets[k] + nbytes_of(tensors[k]) for k in gpu)
    lease = job.hold(job.engine.reserve(end - base + base % 4096, wait=False))
    shift = base - base % 4096  # keep the file's alignment inside the lease
    cuda = job.engine.cuda
    devices = {t.device.index for t in sources}
    ready = cuda.record_current(devices) if cuda is not None else None
    try:
        copies, _, _ = copy_into(lease, sources, [offsets[k] - shift for k in gpu], cuda, ready)
    finally:
        if cuda is not None and ready is not None:  # (ready: made by cuda)
            cuda.destroy_events(ready)
    for k, c in zip(gpu, copies, strict=True):
        out[k] = c
    return out


def _serialize(planner: SavePlanner, item: WriteItem) -> bytes | memoryview:
    """A bytes item's bytes (DCP's planner pickles it); TypeError naming an item it cannot."""
    try:
        data = planner.resolve_data(item)
    except (TypeError, AttributeError, pickle.PicklingError) as exc:
        raise TypeError(f"{item.index.fqn!r}: a value that cannot be saved ({exc}); a state "
                        f"holds tensors and picklable values") from exc
    return data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)


def _address(data: bytes | memoryview) -> tuple[int, int]:
    """(address, length) of a buffer; the caller keeps it alive."""
    if not len(data):
        return 0, 0
    if isinstance(data, bytes):
        addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        assert addr is not None  # a non-empty buffer's
        return addr, len(data)
    return ctypes.addressof(ctypes.c_char.from_buffer(data)), len(data)


def _sum_pieces(pieces: list[tuple[int, int, int]]) -> list[list[int]]:
    return regions_checksums([(a, n) for _, a, n in pieces], BLOCK_BYTES)


class _Sums:
    """Per-block checksums of items in flight on the checksum threads: the items' blocks are
    dealt out in tasks of about equal bytes, one large item over many threads."""

    def __init__(self) -> None:
        self.count = 0  # items so far
        self.tasks: list[tuple[list[int], Future]] = []  # (item of each piece, checksums)

    def start(self, engine: Engine, regions: list[tuple[int, int]]) -> None:
        """Start the checksums of memory ``regions`` (address, bytes): the next items."""
        total = sum(n for _, n in regions)
        tasks = _TASKS_PER_THREAD * engine.threads.hash_workers
        share = max(_SUM_BYTES, round_up(-(-total // tasks), BLOCK_BYTES))
        for pieces in deal_blocks(regions, share):
            items = [self.count + k for k, _, _ in pieces]
            self.tasks.append((items, engine.compute(_sum_pieces, pieces)))
        self.count += len(regions)

    def result(self) -> list[list[int]]:
        """Every item's checksums, in item order."""
        out: list[list[int]] = [[] for _ in range(self.count)]
        for items, future in self.tasks:
            for k, sums in zip(items, future.result(), strict=True):
                out[k] += sums
        return out

    def wait(self) -> None:
        for _, future in self.tasks:
            future.exception()
