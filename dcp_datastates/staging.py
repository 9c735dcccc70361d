"""Host snapshots of state dicts: every tensor copied into a region of the host cache.

``Stager.stage`` walks the state dict on the caller's thread (copying its structure and any
non-tensor values, which are cheap) and leaves the tensor copies to a background thread, so it
returns at once with a Future of the staged state dict. Each staged tensor keeps its cache region
until it is flushed or dropped. When the cache is full, staging waits for earlier snapshots'
flushes to free space (backpressure); a tensor that cannot fit even then is copied to ordinary
(pageable) memory instead, so a state larger than the cache is still saved, only slower.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from .cuda_copy import SideStreams
from .host_cache import Pool, Region
from .sizes import format_size
from .stats import SaveStats

log = logging.getLogger("dcp_datastates")

@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass(frozen=True)
class _DTensorSlot:
    index: int
    source: DTensor


@dataclass
class Snapshot:
    """The cache regions one staged state dict holds."""

    stats: SaveStats
    regions: list[Region] = field(default_factory=list)

    def held(self) -> int:
        return sum(r.capacity for r in self.regions if not r.released)


class Stager:
    """Stages state dicts into a pool of the host cache on one background thread.

    GPU tensors are copied with ``cudaMemcpyAsync`` on a side stream (``streams``) that first
    waits for an event recorded on the training stream when ``stage`` is called; without
    ``streams`` (no cuda-python) torch copies them.
    """

    def __init__(self, pool: Pool, streams: SideStreams | None = None) -> None:
        self.pool = pool
        self.streams = streams
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-stage")
        self._lock = threading.Lock()
        self._by_addr: dict[int, Region] = {}

    def stage(self, state_dict: dict, stats: SaveStats) -> Future:
        """Return a Future of a copy of ``state_dict`` whose tensors live in host memory.

        The Future completes when every copy is done; until then the sources stay referenced,
        so the CUDA caching allocator cannot hand their memory to other work. The snapshot's
        figures go to ``stats``.
        """
        sources: list[torch.Tensor] = []
        skeleton = _walk(state_dict, sources, {})
        devices = {t.device.index for t in sources if t.is_cuda}
        ready = self.streams.record_current(devices) if devices and self.streams else None
        return self._executor.submit(self._fill, skeleton, sources, ready, stats)

    def region_of(self, tensor: torch.Tensor) -> Region | None:
        """The live region that ``tensor`` starts and exactly fills, if it is a staged copy."""
        region = self._by_addr.get(tensor.data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        if region is None or region.released or region.nbytes != nbytes:
            return None
        return region

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _fill(self, skeleton: object, sources: list[torch.Tensor], ready: dict | None,
              stats: SaveStats) -> dict:
        snapshot = Snapshot(stats)
        staged = [self._host_copy(src, snapshot) for src in sources]
        gpu = []
        for dst, src in zip(staged, sources, strict=True):
            if src.is_cuda and self.streams is not None:
                gpu.append((src.device.index, dst.data_ptr(), src.data_ptr(), dst.nbytes))
            elif src.numel():
                dst.copy_(src)
        if ready is not None:
            self.streams.copy(gpu, "d2h", after=ready)
        stats.snapshot_s = time.perf_counter() - stats.start
        if stats.overflow_bytes:
            log.warning(
                "dcp_datastates: state of %s exceeds the free host cache (%s); %s staged in "
                "pageable memory (slower). Raise host_cache_size to keep snapshots in the cache.",
                format_size(stats.staged_bytes + stats.overflow_bytes),
                format_size(self.pool.capacity),
                format_size(stats.overflow_bytes),
            )
        return _rebuild(skeleton, staged)

    def _host_copy(self, src: torch.Tensor, snapshot: Snapshot) -> torch.Tensor:
        nbytes = src.numel() * src.element_size()
        region = self._allocate(nbytes, snapshot) if nbytes else None
        if region is None:
            snapshot.stats.overflow_bytes += nbytes
            return torch.empty(src.shape, dtype=src.dtype)
        region.zero_tail()
        snapshot.regions.append(region)
        snapshot.stats.staged_bytes += nbytes
        dst = region.own_storage_tensor(src.dtype, src.shape)
        with self._lock:
            self._by_addr[region.addr] = region
        weakref.finalize(dst, self._forget, region)
        return dst

    def _allocate(self, nbytes: int, snapshot: Snapshot) -> Region | None:
        region = self.pool.try_allocate(nbytes)
        while region is None and self.pool.used > snapshot.held():
            self.pool.wait_for_release(0.5)
            region = self.pool.try_allocate(nbytes)
        return region

    def _forget(self, region: Region) -> None:
        with self._lock:
            if self._by_addr.get(region.addr) is region:
                del self._by_addr[region.addr]
        region.release()


def _walk(obj: object, sources: list[torch.Tensor], memo: dict[int, object]) -> object:
    """Copy the structure of ``obj``; tensors become slots numbering ``sources``.

    Only dicts and lists are entered, as DCP does: anything else (tuples included) DCP pickles
    whole as a bytes item, so it is deep-copied whole here, never pointed into the cache.
    """
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, DTensor):
        out: object = _DTensorSlot(len(sources), obj)
        local = obj.to_local().detach()
        sources.append(local.contiguous() if local.is_cuda else local)
    elif isinstance(obj, torch.Tensor):
        out = _Slot(len(sources))
        tensor = obj.detach()
        sources.append(tensor.contiguous() if tensor.is_cuda else tensor)
    elif isinstance(obj, dict):
        out = {k: _walk(v, sources, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [_walk(v, sources, memo) for v in obj]
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


def _rebuild(obj: object, staged: list[torch.Tensor]) -> object:
    if isinstance(obj, _Slot):
        return staged[obj.index]
    if isinstance(obj, _DTensorSlot):
        src = obj.source
        return DTensor.from_local(
            staged[obj.index], src.device_mesh, src.placements, run_check=False,
            shape=src.shape, stride=src.stride(),
        )
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, staged) for v in obj]
    return obj
