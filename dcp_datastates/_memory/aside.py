"""A snapshot's temporary place while the memory it goes to is still being made.

The first save of a process finds no host cache: mapping, populating and pinning it takes
seconds for a few GiB. Rather than make training wait for that, :func:`stash` copies the
sources aside at once: GPU tensors into one GPU buffer per device (a device-to-device copy,
the fastest there is) where the device has room to spare, else into pageable host memory, as
CPU tensors are. Training may change the sources as soon as it returns; the job moves the
copies into the cache once it is ready and then calls :meth:`Aside.free`. A copy of a GPU
source into pageable memory is slow (a fraction of pinned speed): :func:`fits_on_gpu` tells a job
whether it would come to that (a save into a memory-tier slot then waits for its slot
instead), and :func:`room_for` whether a snapshot of some size would stay on the GPU (the
memory tier's budget asks before it takes a save whose slot is not made yet).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._cuda.cuda_copy import Copy, CudaCopier
from .host_cache import MEMMOVE_BYTES, nbytes_of, set_storage

#: A GPU buffer aside is made only where this fraction of the device's memory stays free
#: after it (room for training's own allocations).
GPU_HEADROOM = 0.1
#: Every copy starts on this boundary of its buffer (aligned for any dtype and fast copies).
_ALIGN = 256
#: Where host copies go (a place is a device index, or this for pageable host memory).
HOST = -1
#: A device's (free, total) bytes, as :func:`room_on` gives them.
MemInfo = Callable[[int], tuple[int, int]]


def room_on(device: int) -> tuple[int, int]:
    """(free, total) bytes of ``device`` for a buffer aside: what the driver has free, and what
    torch's caching allocator holds in segments no tensor uses (an earlier snapshot's buffer
    aside goes back there; torch reuses or releases such segments for a new buffer)."""
    try:
        stats = torch.cuda.memory_stats(device)
    except RuntimeError:  # an allocator backend without statistics: the driver's figure alone
        stats = {}
    return room_in(torch.cuda.mem_get_info(device), stats)


#: ``torch.cuda.memory_stats`` keys of the bytes reserved by private pools (CUDA graphs,
#: ``torch.cuda.MemPool``), one per pool: ``<prefix><pool id>.all.current``.
_PRIVATE_POOLS = "reserved_bytes_by_private_pools."


def room_in(info: tuple[int, int], stats: dict) -> tuple[int, int]:
    """:func:`room_on` from the driver's ``(free, total)`` and the allocator's ``stats`` (as
    ``torch.cuda.memory_stats`` gives them). Segments of private pools do not count: a CUDA
    graph's replays use them, and torch releases them only once the pool is gone (the torch
    versions that report them per pool; the others count them)."""
    free, total = info
    private = sum(v for k, v in stats.items()
                  if k.startswith(_PRIVATE_POOLS) and k.endswith(".all.current"))
    idle = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
            - stats.get("inactive_split_bytes.all.current", 0) - private)
    return free + max(0, idle), total


@dataclass
class Aside:
    """Copies of a snapshot's sources (``views``: same shapes and dtypes, contiguous) in
    buffers of their own, held until :meth:`free`."""

    views: list[torch.Tensor]
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # place -> buffer

    @property
    def gpu_bytes(self) -> int:
        return sum(b.numel() for p, b in self.buffers.items() if p != HOST)

    @property
    def host_bytes(self) -> int:
        return self.buffers[HOST].numel() if HOST in self.buffers else 0

    def free(self) -> None:
        """Let the buffers go (GPU ones back to torch's caching allocator); idempotent."""
        self.views = []
        self.buffers = {}


def stash(sources: list[torch.Tensor], cuda: CudaCopier | None,
          ready: dict[int, object] | None, gpu_headroom: float = GPU_HEADROOM,
          issued: Callable[[dict[int, object] | None], None] | None = None) -> Aside:
    """Copy ``sources`` aside (GPU copies after the ``ready`` events) and wait for the copies.
    A GPU buffer is made where ``gpu_headroom`` of the device's memory stays free after it.
    ``issued``: as in :meth:`CudaCopier.copy`, for the copies on the GPU (made last: the
    copies into pageable memory are over by then)."""
    places = _places(sources, cuda, gpu_headroom, room_on)
    offsets, sizes = _pack(sources, places)
    buffers = {p: torch.empty(n, dtype=torch.uint8,
                              device="cpu" if p == HOST else torch.device("cuda", p))
               for p, n in sizes.items()}
    aside = Aside([], buffers)
    copies: dict[str, list[Copy]] = {"d2h": [], "d2d": []}
    for src, place, offset in zip(sources, places, offsets, strict=True):
        view = _view(buffers.get(place), offset, src)
        aside.views.append(view)
        n = nbytes_of(src)
        if n == 0:
            continue
        if src.is_cuda and cuda is not None:
            kind = "d2h" if place == HOST else "d2d"
            copies[kind].append((src.device.index, view.data_ptr(), src.data_ptr(), n))
        elif n < MEMMOVE_BYTES and not src.is_cuda and src.is_contiguous():
            ctypes.memmove(view.data_ptr(), src.data_ptr(), n)
        else:
            view.copy_(src)
    if copies["d2h"] or copies["d2d"]:
        assert cuda is not None  # copies are listed only where cuda is given
        if copies["d2h"]:
            cuda.copy(copies["d2h"], "d2h", after=ready)
        if copies["d2d"]:
            cuda.copy(copies["d2d"], "d2d", after=ready, issued=issued)
    return aside


def fits_on_gpu(sources: list[torch.Tensor], cuda: CudaCopier | None,
                headroom: float = GPU_HEADROOM, mem_info: MemInfo | None = None) -> bool:
    """Whether :func:`stash` would keep every GPU source of ``sources`` on its device (none
    in pageable host memory; CPU sources do not count). ``mem_info``: a device's free and
    total bytes (:func:`room_on` by default)."""
    places = _places(sources, cuda, headroom, mem_info or room_on)
    return all(p != HOST for src, p in zip(sources, places, strict=True) if src.is_cuda)


def room_for(nbytes: int, cuda: CudaCopier | None, headroom: float = GPU_HEADROOM,
             mem_info: MemInfo | None = None) -> bool:
    """Whether the current CUDA device has room to keep ``nbytes`` of GPU sources aside, as
    :func:`stash` would place them (False without cuda-python: nothing goes aside on a GPU)."""
    if cuda is None:
        return False
    return _has_room((mem_info or room_on)(torch.cuda.current_device()), nbytes, headroom)


def _places(sources: list[torch.Tensor], cuda: CudaCopier | None, headroom: float,
            mem_info: MemInfo) -> list[int]:
    """Each source's place: its device where cuda-python copies it and the device has room
    for all of that device's sources, else :data:`HOST`."""
    need: dict[int, int] = {}
    for src in sources:
        if src.is_cuda and cuda is not None:
            need[src.device.index] = need.get(src.device.index, 0) + _padded(src)
    room = {d: _has_room(mem_info(d), n, headroom) for d, n in need.items()}
    return [src.device.index if src.is_cuda and room.get(src.device.index) else HOST
            for src in sources]


def _has_room(info: tuple[int, int], nbytes: int, headroom: float) -> bool:
    free, total = info
    return free - nbytes >= headroom * total


def _padded(src: torch.Tensor) -> int:
    return -(-nbytes_of(src) // _ALIGN) * _ALIGN


def _pack(sources: list[torch.Tensor], places: list[int]) -> tuple[list[int], dict[int, int]]:
    """Each source's offset in its place's buffer, and each buffer's size."""
    sizes: dict[int, int] = {}
    offsets = []
    for src, place in zip(sources, places, strict=True):
        offsets.append(sizes.get(place, 0))
        sizes[place] = offsets[-1] + _padded(src)
    return offsets, {p: n for p, n in sizes.items() if n}


def _view(buffer: torch.Tensor | None, offset: int, src: torch.Tensor) -> torch.Tensor:
    """``src``'s shape and dtype over ``buffer`` at ``offset`` (a fresh empty tensor for an
    empty source)."""
    if buffer is None or src.numel() == 0:
        return torch.empty(src.shape, dtype=src.dtype)
    return set_storage(torch.empty(0, dtype=src.dtype, device=buffer.device),
                       buffer.untyped_storage(), offset // src.element_size(), src.shape)
