"""``DataStatesReader``: a DCP StorageReader for checkpoints that DataStatesWriter saved."""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from . import cuda_copy
from .checksums import memory_at, verify_span
from .cuda_copy import SideStreams
from .errors import CheckpointCorruptError
from .file_format import read_header
from .file_writer import memory_backed
from .host_cache import HostCache, Region, round_up
from .io import ALIGN, IOBackend, IOReq, get_backend
from .metadata_file import ItemLocation, read_metadata
from .sizes import parse_size
from .stats import LoadStats


class DataStatesReader(StorageReader):
    """Loads DCP checkpoints written by :class:`DataStatesWriter`, resharding included.

    Args:
        path: checkpoint directory; may instead be given as ``checkpoint_id`` to ``dcp.load``.
        io_backend: ``"auto"``, ``"uring"`` or ``"threads"`` (``DCP_DATASTATES_IO`` overrides).
        verify_checksums: check every byte read against the checksums in ``.metadata``.
        io_workers: items read at once.
        host_cache_size: pinned host memory (bytes or ``"1GiB"``) that GPU restores read into
            before their host-to-device copies. One such cache serves every reader of the
            process (the largest size asked for); on GPU hosts it is pinned in the background
            when the first reader is made.
        direct_io: read GPU restores with O_DIRECT (straight from the disk into pinned memory,
            many requests in flight) where the file system allows it.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        io_backend: str = "auto",
        verify_checksums: bool = True,
        io_workers: int = 8,
        host_cache_size: int | str = "1GiB",
        direct_io: bool = True,
    ) -> None:
        super().__init__()
        self.host_cache_size = parse_size(host_cache_size, name="host_cache_size")
        self.direct_io = direct_io
        if cuda_copy.available() and _restore is None:
            threading.Thread(target=self._gpu_path, name="dcp_read_init", daemon=True).start()
        self.path = Path(path) if path is not None else None
        self.io_backend = io_backend
        self.verify_checksums = verify_checksums
        self.io_workers = io_workers
        self.load_id = str(uuid.uuid4())
        self.metadata: Metadata | None = None
        self._metadata: Metadata | None = None  # read by reset(), handed out once
        self._stats: LoadStats | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point at ``checkpoint_id`` and read its ``.metadata`` now.

        Reading here, rather than only in ``read_metadata``, lets a missing or damaged
        checkpoint raise its own clear error: some torch versions replace errors from
        ``read_metadata`` with "metadata is None".
        """
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self._metadata = self._read_checked() if checkpoint_id is not None else None

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = self._metadata or self._read_checked()
        self._metadata = None
        return metadata

    def _read_checked(self) -> Metadata:
        metadata = read_metadata(self._checkpoint_dir())
        _check_locations(self._checkpoint_dir(), metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object
    ) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        backend = get_backend(self.io_backend)
        stats = LoadStats(backend.name, verified=self.verify_checksums)
        start = time.perf_counter()
        files = _OpenFiles(self._checkpoint_dir(), self.direct_io)
        try:
            with ThreadPoolExecutor(self.io_workers, "dcp_datastates-read") as pool:
                jobs = []
                for req in plan.items:
                    loc = self._location(req)
                    f = files.open(loc, req)
                    if req.type == LoadItemType.BYTE_IO:
                        target = None
                        job = pool.submit(self._read_bytes, backend, f, loc, req)
                    else:
                        target = planner.resolve_tensor(req).detach()
                        job = pool.submit(self._read_tensor, backend, f, loc, req, target)
                    jobs.append((req, target, job))
                for req, target, job in jobs:
                    data = job.result()
                    if target is None:
                        stats.bytes_read += len(data)
                        planner.load_bytes(req, io.BytesIO(data))
                    else:
                        stats.bytes_read += target.numel() * target.element_size()
                        planner.commit_tensor(req, target)
        finally:
            files.close()
        stats.seconds = time.perf_counter() - start
        self._stats = stats
        stats.log()
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def last_stats(self) -> LoadStats | None:
        """Figures of the latest load on this rank (bytes, seconds, GiB/s, backend)."""
        return self._stats

    @property
    def checkpoint_id(self) -> Path | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return (Path(checkpoint_id) / ".metadata").is_file()

    # -- internals ------------------------------------------------------------------------------
    def _checkpoint_dir(self) -> Path:
        if self.path is None:
            raise ValueError(
                "no checkpoint directory: pass path= to DataStatesReader or checkpoint_id= to "
                "dcp.load"
            )
        return self.path

    def _location(self, req: ReadItem) -> ItemLocation:
        assert self.metadata is not None, "read_data before set_up_storage_reader"
        loc = self.metadata.storage_data.get(req.storage_index)
        if not isinstance(loc, ItemLocation):
            raise CheckpointCorruptError(
                f"checkpoint {self.path}: .metadata has no location for item "
                f"{req.storage_index.fqn!r}"
            )
        return loc

    def _describe(self, loc: ItemLocation, req: ReadItem) -> str:
        return f"checkpoint {self.path}, file {loc.file}, item {req.storage_index.fqn!r}"

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
                     target: torch.Tensor) -> None:
        md = self.metadata.state_dict_metadata.get(req.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointCorruptError(f"{self._describe(loc, req)}: not a tensor in .metadata")
        shape = _chunk_shape(md, req, self._describe(loc, req))
        dtype = md.properties.dtype
        itemsize = dtype.itemsize
        if math.prod(shape) * itemsize != loc.length:
            raise CheckpointCorruptError(
                f"{self._describe(loc, req)}: {loc.length} bytes stored for a {dtype} chunk of "
                f"shape {list(shape)}"
            )
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        row = math.prod(shape[1:]) * itemsize
        a, b = (offsets[0] * row, (offsets[0] + lengths[0]) * row) if shape else (0, loc.length)
        whole_rows = offsets[1:] == [0] * (len(shape) - 1) and lengths[1:] == list(shape[1:])
        direct = (  # the request is the target's bytes, in order: no reshaping copy needed
            target.is_contiguous() and target.dtype == dtype and whole_rows
            and target.numel() * itemsize == b - a
        )
        if direct and target.is_cuda and self._gpu_path() is not None:
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


    def _gpu_path(self) -> tuple[HostCache, SideStreams] | None:
        """The process's pinned restore cache and side streams (None without CUDA)."""
        return _restore_path(self.host_cache_size)

    def _read_to_gpu(self, backend: IOBackend, f: _File, loc: ItemLocation, a: int, b: int,
                     req: ReadItem, target: torch.Tensor) -> None:
        """Item bytes ``[a, b)`` -> pinned extents -> ``cudaMemcpyAsync`` into ``target``.

        Extents are whole checksum blocks, so each is verified on its own before its copy.
        """
        cache, streams = self._gpu_path()
        pool, block = cache.bounce, loc.block
        lo, hi = a, b
        if self.verify_checksums:
            lo, hi = a - a % block, min(loc.length, -(-b // block) * block)
        extent = max(block, pool.capacity // max(self.io_workers, 1) // block * block)
        for s in range(lo, hi, extent):
            e = min(s + extent, hi)
            region = pool.allocate(e - s)
            try:
                buf = region.as_tensor(e - s)
                self._read_extent(backend, f, loc, s, region, req)
                if self.verify_checksums:
                    verify_span([(s, memory_at(buf.data_ptr(), e - s))], loc.checksums, block,
                                loc.length, self._describe(loc, req))
                c0, c1 = max(s, a), min(e, b)
                if c0 < c1:
                    streams.copy([(target.device.index, target.data_ptr() + c0 - a,
                                   region.addr + c0 - s, c1 - c0)], "h2d")
            finally:
                region.release()

    def _read_extent(self, backend: IOBackend, f: _File, loc: ItemLocation, s: int,
                     region: Region, req: ReadItem) -> None:
        """Item bytes ``[s, s + region.nbytes)`` into ``region``: O_DIRECT for the aligned body.

        The body is read in whole 4 KiB blocks (the region has room for the rounding), up to
        the file's last whole block; what is left (the file's tail) is read buffered.
        """
        start, end = loc.offset + s, loc.offset + s + region.nbytes
        body_end = start
        if f.direct_fd is not None and start % ALIGN == 0:
            body_end = max(start, min(round_up(end), f.size - f.size % ALIGN))
        try:
            if body_end > start:
                backend.read(f.direct_fd, loc.file, [IOReq(region.addr, body_end - start, start)])
            if body_end < end:
                backend.read(f.fd, loc.file,
                             [IOReq(region.addr + body_end - start, end - body_end, body_end)])
        except OSError as exc:
            raise CheckpointCorruptError(f"{self._describe(loc, req)}: {exc}") from exc


#: Bytes read at first to check a data file's header (most headers are much shorter).
HEAD_BYTES = 64 << 10

_restore: tuple[HostCache, SideStreams] | None = None
_restore_lock = threading.Lock()


def _restore_path(nbytes: int) -> tuple[HostCache, SideStreams] | None:
    """The pinned restore cache (at least ``nbytes``) shared by the process's readers."""
    global _restore
    if not cuda_copy.available():
        return None
    with _restore_lock:
        if _restore is None or _restore[0].nbytes < nbytes:
            cache = HostCache(nbytes, bounce_only=True)
            cuda_copy.pin(cache)  # unpinned when a larger one replaces it, or at exit
            _restore = (cache, _restore[1] if _restore else SideStreams())
        return _restore


@dataclass
class _File:
    """An open data file: a buffered descriptor, its size, and an O_DIRECT one where usable."""

    fd: int
    size: int
    direct_fd: int | None


class _OpenFiles:
    """Data files opened once per read, with their sizes checked against each item."""

    def __init__(self, directory: Path, direct: bool) -> None:
        self.directory = directory
        self.direct = direct
        self._files: dict[str, _File] = {}

    def open(self, loc: ItemLocation, req: ReadItem) -> _File:
        if loc.file not in self._files:
            path = self.directory / loc.file
            try:
                # O_NONBLOCK: a FIFO planted under a data file's name must not hang the open
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory}: data file {loc.file} is missing (item "
                    f"{req.storage_index.fqn!r} lives there)"
                ) from None
            except OSError as exc:  # a directory, unreadable, ...: not a usable data file
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory}: cannot open data file {loc.file} (item "
                    f"{req.storage_index.fqn!r} lives there): {exc}"
                ) from exc
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise CheckpointCorruptError(
                    f"checkpoint {self.directory}: data file {loc.file} is not a regular file "
                    f"(item {req.storage_index.fqn!r} lives there)"
                )
            os.set_blocking(fd, True)  # io_uring would answer EAGAIN on an O_NONBLOCK file
            self._check_header(fd, st.st_size, loc, req)
            direct_fd = None
            if self.direct and not memory_backed(self.directory):
                try:
                    direct_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
                except OSError:
                    direct_fd = None  # the file system refuses O_DIRECT: buffered reads only
            self._files[loc.file] = _File(fd, st.st_size, direct_fd)
        file = self._files[loc.file]
        if loc.offset + loc.length > file.size:
            raise CheckpointCorruptError(
                f"checkpoint {self.directory}: data file {loc.file} is truncated: item "
                f"{req.storage_index.fqn!r} needs bytes {loc.offset}..{loc.offset + loc.length}, "
                f"the file has {file.size}"
            )
        return file

    def _check_header(self, fd: int, size: int, loc: ItemLocation, req: ReadItem) -> None:
        """Refuse a data file whose safetensors header is malformed, or shorter than ``loc``."""
        what = f"checkpoint {self.directory}: data file {loc.file}"
        head = os.pread(fd, HEAD_BYTES, 0)
        try:
            try:
                data_start, _ = read_header(head, what, size)
            except CheckpointCorruptError:
                if len(head) < HEAD_BYTES:
                    raise
                (n,) = struct.unpack("<Q", head[:8])  # a long header: read all of it once
                data_start, _ = read_header(os.pread(fd, 8 + min(n, size), 0), what, size)
        except CheckpointCorruptError:
            os.close(fd)
            raise
        if loc.offset < data_start:
            os.close(fd)
            raise CheckpointCorruptError(f"{what}: offset {loc.offset} lies inside the header")

    def close(self) -> None:
        for file in self._files.values():
            os.close(file.fd)
            if file.direct_fd is not None:
                os.close(file.direct_fd)
        self._files.clear()


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _chunk_shape(md: TensorStorageMetadata, req: ReadItem, what: str) -> tuple[int, ...]:
    offset = req.storage_index.offset
    for chunk in md.chunks:
        if offset is None or tuple(chunk.offsets) == tuple(offset):
            return tuple(chunk.sizes)
    raise CheckpointCorruptError(f"{what}: no stored chunk at offsets {offset}")


def _check_locations(directory: Path, metadata: Metadata) -> None:
    """Reject locations that point outside the checkpoint directory or make no sense."""
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptError(f"{directory}/.metadata: storage data is not a mapping")
    for index, loc in metadata.storage_data.items():
        if not isinstance(loc, ItemLocation):
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has no DataStates location; was "
                f"this checkpoint written by another storage writer?"
            )
        name_ok = isinstance(loc.file, str) and loc.file not in ("", ".", "..") and (
            "/" not in loc.file and "\\" not in loc.file and "\0" not in loc.file
        )
        numbers_ok = all(_is_int(v) for v in (loc.offset, loc.length, loc.block)) and (
            loc.offset >= 0 and loc.length >= 0 and loc.block > 0
        )
        if not name_ok or not numbers_ok:
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has an invalid location {loc!r}"
            )
        checksums = loc.checksums
        need = max(1, -(-loc.length // loc.block))
        if (
            not isinstance(checksums, (tuple, list))
            or len(checksums) != need
            or not all(_is_int(c) for c in checksums)
        ):
            count = len(checksums) if isinstance(checksums, (tuple, list)) else type(checksums)
            raise CheckpointCorruptError(
                f"{directory}/.metadata: item {index.fqn!r} has {count} checksums where its "
                f"{loc.length} bytes in blocks of {loc.block} need {need}"
            )


def _is_int(value: object) -> bool:
    return type(value) is int  # bools are not offsets or lengths
