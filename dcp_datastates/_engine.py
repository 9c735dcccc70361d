"""The engine: everything long-lived that saves and loads share, owned in one place.

One engine per process by default (:func:`default_engine`), or one made and passed in as
``engine=``. It owns the host cache (a snapshot arena sized from the states it sees, and a
bounce arena for flush and restore buffers), their pinning and io_uring registration, the CUDA
side streams, the I/O backend, and the executors. Writers and readers are thin adapters that
hand each save or load to a job (``_jobs/``); a job owns what it holds and gives it back
explicitly. The engine knows jobs only as :class:`Work` that ``close()`` waits for: the save
order that ``_jobs/ordering.py`` attaches to it, and each load in progress. ``close()`` frees
everything. Every engine is closed at interpreter exit, early enough for saves in progress to
finish (:func:`_close_at_exit`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ._arguments import checked_keywords
from ._cuda import cuda_copy
from ._io import FALLBACK, IOBackend, make_backend
from ._memory.arenas import Arenas, MakeArena, Pinning
from ._memory.aside import fits_on_gpu, room_for
from ._memory.host_cache import Arena, Lease
from ._sizes import parse_size
from ._workers.executors import Executors

if TYPE_CHECKING:
    import torch

    from ._cuda.gpu_sums import GpuSums

__all__ = ["POLL_S", "Engine", "Saves", "Work", "current_default", "default_engine"]

log = logging.getLogger("dcp_datastates")

#: How often a wait (for cache memory, for a snapshot target) checks whether to give up.
POLL_S = 0.05


class Work(Protocol):
    """Work in progress that the engine's ``close()`` waits for, then ends."""

    def wait(self, deadline: float) -> None:
        """Block until the work is over (or may be ended), or ``deadline`` (monotonic) passes."""

    def end(self) -> None:
        """The engine is closing: end now, giving back everything held."""


class Saves(Work, Protocol):
    """The save order that ``_jobs/ordering.py`` attaches to an engine (``engine.saves``)."""

    def new_job(self) -> object:
        """A save job holding the next ticket."""

    def reap(self) -> None:
        """End the saves DCP abandoned."""

    def wait_for_staging(self) -> None:
        """Block until every snapshot so far is staged."""

    def order_after_staging(self) -> None:
        """Hold the calling thread's next work until those snapshots are staged (ordered)."""


class Engine:
    """The process's host cache, CUDA streams, I/O backend and executors.

    Args:
        host_cache_size: ``"auto"`` (default) sizes the snapshot cache from the largest state
            staged so far, growing it when a larger one comes, never beyond half of the memory
            the kernel reports available (``MemAvailable``) at that moment; plus a bounce arena
            of 128 MiB for flush and restore buffers. A size (bytes or ``"16GiB"``) fixes the
            whole cache, of which up to 256 MiB (a quarter at most) are bounce buffers. A state
            larger than the snapshot cache stages the rest in pageable memory (logged).
        io_backend: ``"auto"``, ``"uring"``, ``"threads"`` (``$DCP_DATASTATES_IO`` overrides),
            or a backend object (tests inject fakes); the engine closes only a backend it made.
        io_workers: threads that keep flush and restore I/O in flight. The checksums of
            saves are computed on threads of their own, one per CPU core the process may run
            on (``hash_workers``), at least ``io_workers``; a copy's verification (a
            persist's) on a quarter as many, so that it never holds a save's checksums up.
        make_arena: how host memory is mapped, ``(nbytes, name) -> Arena`` (tests inject
            slow or failing fakes).
        settle_pool: the thread waiting for copies to end (tests inject one; close() ends it).
        gpu_sums: the GPU checksum kernels (tests inject slow or failing ones).

    The snapshot cache is mapped, pinned and registered on the engine's arena thread, never on
    a thread a save waits for: the first save (or one larger than the cache) copies its
    snapshot aside meanwhile and moves it in once the cache is ready (``_memory/arenas.py``).
    """

    @checked_keywords
    def __init__(
        self,
        *,
        host_cache_size: int | str = "auto",
        io_backend: str | IOBackend = "auto",
        io_workers: int = 8,
        make_arena: MakeArena = Arena,
        settle_pool: Executor | None = None,
        gpu_sums: GpuSums | None = None,
    ) -> None:
        self.fixed_size = None if host_cache_size == "auto" else parse_size(
            host_cache_size, name="host_cache_size")
        if self.fixed_size is not None and self.fixed_size < 4 * 4096:
            raise ValueError(f"host_cache_size must be at least 16 KiB, got {host_cache_size!r}")
        if isinstance(io_backend, str):
            self.io, message = make_backend(io_backend)
            self._owns_io = True
            log.log(logging.WARNING if FALLBACK in message else logging.INFO, message)
        else:
            self.io, self._owns_io = io_backend, False
        self.cuda = cuda_copy.CudaCopier(gpu_sums) if cuda_copy.available() else None
        if (why := cuda_copy.why_unavailable()) is not None:
            log.warning("dcp_datastates: %s", why)
        self.threads = Executors(io_workers, settle_pool)
        self.arenas = Arenas(Pinning(self.io, self.cuda, make_arena), self.fixed_size,
                              self.check_open)
        self._lock = threading.Lock()
        self.saves: Saves | None = None  # attached by _jobs/ordering.py at the first save
        self._work: list[Work] = []  # loads in progress, managers not closed
        self._step_hook: RemovableHandle | None = None  # see order_optimizer_steps
        self._step_timers: OrderedDict[int, Callable[[Callable[[], None]], None]] = \
            OrderedDict()  # a dict RemovableHandle can refer to
        self.closed = False
        self.exiting = False  # the interpreter exits: a save that fails now is lost (logged)
        self._exit_hook = _hook_exit(self)  # emptied by close(): the hook lets go

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- host cache -----------------------------------------------------------------------------
    def aside_fits_on_gpu(self, sources: list[torch.Tensor]) -> bool:
        """Whether a copy aside of ``sources`` now keeps every GPU source on the GPU (none in
        pageable host memory, where it is slow: ``aside.fits_on_gpu``); tests override it."""
        return fits_on_gpu(sources, self.cuda)

    def aside_room_for(self, nbytes: int) -> bool:
        """Whether this process's CUDA device has room now to keep ``nbytes`` of a snapshot
        aside (False without a GPU: ``aside.room_for``); tests override it."""
        return room_for(nbytes, self.cuda)

    def reserve(self, nbytes: int, *, wait: bool = True,
                give_up: Callable[[], bool] = lambda: False) -> Lease | None:
        """A snapshot lease of ``nbytes`` (less where the cache is smaller: the caller stages
        the rest in pageable memory), or None where no cache memory can be had.

        With ``wait``, blocks while the cache is full (backpressure) until earlier saves have
        flushed; a request larger than the cache is admitted once nothing else holds it. It
        returns None once ``give_up()`` says the wait is futile (the save job passes its save
        order's judgement: only snapshots that no save has taken hold the cache), and the
        caller stages in pageable memory.
        Without ``wait`` (a save whose turn it is: what holds memory waits behind it), returns
        None at once when the memory is taken. Makes or grows the cache here where needed.
        """
        if nbytes <= 0:
            return None
        arena = self.arenas.snapshot_arena(nbytes)
        need = min(nbytes, arena.nbytes)
        while (lease := arena.pool.try_allocate(need)) is None:
            if not wait:
                return None
            self.check_open()
            if give_up():
                return None
            arena.pool.wait_for_release(POLL_S)
        return lease

    def cache_bytes(self) -> int:
        """Bytes of host memory the engine's arenas hold now (retiring ones included)."""
        return self.arenas.cache_bytes()

    def live_leases(self) -> int:
        """Leases handed out and not yet released (0 when no save holds memory)."""
        return self.arenas.live_leases()

    def map_file(self, fd: int, nbytes: int, name: str, *, pin: bool = True) -> Arena:
        """The first ``nbytes`` of the file ``fd`` mapped shared and pinned for GPU copies:
        an arena of the caller's (a memory-tier slot), freed by :meth:`unmap_file` or at
        :meth:`close`. Pinning takes seconds for a few GiB; with ``pin=False`` the arena is
        mapped only (copies into it work, slower) until :meth:`pin_file`."""
        self.check_open()
        return self.arenas.files.map(fd, nbytes, name, pin)

    def pin_file(self, arena: Arena) -> None:
        """Pin an arena of ``map_file(pin=False)`` on the caller's thread (no copy into it
        may run meanwhile); nothing to do without a GPU, or where it is pinned."""
        self.arenas.files.pin(arena)

    def unmap_file(self, arena: Arena) -> None:
        """Unpin and unmap an arena of :meth:`map_file` (idempotent; raises while a lease of
        it is live)."""
        self.arenas.files.unmap(arena)

    # -- work the engine waits for at close ------------------------------------------------------
    def attach_saves(self, make: Callable[[Engine], Saves]) -> Saves:
        """The engine's save order, ``make(self)`` at the first call (``_jobs/ordering.py``)."""
        with self._lock:
            self.check_open()
            if self.saves is None:
                self.saves = make(self)
            return self.saves

    def track(self, work: Work) -> None:
        """``close()`` waits for ``work`` (a load, a manager) until :meth:`untrack`."""
        with self._lock:
            self.check_open()
            self._work.append(work)

    def untrack(self, work: Work) -> None:
        with self._lock:
            if work in self._work:
                self._work.remove(work)

    def order_after_staging(self) -> None:
        """Hold the work the calling thread queues next until every snapshot staged so far has
        been copied: GPU work waits on the GPU for copies issued on the side streams (this
        returns at once), anything else waits here (what :func:`~dcp_datastates.guard` does
        before ``optimizer.step()``)."""
        if self.saves is not None:
            self.saves.order_after_staging()

    def order_optimizer_steps(self) -> None:
        """From the engine's first snapshot until it closes, every optimizer's ``step()`` is
        ordered after the snapshots staged so far (:meth:`order_after_staging`), as
        :func:`~dcp_datastates.guard` does for one optimizer: the step is where training
        changes the state a lazy snapshot copies."""
        with self._lock:
            if self._step_hook is None and not self.closed:
                self._step_hook = register_optimizer_step_pre_hook(
                    lambda *_: self._before_step())

    def time_step_waits(self, timer: Callable[[Callable[[], None]], None]) -> RemovableHandle:
        """Have ``timer(wait)`` run the waits of the optimizer step hook (a manager's overhead
        budget counts them as its saves' cost); ``.remove()`` the handle to stop."""
        handle = RemovableHandle(self._step_timers)
        self._step_timers[handle.id] = timer
        return handle

    def _before_step(self) -> None:
        wait = self.order_after_staging
        for timer in list(self._step_timers.values()):
            wait = functools.partial(timer, wait)
        wait()

    # -- executors ------------------------------------------------------------------------------
    def submit(self, fn: Callable, *args: object):
        """Run ``fn(*args)`` on the I/O threads."""
        self.check_open()
        return self.threads.io.submit(fn, *args)

    def after_copies(self, fn: Callable, *args: object) -> None:
        """Run ``fn(*args)`` (a wait for copies) on the settle thread, in order, or here."""
        try:
            self.threads.settle.submit(fn, *args)
        except RuntimeError:  # shut down by close(): no copy may be left unwaited for
            fn(*args)

    def compute(self, fn: Callable, *args: object, background: bool = False):
        """Run ``fn(*args)`` on the checksum threads, or with ``background`` (a copy's
        verification) on the fewer threads of their own."""
        self.check_open()
        threads = self.threads
        return (threads.verify if background else threads.hash).submit(fn, *args)

    # -- lifetime -------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this dcp_datastates Engine is closed")

    def close(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` s; ``math.inf``: as long as they take) for saves and loads
        in progress, then free the caches, streams, threads and backend. A save or load still
        running then is ended with an error."""
        deadline = time.monotonic() + timeout
        with self._lock:
            work = [] if self.closed else [*self._work, *([self.saves] if self.saves else [])]
        for w in work:
            w.wait(deadline)
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._exit_hook.clear()
            if self._step_hook is not None:
                self._step_hook.remove()
            work, self._work = [*self._work, *([self.saves] if self.saves else [])], []
        for w in work:
            w.end()
        self.threads.shutdown()
        self.arenas.close()
        if self.cuda is not None:
            self.cuda.close()
        if self._owns_io:
            self.io.close()


_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The process's engine, made at first use with default arguments, closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Engine()
        return _default


def current_default() -> Engine | None:
    """The process's engine if one is open, without making one."""
    engine = _default
    return engine if engine is not None and not engine.closed else None


def _hook_exit(engine: Engine) -> list[Engine]:
    """Have :func:`_close_at_exit` close ``engine`` at interpreter exit (through CPython's
    ``threading._register_atexit``, the hook ``concurrent.futures`` itself uses); the list
    returned holds the engine until ``close()`` empties it."""
    hook = [engine]
    with contextlib.suppress(RuntimeError):  # made while exiting: no hook any more
        # private CPython hook, not in typeshed
        threading._register_atexit(_close_at_exit, hook, os.getpid())  # type: ignore[attr-defined]
    return hook


def _close_at_exit(hook: list[Engine], pid: int) -> None:
    """Close an engine at interpreter exit, waiting for its saves as long as they take.

    A ``threading`` exit hook: it runs before the non-daemon threads are joined, and before
    ``concurrent.futures``' own hook (registered earlier, run later), which stops every
    executor taking new work. A save in flight (DCP's upload thread) then still has the
    engine's executors to finish with, as DCP's own writer finishes it; one that fails now
    says so (``SaveJob.end``). Does nothing in a forked child (multiprocessing runs the hooks
    there too) or once the engine is closed."""
    if os.getpid() != pid or not hook:
        return
    engine = hook[0]
    engine.exiting = True
    try:
        engine.close(timeout=math.inf)
    except Exception as exc:  # noqa: BLE001 - an exit hook that raises skips the later ones
        log.warning("dcp_datastates: closing the engine at exit failed: %s", exc)


def _forget_default_in_child() -> None:
    """A forked child has none of the parent's threads: it makes its own engine."""
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_default_in_child)
