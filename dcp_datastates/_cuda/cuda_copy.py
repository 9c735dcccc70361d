"""GPU <-> host copies on side CUDA streams, made with cuda-python (``cuda.bindings.runtime``).

:class:`CudaCopier` is owned by the engine: its streams, and the pinning of the engine's arenas,
live as long as the engine. Without cuda-python or a GPU, :func:`available` is False and
nothing here is used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from .gpu_sums import GpuHashes, GpuSums, blocks_of

try:  # the optional ``gpu`` extra; imported with the package, not at the first save
    from cuda.bindings import runtime as cudart  # loads the bindings only: no CUDA call
except (ImportError, OSError):  # no cuda-python: GPU tensors are copied with torch
    cudart = None

log = logging.getLogger("dcp_datastates")

#: Host memory is pinned in pieces at multiples of this address (a ``cudaHostRegister`` call
#: holds the driver's lock while it runs: one call for gigabytes stalls a training thread's
#: CUDA calls for as long; ``benchmarks/probe_pin_stall.py`` measures it).
PIN_PIECE = 64 << 20
#: Shortest pause between two pieces; each pause lasts at least as long as the piece took, so
#: that the training's CUDA calls get the driver's lock at least half of the time (a short
#: fixed pause let the steps slow down several times while a slot was pinned: RESULTS.md at
#: 1d2b20c).
PIN_PAUSE_S = 0.0005

#: One copy: (device, destination address, source address, bytes).
Copy = tuple[int, int, int, int]
#: The copy kinds of :meth:`CudaCopier.copy`.
_KINDS = {"d2h": "cudaMemcpyDeviceToHost", "h2d": "cudaMemcpyHostToDevice",
          "d2d": "cudaMemcpyDeviceToDevice"}
#: The kinds of copy already queued on a device whose end a new copy of a kind waits for (on
#: the GPU): a load's copy to the device (which overwrites tensors) waits for every copy that
#: may still read them, a save's for a load's; only a copy aside (device to device) skips the
#: moves to host memory queued before it (both just read their sources).
_AFTER = {"h2d": ("d2h", "d2d"), "d2h": ("h2d", "d2d"), "d2d": ("h2d",)}


def available() -> bool:
    """Whether GPU tensors can be copied through cuda-python here."""
    return cudart is not None and torch.cuda.is_available()


def why_unavailable() -> str | None:
    """Why a GPU host copies with torch instead (None where cuda-python is used or no GPU)."""
    if cudart is None and torch.cuda.is_available():
        return ("cuda-python is not installed; GPU tensors are copied with torch "
                "(synchronously). pip install cuda-python")
    return None


def _pieces(addr: int, nbytes: int) -> list[tuple[int, int]]:
    """(address, bytes) of the parts of a range cut at multiples of :data:`PIN_PIECE` (the
    pieces that ``CudaCopier.pin`` registers one by one)."""
    out, end = [], addr + nbytes
    while addr < end:
        cut = min(end, (addr // PIN_PIECE + 1) * PIN_PIECE)
        out.append((addr, cut - addr))
        addr = cut
    return out


def _by_device(copies: list[Copy], kind: str) -> dict[int, list[tuple[int, int, int]]]:
    """Each device's copies (destination, source, bytes), cut where a host range spans more
    than one pinned piece (a copy stays within one registration)."""
    by_device: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for device, dst, src, nbytes in copies:
        host = dst if kind == "d2h" else src if kind == "h2d" else None
        if host is None or host // PIN_PIECE == (host + nbytes - 1) // PIN_PIECE:
            by_device[device].append((dst, src, nbytes))
            continue
        for at, n in _pieces(host, nbytes):
            by_device[device].append((dst + at - host, src + at - host, n))
    return by_device


def _check(result: tuple, what: str) -> tuple:
    err, *rest = result
    if err != cudart.cudaError_t.cudaSuccess:
        msg = cudart.cudaGetErrorString(err)[1]
        raise RuntimeError(f"{what} failed: {err.name} ({msg.decode() if msg else ''})")
    return tuple(rest)


class CudaCopier:
    """A non-blocking CUDA stream per device and kind of copy, copies issued on them (with the
    checksums of their sources, on request), and host pinning. A snapshot's copy aside (device
    to device, which the training's next step waits for) does not wait for an earlier
    snapshot's move to host memory; every other copy waits on the GPU for the copies of the
    other kinds issued before it (``_AFTER``: a load into tensors a save still reads).
    ``sums``: the checksum kernels (tests inject failing ones)."""

    def __init__(self, sums: GpuSums | None = None) -> None:
        self._streams: dict[tuple[int, str], object] = {}  # (device, kind) -> stream
        self._lock = threading.Lock()
        self._batch_ok = True  # until the runtime refuses cudaMemcpyBatchAsync once
        self.sums = sums or GpuSums()
        if torch.cuda.is_initialized():  # compiled before the first save where it can be
            self.sums.prime(torch.cuda.current_device())

    @staticmethod
    def pin(addr: int, nbytes: int) -> None:
        """Page-lock host memory for fast asynchronous copies (a cost that grows with the
        size: seconds for many GiB), one :data:`PIN_PIECE` at a time with a pause as long as
        the piece took: each ``cudaHostRegister`` holds the driver's lock, so other threads'
        CUDA calls (the training's) wait for one piece at most, and get the lock half of the
        time. :meth:`copy` splits copies at the pieces' bounds (a copy may not span two
        registrations)."""
        done = 0
        try:
            for at, n in _pieces(addr, nbytes):
                start = time.perf_counter()
                _check(cudart.cudaHostRegister(at, n, cudart.cudaHostRegisterPortable),
                       "cudaHostRegister")
                done += n
                # let waiting threads have the driver's lock as long as this piece held it
                time.sleep(max(PIN_PAUSE_S, time.perf_counter() - start))
        except BaseException:  # a failure or an interrupt: no piece stays registered
            for at, _ in _pieces(addr, done):
                cudart.cudaHostUnregister(at)
            raise

    @staticmethod
    def unpin(addr: int, nbytes: int) -> None:
        """Undo :meth:`pin` of the same range (every piece, even after one fails); call before
        the memory is unmapped."""
        errors = [cudart.cudaHostUnregister(at) for at, _ in _pieces(addr, nbytes)]
        for result in errors:
            _check(result, "cudaHostUnregister")

    def stream(self, device: int, kind: str) -> object:
        """The stream of ``device`` that copies of ``kind`` are issued on."""
        with self._lock:
            if (device, kind) not in self._streams:
                _check(cudart.cudaSetDevice(device), "cudaSetDevice")
                (stream,) = _check(cudart.cudaStreamCreateWithFlags(
                    cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
                self._streams[device, kind] = stream
            return self._streams[device, kind]

    def _after_other_kinds(self, device: int, kind: str, stream: object) -> None:
        """Make ``stream`` wait (on the GPU) for the copies queued so far on ``device``'s
        streams of the kinds in ``_AFTER[kind]``: one stream per device once kept every kind
        in issue order, and a load into tensors that a save still copies relies on that."""
        with self._lock:
            others = [self._streams[device, k] for k in _AFTER[kind]
                      if (device, k) in self._streams]
        for other in others:
            (event,) = _check(cudart.cudaEventCreateWithFlags(
                cudart.cudaEventDisableTiming), "cudaEventCreateWithFlags")
            try:
                _check(cudart.cudaEventRecord(event, other), "cudaEventRecord")
                _check(cudart.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")
            finally:
                cudart.cudaEventDestroy(event)  # released once the GPU has passed it

    def close(self) -> None:
        """Destroy the streams and the checksum kernels (no copy may be in flight)."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            cudart.cudaStreamDestroy(stream)
        self.sums.close()

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

    @staticmethod
    def destroy_events(events: dict[int, object]) -> None:
        for event in events.values():
            cudart.cudaEventDestroy(event)

    def copy(self, copies: list[Copy], kind: str, after: dict[int, object] | None = None,
             issued: Callable[[dict[int, object] | None], None] | None = None) -> float:
        """:meth:`issue` ``copies`` and wait for them; return the seconds they took on the GPU
        (see :meth:`IssuedCopies.wait`)."""
        return self.issue(copies, kind, after, issued).wait()

    def issue(self, copies: list[Copy], kind: str, after: dict[int, object] | None = None,
              issued: Callable[[dict[int, object] | None], None] | None = None,
              checksums: list[int] | None = None) -> IssuedCopies:
        """Issue ``copies`` on the side streams; the caller waits for them with
        :meth:`IssuedCopies.wait` (exactly once) before it lets their memory go.

        ``kind`` is ``"d2h"``, ``"h2d"`` or ``"d2d"`` (within one device); ``after`` holds
        events the copies must wait for (the caller destroys them once this returns).
        ``issued`` is called with an event per device recorded behind the copies once all are
        issued (work queued after them on the GPU runs after the copies), and with None once
        they are done, before the events are destroyed. Where issuing fails, what was issued
        is waited for before this raises. ``checksums``: a key per copy; each copy's source is
        hashed on the GPU beside the copies where the kernel is built, its block digests kept
        under its key in ``IssuedCopies.checksums`` once waited for.
        """
        direction = getattr(cudart.cudaMemcpyKind, _KINDS[kind])
        by_device = _by_device(copies, kind)
        # before any copy is issued: a kernel loaded behind one of them would wait for it
        hashed = ({d for d in by_device if self.sums.ready(d)} if checksums is not None
                  else set())
        pending = IssuedCopies()
        try:
            for device, batch in by_device.items():
                stream = self.stream(device, kind)
                _check(cudart.cudaSetDevice(device), "cudaSetDevice")
                if after and device in after:
                    _check(cudart.cudaStreamWaitEvent(stream, after[device], 0),
                           "cudaStreamWaitEvent")
                self._after_other_kinds(device, kind, stream)
                pending.spans.append((stream, _event(stream), None))
                hashes = (self._hash(copies, checksums, device, pending)
                          if checksums is not None and device in hashed else None)
                if len(batch) == 1 or not self._copy_batch(batch, stream):
                    for dst, src, nbytes in batch:
                        _check(cudart.cudaMemcpyAsync(dst, src, nbytes, direction, stream),
                               "cudaMemcpyAsync")
                if hashes is not None:  # the copies' end covers the checksums' end
                    _check(cudart.cudaStreamWaitEvent(stream, hashes.event, 0),
                           "cudaStreamWaitEvent")
                pending.spans[-1] = (stream, pending.spans[-1][1], _event(stream))
            if issued is not None:
                pending.published = issued
                issued(dict(zip(by_device, (done for _, _, done in pending.spans),
                                strict=True)))
        except BaseException:  # never raise while a copy that was issued may still run
            pending.wait()
            raise
        return pending

    def _hash(self, copies: list[Copy], keys: list[int], device: int, pending: IssuedCopies
              ) -> GpuHashes | None:
        """Start the checksums of the sources of ``copies`` on ``device`` behind the copy
        stream's start event (None where the kernel fails: the copies go on, and their
        checksums are computed on the CPU, from then on)."""
        mine = [(key, src, nbytes) for key, (d, _, src, nbytes) in zip(keys, copies, strict=True)
                if d == device]
        blocks = [blocks_of(src, nbytes) for _, src, nbytes in mine]
        try:
            hashes = self.sums.launch(device, pending.spans[-1][1],
                                      [b for bs in blocks for b in bs])
        except RuntimeError as exc:
            self.sums.give_up(device, exc)
            _check(cudart.cudaSetDevice(device), "cudaSetDevice")
            return None
        pending.hashes.append(([(i, len(bs)) for (i, _, _), bs in zip(mine, blocks,
                                                                     strict=True)], hashes))
        return hashes

    @staticmethod
    def wait_current(events: dict[int, object]) -> None:
        """Make the work queued next on each device's current torch stream wait for the
        device's event (on the GPU: the calling thread goes on)."""
        for device, event in events.items():
            current = torch.cuda.current_stream(device).cuda_stream
            _check(cudart.cudaStreamWaitEvent(current, event, 0), "cudaStreamWaitEvent")

    def _copy_batch(self, copies: list[tuple[int, int, int]], stream: object) -> bool:
        """Issue ``copies`` in one ``cudaMemcpyBatchAsync`` call; False where it is missing."""
        if not self._batch_ok:
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
        self._batch_ok = False
        log.info("dcp_datastates: cudaMemcpyBatchAsync unavailable (%s); copying one by one",
                 reason)
        cudart.cudaGetLastError()  # clear a sticky-free error before the fallback
        return False


def _event(stream: object) -> object:
    """A timing event recorded on ``stream``. A thread waiting for it sleeps (blocking sync):
    by default CUDA spins a core through the whole copy, which the checksum threads and the
    training thread need."""
    (event,) = _check(cudart.cudaEventCreateWithFlags(cudart.cudaEventBlockingSync),
                      "cudaEventCreateWithFlags")
    _check(cudart.cudaEventRecord(event, stream), "cudaEventRecord")
    return event


class IssuedCopies:
    """Copies issued by :meth:`CudaCopier.issue`: (stream, start, done) events per device, the
    ``issued`` callback they were published to, and the checksums of their sources in flight
    (``checksums`` once waited: each hashed copy's block digests by its key)."""

    def __init__(self) -> None:
        self.spans: list[tuple[object, object, object | None]] = []
        self.published: Callable[[None], None] | None = None
        self.hashes: list[tuple[list[tuple[int, int]], GpuHashes]] = []
        self.checksums: dict[int, list[int]] = {}

    def wait(self) -> float:
        """Wait for each span's copies, take back the published events, destroy the events
        (once: later calls return 0.0); the longest span in seconds (a stream whose copies
        were not all issued is waited for in full)."""
        spans, self.spans = self.spans, []
        longest = 0.0
        for stream, start, done in spans:
            if done is not None:
                cudart.cudaEventSynchronize(done)
                err, ms = cudart.cudaEventElapsedTime(start, done)
                if err == cudart.cudaError_t.cudaSuccess:
                    longest = max(longest, ms / 1e3)
            else:
                cudart.cudaStreamSynchronize(stream)
        hashes, self.hashes = self.hashes, []
        for copies, pending in hashes:  # digests of a failed kernel are left to the CPU
            if cudart.cudaEventSynchronize(pending.event)[0] == cudart.cudaError_t.cudaSuccess:
                digests = iter(pending.digests())
                self.checksums.update((i, [next(digests) for _ in range(n)]) for i, n in copies)
            pending.release()
        published, self.published = self.published, None
        if published is not None:
            published(None)
        for _, start, done in spans:
            for event in (start, done) if done is not None else (start,):
                cudart.cudaEventDestroy(event)
        return longest
