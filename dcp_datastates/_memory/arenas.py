"""The engine's host arenas: the snapshot cache, the bounce arena and memory-tier slot mappings.

The snapshot cache is made (mapped, populated, pinned, registered: seconds for a few GiB) and
grown on a thread of its own, the *arena thread*, never on a thread a save waits for: a save
that finds it missing or too small starts it there (:meth:`Arenas.snapshot_memory`), copies
its snapshot aside meanwhile (:mod:`.aside`), and queues the move into the cache behind it
(:meth:`Arenas.after_arena`). Saves that come while work is queued there queue behind it, in
order. Once nothing waits for it, a cache that fits is used at once, as it always was.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .._cuda.cuda_copy import CudaCopier
from .._format.align import round_up
from .._io import IOBackend
from .._sizes import format_size
from ..errors import CheckpointError
from .aside import Aside
from .host_cache import Arena

log = logging.getLogger("dcp_datastates")

#: The bounce arena: flush gathers and restore extents (the share of an explicit cache size).
MAX_BOUNCE_BYTES = 256 << 20
AUTO_BOUNCE_BYTES = 128 << 20
#: ``auto`` never grows the snapshot arena beyond this fraction of MemAvailable.
AUTO_MEMORY_FRACTION = 0.5

#: How the arenas' memory is mapped: ``(nbytes, name) -> Arena`` (tests inject slow fakes).
MakeArena = Callable[[int, str], Arena]


class Memory(enum.Enum):
    """Where a snapshot goes now (:meth:`Arenas.snapshot_memory`)."""

    ARENA = "arena"  # the snapshot cache takes it now
    ASIDE = "aside"  # the cache is made from now on: copy aside, move it in with after_arena
    QUEUE = "queue"  # work already waits for the cache: stage behind it with after_arena


def _available_memory() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes (total RAM where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _snapshot_size(fixed: int | None, nbytes: int, current: Arena | None) -> tuple[int | None, str]:
    """The size of a new snapshot arena for a state of ``nbytes``, and why (None: keep
    ``current``)."""
    if fixed is not None:
        if current is not None:
            return None, ""
        bounce = min(MAX_BOUNCE_BYTES, round_up(fixed // 4))
        return max(4096, round_up(fixed) - bounce), f"host_cache_size={format_size(fixed)}"
    want = round_up(nbytes)
    if current is not None and current.nbytes >= want:
        return None, ""
    cap = round_up(int(AUTO_MEMORY_FRACTION * (
        _available_memory() + (current.nbytes if current else 0))))
    size = min(want, cap)
    if current is not None and current.nbytes >= size:
        return None, ""
    capped = f"; capped at half of available memory, {format_size(cap)}" if size < want else ""
    return size, f"auto: a state of {format_size(nbytes)} was staged{capped}"


class Pinning:
    """How the engine's arenas are made (mapped, pinned, registered) and freed (in reverse)."""

    def __init__(self, io: IOBackend, cuda: CudaCopier | None, make: MakeArena = Arena) -> None:
        self.io = io
        self.cuda = cuda
        self._make = make

    def make(self, nbytes: int, name: str) -> Arena:
        arena = self.pinned(self._make(nbytes, name))
        try:
            self.io.register(arena.addr, arena.nbytes)
        except BaseException:
            self.unpin_and_free(arena)
            raise
        return arena

    def pinned(self, arena: Arena) -> Arena:
        """``arena``, pinned for GPU copies where there are GPUs (freed if pinning fails)."""
        try:
            if self.cuda is not None:
                self.cuda.pin(arena.addr, arena.nbytes)
        except BaseException:
            arena.free()
            raise
        return arena

    def unpin_and_free(self, arena: Arena, pinned: bool = True) -> None:
        if self.cuda is not None and pinned:
            self.cuda.unpin(arena.addr, arena.nbytes)
        arena.free()

    def free(self, arena: Arena) -> None:
        """Unregister, unpin, unmap: in that order, so no registration outlives the memory."""
        if arena.pool.live:
            raise RuntimeError(
                f"cannot free the {arena.pool.name} cache: {arena.pool.live} lease(s) still live")
        self.io.unregister(arena.addr, arena.nbytes)
        self.unpin_and_free(arena)


class FileArenas:
    """Arenas of files mapped through the engine (memory-tier slots), pinned or not yet."""

    def __init__(self, pins: Pinning) -> None:
        self.pins = pins
        self._lock = threading.Lock()
        self._pinned: dict[Arena, bool] = {}
        self.closed = False

    def map(self, fd: int, nbytes: int, name: str, pin: bool) -> Arena:
        arena = Arena(nbytes, name, fd=fd)
        if pin:
            self.pins.pinned(arena)
        with self._lock:
            closed = self.closed
            if not closed:
                self._pinned[arena] = pin
        if closed:  # the engine closed meanwhile: nothing may outlive it
            self.pins.unpin_and_free(arena, pin)
            raise RuntimeError("this dcp_datastates Engine is closed")
        return arena

    def pin(self, arena: Arena) -> None:
        with self._lock:
            if self.pins.cuda is None or self._pinned.get(arena, True):
                return
        self.pins.cuda.pin(arena.addr, arena.nbytes)
        with self._lock:
            kept = arena in self._pinned
            if kept:
                self._pinned[arena] = True
        if not kept:  # freed meanwhile (the engine closed): no registration outlives it
            self.pins.cuda.unpin(arena.addr, arena.nbytes)

    def unmap(self, arena: Arena) -> None:
        with self._lock:
            if arena not in self._pinned:
                return  # freed already (by close)
            if arena.pool.live:
                raise RuntimeError(f"cannot unmap {arena.pool.name}: a save still holds it")
            pinned = self._pinned.pop(arena)
        self.pins.unpin_and_free(arena, pinned)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            arenas, self._pinned = self._pinned, {}
        for arena, pinned in arenas.items():
            self.pins.unpin_and_free(arena, pinned)


class Arenas:
    """The engine's arenas and the arena thread that makes the snapshot cache.

    ``check_open`` raises once the engine is closed; :meth:`close` then frees everything.
    """

    def __init__(self, pins: Pinning, fixed_size: int | None,
                 check_open: Callable[[], None]) -> None:
        self.pins = pins
        self.fixed_size = fixed_size
        self.check_open = check_open
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-arena")
        self._lock = threading.Lock()  # the fields below
        self._make_lock = threading.Lock()  # one snapshot arena made at a time
        self._bounce_lock = threading.Lock()  # one bounce arena made
        self._snapshot: Arena | None = None
        self._bounce: Arena | None = None
        self._retiring: list[Arena] = []
        self.files = FileArenas(pins)  # memory-tier slots mapped through map_file
        self._queued = 0  # tasks on the arena thread not yet over
        self._asides: list[Aside] = []  # snapshots waiting aside for the cache
        self._failed: BaseException | None = None  # the arena thread's last make failed so
        self._closed = False

    # -- the snapshot cache ---------------------------------------------------------------------
    def snapshot_memory(self, nbytes: int) -> Memory:
        """Where a snapshot of ``nbytes`` goes now: ARENA where the snapshot cache is large
        enough and nothing waits for it; otherwise the caller queues what needs the cache with
        :meth:`after_arena`, behind the cache being made (ASIDE: started by this call) or
        behind work already queued (QUEUE)."""
        with self._lock:
            self.check_open()
            if self._queued:
                return Memory.QUEUE
            if nbytes <= 0 or _snapshot_size(self.fixed_size, nbytes, self._snapshot)[0] is None:
                return Memory.ARENA
            self._queue(self._make_in_background, nbytes)
        return Memory.ASIDE

    def after_arena(self, fn: Callable, *args: object) -> Future:
        """Run ``fn(*args)`` on the arena thread, after everything queued there before."""
        with self._lock:
            self.check_open()
            return self._queue(fn, *args)

    def move_aside(self, aside: Aside, fn: Callable, *args: object,
                   when: Callable[[Callable[[], None]], None] | None = None,
                   failed: Callable[[BaseException], None] | None = None) -> None:
        """Queue ``fn(*args)`` (the move of a snapshot waiting ``aside`` into the cache) on the
        arena thread: at once, or once ``when`` calls back the queueing it is given (a target
        not ready yet; the error of a queueing then goes to ``failed``). ``aside`` is freed
        once it returns or fails (at once where it cannot be queued), and counted by
        :meth:`aside_bytes` until then."""
        with self._lock:
            self._asides.append(aside)

        def queue() -> None:
            with self._lock:
                try:
                    self.check_open()
                    self._queue(self._move, aside, fn, args)
                    return
                except BaseException as exc:
                    self._let_go(aside)
                    if when is None or failed is None:
                        raise
                    error = exc
            failed(error)

        if when is None:
            queue()
        else:
            when(queue)

    def aside_bytes(self) -> int:
        """Bytes of snapshots waiting aside for the cache (GPU and pageable host memory)."""
        with self._lock:
            return sum(a.gpu_bytes + a.host_bytes for a in self._asides)

    def _move(self, aside: Aside, fn: Callable, args: tuple) -> None:
        try:
            fn(*args)
        finally:
            with self._lock:
                self._let_go(aside)

    def _let_go(self, aside: Aside) -> None:
        """Free ``aside`` (the caller holds ``_lock``)."""
        self._asides.remove(aside)
        aside.free()

    def snapshot_arena(self, nbytes: int) -> Arena:
        """The snapshot cache, made or grown here for a state of ``nbytes`` where needed.
        Raises the failure of a make on the arena thread for the saves queued behind it (they
        do not try again; the failure is forgotten once the arena thread has nothing queued)."""
        with self._make_lock:
            with self._lock:
                self.check_open()
                if (failed := self._failed) is not None:
                    raise CheckpointError(f"the host cache could not be made: {failed}") \
                        from failed
                current = self._snapshot
                size, why = _snapshot_size(self.fixed_size, nbytes, current)
                if size is None:
                    assert current is not None  # _snapshot_size keeps only an arena there is
                    return current
            arena = self.pins.make(size, "snapshot")
            with self._lock:
                closed = self._closed
                if not closed:
                    self._snapshot = arena
                    if current is not None:
                        self._retiring.append(current)
            if closed:  # the engine closed meanwhile: nothing may outlive it
                self.pins.free(arena)
                self.check_open()
            log.info("dcp_datastates: host cache %s for snapshots (%s)", format_size(size), why)
        self.free_retired()
        return arena

    def _queue(self, fn: Callable, *args: object) -> Future:
        """Submit to the arena thread (the caller holds ``_lock``)."""
        future = self._thread.submit(self._run, fn, args)
        self._queued += 1
        return future

    def _run(self, fn: Callable, args: tuple) -> object:
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._queued -= 1
                if not self._queued:  # every save queued behind a failed make has seen it
                    self._failed = None

    def _make_in_background(self, nbytes: int) -> None:
        with self._lock:
            self._failed = None  # an earlier failure no save took: this attempt supersedes it
        try:
            self.snapshot_arena(nbytes)
        except BaseException as exc:  # noqa: BLE001 - the save queued behind it gets it
            with self._lock:
                if self._closed:
                    return
                self._failed = exc
            log.warning("dcp_datastates: making the host cache failed: %s", exc)

    # -- the bounce arena, slots, figures -------------------------------------------------------
    @property
    def bounce(self) -> Arena:
        """The arena of short-lived flush and restore buffers (made at first use)."""
        with self._bounce_lock:
            with self._lock:
                self.check_open()
                if self._bounce is not None:
                    return self._bounce
            size = AUTO_BOUNCE_BYTES if self.fixed_size is None else min(
                MAX_BOUNCE_BYTES, round_up(self.fixed_size // 4))
            arena = self.pins.make(size, "bounce")
            with self._lock:
                closed = self._closed
                if not closed:
                    self._bounce = arena
            if closed:
                self.pins.free(arena)
                self.check_open()
            return arena

    def _engine_arenas(self) -> list[Arena]:
        with self._lock:
            return [a for a in (self._snapshot, self._bounce, *self._retiring) if a is not None]

    def cache_bytes(self) -> int:
        """Bytes of host memory the snapshot and bounce arenas hold (retiring ones included)."""
        return sum(a.nbytes for a in self._engine_arenas())

    def live_leases(self) -> int:
        """Leases of the snapshot and bounce arenas handed out and not yet released."""
        return sum(a.pool.live for a in self._engine_arenas())

    def free_retired(self) -> None:
        with self._lock:
            idle = [a for a in self._retiring if not a.pool.live]
            self._retiring = [a for a in self._retiring if a.pool.live]
        for arena in idle:
            self.pins.free(arena)

    def close(self) -> None:
        """Wait for the arena thread (what is queued runs, and fails where it needs the cache),
        then free every arena."""
        with self._lock:
            self._closed = True
        self._thread.shutdown(wait=True)
        with self._lock:
            arenas = [a for a in (self._snapshot, self._bounce, *self._retiring) if a]
            self._snapshot = self._bounce = None
            self._retiring = []
        for arena in arenas:
            self.pins.free(arena)
        self.files.close()
