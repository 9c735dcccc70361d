"""A load job: one rank's reads of one load, through the engine's I/O path.

Large items are read straight into their targets (CPU) or through pinned bounce extents and a
side-stream host-to-device copy (GPU); small items and bytes items of one file are read
together, a few large requests for thousands of items, into a bounce buffer, verified there and
copied out. Every byte is checked against ``.metadata``'s checksums unless turned off.
"""

from __future__ import annotations

import enum
import io
import math
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .._format.align import ALIGN, round_up
from .._format.checksums import memory_at, verify_span
from .._format.data_file import ItemSpec, entry_mismatch, layout_mismatch, read_file_header
from .._format.directory import memory_backed, open_regular
from .._format.entries import stored_spec
from .._format.metadata_file import ItemLocation, metadata_stamp
from .._io.base import IOBackend, IOReq
from .._memory.host_cache import Lease
from .._stats import LoadStats
from ..errors import CheckpointCorruptError, CheckpointError

if TYPE_CHECKING:
    from .._engine import Engine

#: Items (whole stored chunks) smaller than this are read together with their neighbours.
SMALL_ITEM_BYTES = 1 << 20
#: Bytes one read of a group of small items may cover, and the hole it may read across.
GROUP_BYTES, GROUP_GAP = 16 << 20, 64 << 10

_Read = tuple[ReadItem, "torch.Tensor | None", "bytes | None"]


class _Damaged(enum.Enum):
    DAMAGED = "damaged"


#: A read that failed and went to ``LoadJob``'s ``damaged`` (an enum member: reads narrow).
_DAMAGED: Final = _Damaged.DAMAGED


@dataclass
class _Small:
    """A small item to read in a group: a bytes item (``target`` None) or a tensor chunk."""

    req: ReadItem
    loc: ItemLocation
    target: torch.Tensor | None
    spec: ItemSpec


class ItemSink(Protocol):
    """What a load job hands the items it reads to: the part of DCP's ``LoadPlanner`` it uses
    (the CLI's readers give their own)."""

    def resolve_tensor(self, read_item: ReadItem, /) -> torch.Tensor: ...
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor, /) -> None: ...
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO, /) -> None: ...


class LoadJob:
    """Reads one plan of one load. Made per ``read_data`` by the reader. With ``damaged``,
    an item whose read or checksum fails goes there (with its error) and the rest is read."""

    def __init__(self, engine: Engine, directory: Path, metadata: Metadata,
                 verify_checksums: bool, direct_io: bool, stamp: tuple | None = None,
                 damaged: list[tuple[ReadItem, CheckpointCorruptError]] | None = None) -> None:
        self.engine = engine
        self.directory = directory
        self.metadata = metadata
        self.verify_checksums = verify_checksums
        self.direct_io = direct_io
        self.stamp = stamp  # the .metadata read (metadata_stamp), to tell a replaced one
        self.damaged = damaged
        self.stats = LoadStats(engine.io.name, verified=verify_checksums)
        self._over = threading.Event()  # the reads are over (the engine's close waits)

    def read(self, plan: LoadPlan, planner: ItemSink) -> LoadStats:
        """Read every item of ``plan`` and hand it to ``planner``; return the figures. The
        engine's ``close()`` waits for the reads (:meth:`wait`)."""
        start = time.perf_counter()
        self.engine.track(self)
        try:
            done = self._read_all(plan, planner)
        except CheckpointError as exc:  # a file gone, or a checksum of another step's bytes
            if (replaced := self._replaced()) is not None:
                raise replaced from exc
            raise
        finally:
            self.engine.untrack(self)
            self._over.set()
        if (replaced := self._replaced()) is not None:
            raise replaced
        for req, target, data in done:
            if target is None:
                assert data is not None  # a bytes item's read gives its bytes
                self.stats.bytes_read += len(data)
                planner.load_bytes(req, io.BytesIO(data))
            else:
                self.stats.bytes_read += target.numel() * target.element_size()
                planner.commit_tensor(req, target)
        self.stats.seconds = time.perf_counter() - start
        return self.stats

    def _replaced(self) -> CheckpointError | None:
        """The error of a load whose ``.metadata`` is gone or replaced now that its reads are
        over: the checkpoint was removed or replaced meanwhile, and its data files may hold
        another checkpoint's bytes (a memory-tier step that retention dropped has its data
        file reused in place by a later step, once its ``.metadata`` is gone)."""
        if self.stamp is None or metadata_stamp(self.directory) == self.stamp:
            return None
        return CheckpointError(
            f"checkpoint {self.directory} was removed or replaced while this load read it (its "
            f".metadata changed): what was read may be another checkpoint's, so the load "
            f"fails; load it again, or another checkpoint")

    def wait(self, deadline: float) -> None:
        """Block until the reads are over, or ``deadline`` (``time.monotonic``) passes."""
        self._over.wait(max(0.0, deadline - time.monotonic()))

    def end(self) -> None:
        """The engine is closing: nothing to do here. Its I/O threads finish the reads already
        submitted before the bounce buffers are freed, and refuse later ones."""

    def _read_all(self, plan: LoadPlan, planner: ItemSink) -> list[_Read]:
        """Read every item; return (item, target or None for bytes, bytes or None)."""
        files = _OpenFiles(self.directory, self.direct_io)
        backend = self.engine.io
        large: list[tuple[ReadItem, torch.Tensor | None, Future[bytes | None]]] = []
        groups: list[Future[list[_Read]]] = []
        small: dict[str, list[_Small]] = defaultdict(list)
        bounce = self.engine.arenas.bounce.pool.capacity  # a group must fit in one bounce lease
        small_max = min(SMALL_ITEM_BYTES, bounce)
        try:
            for req in plan.items:
                loc = self._location(req)
                f = files.open(loc, req)
                spec = self._checked_spec(f, loc, req)
                target = None
                if req.type != LoadItemType.BYTE_IO:
                    target = planner.resolve_tensor(req).detach()
                if loc.length < small_max and (target is None or not target.is_cuda):
                    small[loc.file].append(_Small(req, loc, target, spec))
                elif target is None:
                    large.append((req, None, self.engine.submit(
                        self._read_bytes, backend, f, loc, req)))
                else:
                    large.append((req, target, self.engine.submit(
                        self._read_tensor, backend, f, loc, req, target, spec)))
            files.check_layouts()  # after the items' own entries: their mismatches say more
            for name, items in small.items():
                for group in _groups(items, min(GROUP_BYTES, bounce)):
                    groups.append(self.engine.submit(self._read_group, files.get(name), group))
            done: list[_Read] = [
                (req, target, data) for req, target, fut in large  # data: bytes items
                if (data := _result(req, fut, self.damaged)) is not _DAMAGED]
            return done + [r for g in groups for r in g.result()]
        finally:
            pending: list[Future[Any]] = [*(item[2] for item in large), *groups]
            for fut in pending:
                fut.exception()  # nothing may still read into memory once this returns
            files.close()

    def _read_group(self, f: _File, items: list[_Small]) -> list[_Read]:
        """Read the items' bytes in one request, verify each, copy each into its target."""
        lo = items[0].loc.offset
        hi = max(i.loc.offset + i.loc.length for i in items)
        lease = self.engine.arenas.bounce.pool.allocate(hi - lo)
        try:
            try:
                self.engine.io.read(f.fd, items[0].loc.file, [IOReq(lease.addr, hi - lo, lo)])
            except OSError as exc:
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory}, file {items[0].loc.file}: {exc}") from exc
            out: list[_Read] = []
            for item in items:
                a = item.loc.offset - lo
                mem = (memory_at(lease.addr + a, item.loc.length) if item.loc.length
                       else memoryview(b""))
                if self.verify_checksums and not _verified(
                        item, mem, self._describe(item.loc, item.req), self.damaged):
                    continue
                if item.target is None:
                    out.append((item.req, None, bytes(mem)))
                else:
                    self._fill(item, lease.as_tensor(item.loc.length, a))
                    out.append((item.req, item.target, None))
            return out
        finally:
            lease.release()

    def _fill(self, item: _Small, data: torch.Tensor) -> None:
        """Copy the requested part of a whole stored chunk (``data``, uint8) into the target."""
        shape, dtype, target = item.spec.shape, item.spec.dtype, item.target
        assert dtype is not None and target is not None  # a tensor chunk's
        view = data.view(dtype).view(shape) if data.numel() else torch.empty(shape, dtype=dtype)
        for dim, (o, n) in enumerate(zip(item.req.storage_offsets, item.req.lengths,
                                         strict=True)):
            view = view.narrow(dim, o, n)
        target.copy_(view)

    def _checked_spec(self, f: _File, loc: ItemLocation, req: ReadItem) -> ItemSpec:
        """The item as ``.metadata`` describes it, after checking that the data file's header
        says the same (dtype, shape, data offsets)."""
        spec = stored_spec(self.metadata, req.storage_index, loc,
                           req.type != LoadItemType.BYTE_IO, self._describe(loc, req))
        why = entry_mismatch(f.header, f.data_start, spec, loc.offset)
        if why is not None:
            raise CheckpointCorruptError(
                f"{self._describe(loc, req)}: the data file's header does not match .metadata: "
                f"{why}")
        return spec

    def _location(self, req: ReadItem) -> ItemLocation:
        assert self.metadata is not None, "read_data before set_up_storage_reader"
        loc = self.metadata.storage_data.get(req.storage_index)
        if not isinstance(loc, ItemLocation):
            raise CheckpointCorruptError(
                f"checkpoint {self.directory}: .metadata has no location for item "
                f"{req.storage_index.fqn!r}"
            )
        return loc

    def _describe(self, loc: ItemLocation, req: ReadItem) -> str:
        return f"checkpoint {self.directory}, file {loc.file}, item {req.storage_index.fqn!r}"

    def _read(self, backend: IOBackend, f: _File, loc: ItemLocation, a: int, dst: torch.Tensor,
              req: ReadItem) -> None:
        """Read item bytes ``[a, a + dst.numel())`` into the flat uint8 tensor ``dst``."""
        if not dst.numel():
            return
        try:
            backend.read(f.fd, loc.file, [IOReq(dst.data_ptr(), dst.numel(), loc.offset + a)])
        except OSError as exc:
            raise CheckpointCorruptError(f"{self._describe(loc, req)}: {exc}") from exc

    def _verify(self, backend: IOBackend, f: _File, loc: ItemLocation, a: int, main: torch.Tensor,
                req: ReadItem) -> None:
        """Check the blocks covering item bytes ``[a, a + len(main))``, reading their edges."""
        if not self.verify_checksums:
            return
        b = a + main.numel()
        lo = a - a % loc.block
        hi = min(loc.length, -(-b // loc.block) * loc.block) if b > a else lo
        head, tail = _bytes(a - lo), _bytes(max(hi - b, 0))  # alive until verified
        self._read(backend, f, loc, lo, head, req)
        self._read(backend, f, loc, b, tail, req)
        segments = [(start, memory_at(data.data_ptr(), data.numel()))
                    for start, data in ((lo, head), (a, main), (b, tail))
                    if data.numel() or start == lo]
        verify_span(segments, loc.checksums, loc.block, loc.length, self._describe(loc, req))

    def _read_bytes(self, backend: IOBackend, f: _File, loc: ItemLocation, req: ReadItem) -> bytes:
        buf = _bytes(loc.length)
        self._read(backend, f, loc, 0, buf, req)
        self._verify(backend, f, loc, 0, buf, req)
        return bytes(memory_at(buf.data_ptr(), buf.numel())) if buf.numel() else b""

    def _read_tensor(self, backend: IOBackend, f: _File, loc: ItemLocation, req: ReadItem,
                     target: torch.Tensor, spec: ItemSpec) -> None:
        shape, dtype = spec.shape, spec.dtype
        assert dtype is not None  # a tensor chunk's
        itemsize = dtype.itemsize
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        row = math.prod(shape[1:]) * itemsize
        a, b = (offsets[0] * row, (offsets[0] + lengths[0]) * row) if shape else (0, loc.length)
        whole_rows = offsets[1:] == [0] * (len(shape) - 1) and lengths[1:] == list(shape[1:])
        direct = (  # the request is the target's bytes, in order: no reshaping copy needed
            target.is_contiguous() and target.dtype == dtype and whole_rows
            and target.numel() * itemsize == b - a
        )
        if direct and target.is_cuda and self.engine.cuda is not None:
            return self._read_to_gpu(backend, f, loc, a, b, req, target)
        direct = direct and target.device.type == "cpu"
        buf = target.reshape(-1).view(torch.uint8) if direct else _bytes(b - a)
        self._read(backend, f, loc, a, buf, req)
        self._verify(backend, f, loc, a, buf, req)
        if not direct:
            rows = [lengths[0], *shape[1:]] if shape else []
            view = buf.view(dtype).view(rows)
            for dim in range(1, len(shape)):
                view = view.narrow(dim, offsets[dim], lengths[dim])
            target.copy_(view)


    def _read_to_gpu(self, backend: IOBackend, f: _File, loc: ItemLocation, a: int, b: int,
                     req: ReadItem, target: torch.Tensor) -> None:
        """Item bytes ``[a, b)`` -> pinned extents -> ``cudaMemcpyAsync`` into ``target``.

        Extents are whole checksum blocks, so each is verified on its own before its copy.
        """
        pool, block, streams = self.engine.arenas.bounce.pool, loc.block, self.engine.cuda
        assert streams is not None  # _read_tensor reads to the GPU only with a copier
        lo, hi = a, b
        if self.verify_checksums:
            lo, hi = a - a % block, min(loc.length, -(-b // block) * block)
        extent = max(block, pool.capacity // self.engine.threads.io_workers // block * block)
        for s in range(lo, hi, extent):
            e = min(s + extent, hi)
            lease = pool.allocate(e - s)
            try:
                self._read_extent(backend, f, loc, s, lease, req)
                if self.verify_checksums:
                    verify_span([(s, memory_at(lease.addr, e - s))], loc.checksums, block,
                                loc.length, self._describe(loc, req))
                c0, c1 = max(s, a), min(e, b)
                if c0 < c1:
                    streams.copy([(target.device.index, target.data_ptr() + c0 - a,
                                   lease.addr + c0 - s, c1 - c0)], "h2d")
            finally:
                lease.release()

    def _read_extent(self, backend: IOBackend, f: _File, loc: ItemLocation, s: int,
                     lease: Lease, req: ReadItem) -> None:
        """Item bytes ``[s, s + lease.nbytes)`` into ``lease``: O_DIRECT for the aligned body.

        The body is read in whole 4 KiB blocks (the lease has space for the rounding), up to
        the file's last whole block; what is left (the file's tail) is read buffered.
        """
        start, end = loc.offset + s, loc.offset + s + lease.nbytes
        body_end, direct_fd = start, f.direct_fd
        if direct_fd is not None and start % ALIGN == 0:
            body_end = max(start, min(round_up(end), f.size - f.size % ALIGN))
        try:
            if direct_fd is not None and body_end > start:  # (body_end > start: direct I/O)
                backend.read(direct_fd, loc.file, [IOReq(lease.addr, body_end - start, start)])
            if body_end < end:
                backend.read(f.fd, loc.file,
                             [IOReq(lease.addr + body_end - start, end - body_end, body_end)])
        except OSError as exc:
            raise CheckpointCorruptError(f"{self._describe(loc, req)}: {exc}") from exc




def _result(req: ReadItem, future: Future[bytes | None],
            damaged: list | None) -> bytes | None | Literal[_Damaged.DAMAGED]:
    """A large item's read's result; ``_DAMAGED`` where it failed and went to ``damaged``."""
    try:
        return future.result()
    except CheckpointCorruptError as exc:
        if damaged is None:
            raise
        damaged.append((req, exc))
        return _DAMAGED


def _verified(item: _Small, mem: memoryview, what: str, damaged: list | None) -> bool:
    """Whether a small item's bytes ``mem`` match its checksums; where not, raise, or put
    the item in ``damaged``."""
    try:
        verify_span([(0, mem)], item.loc.checksums, item.loc.block, item.loc.length, what)
    except CheckpointCorruptError as exc:
        if damaged is None:
            raise
        damaged.append((item.req, exc))
        return False
    return True


def _groups(items: list[_Small], limit: int) -> list[list[_Small]]:
    """Group a file's small items (by offset), each group read in one request."""
    items = sorted(items, key=lambda i: i.loc.offset)
    groups: list[list[_Small]] = []
    lo = end = 0
    for item in items:
        a, b = item.loc.offset, item.loc.offset + item.loc.length
        if groups and a - end <= GROUP_GAP and b - lo <= limit:
            groups[-1].append(item)
            end = max(end, b)
        else:
            groups.append([item])
            lo, end = a, b
    return groups


@dataclass
class _File:
    """An open data file: a buffered descriptor, its size, an O_DIRECT one where usable, and
    its header (read once)."""

    fd: int
    size: int
    direct_fd: int | None
    data_start: int
    header: dict[str, object]
    layout: str | None  # what is wrong with how the header lays out the data (layout_mismatch)


class _OpenFiles:
    """Data files opened once per read, each header read once, sizes checked for each item."""

    def __init__(self, directory: Path, direct: bool) -> None:
        self.directory = directory
        self.direct = direct
        self._files: dict[str, _File] = {}

    def open(self, loc: ItemLocation, req: ReadItem) -> _File:
        if loc.file not in self._files:
            self._files[loc.file] = self._open(loc, req)
        file = self._files[loc.file]
        if loc.offset + loc.length > file.size:
            raise CheckpointCorruptError(
                f"checkpoint {self.directory}: data file {loc.file} is truncated: item "
                f"{req.storage_index.fqn!r} needs bytes {loc.offset}..{loc.offset + loc.length}, "
                f"the file has {file.size}"
            )
        return file

    def _open(self, loc: ItemLocation, req: ReadItem) -> _File:
        """Open a data file and check its header and size."""
        path = self.directory / loc.file
        what = f"checkpoint {self.directory}: data file {loc.file}"
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{what} is missing (item {req.storage_index.fqn!r} lives there)") from None
        except OSError as exc:  # a directory, a FIFO, a link, unreadable, ...
            raise CheckpointCorruptError(
                f"{what} {exc.strerror} (item {req.storage_index.fqn!r} lives there)") from None
        try:
            size = os.fstat(fd).st_size
            data_start, header = read_file_header(fd, size, what)
        except BaseException:
            os.close(fd)
            raise
        direct_fd = None
        if self.direct and not memory_backed(self.directory):
            try:
                direct_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT | os.O_NOFOLLOW)
            except OSError:
                direct_fd = None  # the file system refuses O_DIRECT: buffered reads only
        return _File(fd, size, direct_fd, data_start, header,
                     layout_mismatch(header, data_start, size))

    def check_layouts(self) -> None:
        """Raise for the first open file whose entries do not tile its data to its end."""
        for name, file in self._files.items():
            if file.layout is not None:
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory}: data file {name}: {file.layout}")

    def get(self, name: str) -> _File:
        return self._files[name]

    def close(self) -> None:
        for file in self._files.values():
            os.close(file.fd)
            if file.direct_fd is not None:
                os.close(file.direct_fd)
        self._files.clear()


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)
