"""GPU <-> host copies on side CUDA streams, made with cuda-python (``cuda.bindings.runtime``).

Without cuda-python or a GPU, ``available()`` is False and nothing here is used.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .host_cache import HostCache

try:
    from cuda.bindings import runtime as cudart
except ImportError:  # no cuda-python: the CPU paths are used
    cudart = None

log = logging.getLogger("dcp_datastates")
_announced = False
_batch_ok = True  # until the runtime refuses cudaMemcpyBatchAsync once
_unpin_queue: queue.SimpleQueue | None = None
_unpin_lock = threading.Lock()


def available() -> bool:
    """Whether GPU tensors can be copied through cuda-python here (logged once)."""
    global _announced
    ok = cudart is not None and torch.cuda.is_available()
    if not _announced and torch.cuda.is_available():
        _announced = True
        if cudart is None:
            log.warning("dcp_datastates: cuda-python is not installed; GPU tensors are copied "
                        "with torch (synchronously). pip install cuda-python")
    return ok


def _check(result: tuple, what: str) -> tuple:
    err, *rest = result
    if err != cudart.cudaError_t.cudaSuccess:
        msg = cudart.cudaGetErrorString(err)[1]
        raise RuntimeError(f"{what} failed: {err.name} ({msg.decode() if msg else ''})")
    return tuple(rest)


def pin(cache: HostCache) -> weakref.finalize:
    """Page-lock the cache for fast asynchronous copies (costs about 0.5 s per GiB).

    Returns the unpin call: run it to unpin early; it also runs when the cache is collected.
    Either way a worker thread unregisters the memory (no CUDA call runs inside garbage
    collection) and keeps it mapped until then, so a later mapping at the same address can be
    pinned again.
    """
    _check(cudart.cudaHostRegister(cache.addr, cache.nbytes, cudart.cudaHostRegisterPortable),
           "cudaHostRegister")
    return weakref.finalize(cache, _unpins().put, (cache.storage, cache.addr))


def _unpins() -> queue.SimpleQueue:
    """The queue of (storage, address) to unregister, served by one daemon thread."""
    global _unpin_queue
    with _unpin_lock:
        if _unpin_queue is None:
            _unpin_queue = queue.SimpleQueue()
            threading.Thread(target=_serve_unpins, args=(_unpin_queue,), name="dcp_unpin",
                             daemon=True).start()
        return _unpin_queue


def _serve_unpins(jobs: queue.SimpleQueue) -> None:
    while True:
        storage, addr = jobs.get()
        cudart.cudaHostUnregister(addr)
        del storage  # only now may the memory be unmapped


class SideStreams:
    """One non-blocking CUDA stream per device, and copies issued on them."""

    def __init__(self) -> None:
        self._streams: dict[int, object] = {}
        self._lock = threading.Lock()

    def stream(self, device: int) -> object:
        with self._lock:
            if device not in self._streams:
                _check(cudart.cudaSetDevice(device), "cudaSetDevice")
                (stream,) = _check(cudart.cudaStreamCreateWithFlags(
                    cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
                self._streams[device] = stream
            return self._streams[device]

    def _copy_batch(self, copies: list[tuple[int, int, int]], stream: object) -> bool:
        """Issue ``copies`` in one ``cudaMemcpyBatchAsync`` call; False where it is missing."""
        global _batch_ok
        if not _batch_ok:
            return False
        dsts, srcs, sizes = (list(col) for col in zip(*copies, strict=True))
        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        try:
            err, *_ = cudart.cudaMemcpyBatchAsync(
                dsts, srcs, sizes, len(copies), [attrs], [0], 1, stream)
        except (AttributeError, TypeError) as exc:  # cuda-python or runtime without the batch API
            err, reason = None, exc
        else:
            reason = err
        if err == cudart.cudaError_t.cudaSuccess:
            return True
        _batch_ok = False
        log.info("dcp_datastates: cudaMemcpyBatchAsync unavailable (%s); copying one by one",
                 reason)
        cudart.cudaGetLastError()  # clear a sticky-free error before the fallback
        return False

    def record_current(self, devices: set[int]) -> dict[int, object]:
        """On the calling thread: an event on each device's current torch stream."""
        events = {}
        for device in devices:
            _check(cudart.cudaSetDevice(device), "cudaSetDevice")
            (event,) = _check(cudart.cudaEventCreateWithFlags(
                cudart.cudaEventDisableTiming), "cudaEventCreateWithFlags")
            current = torch.cuda.current_stream(device).cuda_stream
            _check(cudart.cudaEventRecord(event, current), "cudaEventRecord")
            events[device] = event
        return events

    def copy(self, pairs: list[tuple[int, int, int, int]], kind: str,
             after: dict[int, object] | None = None) -> None:
        """Copy ``(device, dst, src, nbytes)`` pairs on the side streams; wait for them.

        ``kind`` is ``"d2h"`` or ``"h2d"``; ``after`` holds events the copies must wait for.
        """
        direction = (cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost if kind == "d2h"
                     else cudart.cudaMemcpyKind.cudaMemcpyHostToDevice)
        by_device: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for device, dst, src, nbytes in pairs:
            by_device[device].append((dst, src, nbytes))
        done = []
        for device, copies in by_device.items():
            stream = self.stream(device)
            _check(cudart.cudaSetDevice(device), "cudaSetDevice")
            if after and device in after:
                _check(cudart.cudaStreamWaitEvent(stream, after[device], 0), "cudaStreamWaitEvent")
            if len(copies) == 1 or not self._copy_batch(copies, stream):
                for dst, src, nbytes in copies:
                    _check(cudart.cudaMemcpyAsync(dst, src, nbytes, direction, stream),
                           "cudaMemcpyAsync")
            (event,) = _check(cudart.cudaEventCreateWithFlags(
                cudart.cudaEventDisableTiming), "cudaEventCreateWithFlags")
            _check(cudart.cudaEventRecord(event, stream), "cudaEventRecord")
            done.append(event)
        for event in done + list((after or {}).values()):
            _check(cudart.cudaEventSynchronize(event), "cudaEventSynchronize")
            _check(cudart.cudaEventDestroy(event), "cudaEventDestroy")
