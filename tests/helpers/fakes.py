"""Fakes passed to the code under test through its constructors: fault-injecting I/O backends,
a slow host cache, a settle thread that holds snapshots' hand-out, and the clock and costs that
drive the overhead budget of ``CheckpointManager``."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dcp_datastates import Engine
from dcp_datastates._format.align import ALIGN, round_up
from dcp_datastates._io import IOBackend, IOReq
from dcp_datastates._memory.host_cache import Arena, Lease


class FaultyBackend:
    """An IOBackend wrapping a real one (``inner``, which it closes) that injects faults.

    - ``fail_write_after=N``: the first N write calls succeed, every later one raises
      ``OSError(errno_, ..., path)`` (``errno.EIO``, ``errno.ENOSPC``, ...); likewise
      ``fail_read_after`` for reads. ``fail_fsync`` makes every fsync fail that way.
    - ``short_writes``: each request is written in two parts, by separate calls, second part
      first (split at a 4 KiB multiple on an O_DIRECT descriptor); a failing write first writes
      the first parts, leaving a torn file as a real failing disk may.
    - ``delay_s``: every write sleeps first (a slow disk); ``read_delay_s`` every read.
    - ``on_fsync``: called with the path of every fsync before it is made.
    - ``gate``: writes wait until it is set; ``gated=True`` starts it cleared.
      ``write_started`` is set as soon as a write call arrives (before the gate).
    - ``hold_reads_after=N``: the first N read calls go on, every later one sets
      ``reads_held`` and waits for ``read_gate``.

    It counts calls (``writes``, ``reads``, ``fsyncs``) and records registrations, so a test
    can assert that every registered buffer was unregistered (``live_buffers() == []``).
    """

    def __init__(
        self,
        inner: IOBackend,
        *,
        fail_write_after: int | None = None,
        fail_read_after: int | None = None,
        errno_: int = errno.EIO,
        short_writes: bool = False,
        delay_s: float = 0.0,
        read_delay_s: float = 0.0,
        fail_fsync: bool = False,
        gated: bool = False,
        hold_reads_after: int | None = None,
        on_fsync: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.fail_write_after, self.fail_read_after = fail_write_after, fail_read_after
        self.errno_, self.short_writes = errno_, short_writes
        self.delay_s, self.fail_fsync = delay_s, fail_fsync
        self.on_fsync = on_fsync
        self.read_delay_s = read_delay_s
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.write_started = threading.Event()
        self.hold_reads_after = hold_reads_after
        self.read_gate, self.reads_held = threading.Event(), threading.Event()
        self.writes = self.reads = self.fsyncs = 0
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[tuple[int, int]] = []
        self.closed = False
        self._lock = threading.Lock()

    def _error(self, op: str, path: str) -> OSError:
        return OSError(self.errno_, f"{op} failed: {os.strerror(self.errno_)} (injected)", path)

    def register(self, addr: int, nbytes: int) -> None:
        with self._lock:
            self.registered.append((addr, nbytes))
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int, nbytes: int) -> None:
        with self._lock:
            self.unregistered.append((addr, nbytes))
        self.inner.unregister(addr, nbytes)

    def live_buffers(self) -> list[tuple[int, int]]:
        """Buffers registered and not unregistered since."""
        with self._lock:
            return list((Counter(self.registered) - Counter(self.unregistered)).elements())

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        self.write_started.set()
        self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.writes += 1
            fail = self.fail_write_after is not None and self.writes > self.fail_write_after
        if not self.short_writes:
            if fail:
                raise self._error("write", path)
            self.inner.write(fd, path, reqs)
            return
        align = ALIGN if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else 1
        cuts = [(r, r.nbytes // 2 // align * align) for r in reqs]
        first = [IOReq(r.addr, c, r.offset) for r, c in cuts]
        rest = [IOReq(r.addr + c, r.nbytes - c, r.offset + c) for r, c in cuts]
        if fail:
            self.inner.write(fd, path, first)
            raise self._error("write", path)
        self.inner.write(fd, path, rest)
        self.inner.write(fd, path, first)

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        with self._lock:
            self.reads += 1
            fail = self.fail_read_after is not None and self.reads > self.fail_read_after
            hold = self.hold_reads_after is not None and self.reads > self.hold_reads_after
        if hold:
            self.reads_held.set()
            self.read_gate.wait()
        if fail:
            raise self._error("read", path)
        self.inner.read(fd, path, reqs)

    def fsync(self, fd: int, path: str) -> None:
        if self.on_fsync is not None:
            self.on_fsync(path)
        with self._lock:
            self.fsyncs += 1
        if self.fail_fsync:
            raise self._error("fsync", path)
        self.inner.fsync(fd, path)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class FakeClock:
    """A clock that reads ``now``, which only the test moves (``clock=`` of the manager)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class Costly:
    """A ``Stateful`` whose ``state_dict()`` takes ``cost_s`` of ``clock``: a save of it costs
    the training thread that much in its ``save()`` call (as a slow state-dict gather would)."""

    def __init__(self, state: dict, clock: FakeClock, cost_s: float) -> None:
        self.state, self.clock, self.cost_s = state, clock, cost_s

    def state_dict(self) -> dict:
        self.clock.now += self.cost_s
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


class SlowGuardEngine(Engine):
    """An engine whose next ``order_after_staging`` (the guard's wait) takes ``next_wait_s``
    of ``clock`` (set by the test after a save is taken: its snapshot holds the next optimizer
    step that long)."""

    def __init__(self, clock: FakeClock, **kw: object) -> None:
        super().__init__(**kw)
        self.clock = clock
        self.next_wait_s = 0.0

    def order_after_staging(self) -> None:
        super().order_after_staging()
        self.clock.now += self.next_wait_s
        self.next_wait_s = 0.0


class HeldPinEngine(Engine):
    """An engine whose ``pin_file`` (the pinning of memory-tier slots, on the slot pool's
    thread) waits until ``gate`` is set, after the first ``free_pins``; ``pinning`` is set
    once a pin waits, ``fail`` makes the pins raise instead. ``pinned`` counts the pins
    done."""

    def __init__(self, free_pins: int = 0, **kw: object) -> None:
        super().__init__(**kw)
        self.gate, self.pinning = threading.Event(), threading.Event()
        self.fail = False
        self.pinned = 0
        self.free_pins = free_pins

    def pin_file(self, arena: object) -> None:
        if self.pinned < self.free_pins:
            super().pin_file(arena)
            self.pinned += 1
            return
        self.pinning.set()
        if self.fail:
            raise RuntimeError("cudaHostRegister failed: cudaErrorMemoryAllocation (fake)")
        if not self.gate.wait(60):
            raise RuntimeError("the test never let the pinning go on")
        super().pin_file(arena)
        self.pinned += 1


class SlowArena:
    """An Engine's ``make_arena`` that maps the snapshot cache only once ``gate`` is set (the
    mapping and pinning of a large cache, held for as long as a test needs), then fails with
    ``fail``. ``started`` is set when the snapshot cache is asked for; ``timed_out`` says the
    gate was never set (a test that waited for the cache instead of going on)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.timed_out = False
        self.fail = fail
        self.made: list[Arena] = []
        self.tries = 0  # snapshot caches asked for

    def __call__(self, nbytes: int, name: str) -> Arena:
        if name == "snapshot":
            self.tries += 1
            self.started.set()
            self.timed_out = not self.gate.wait(60)
            if self.fail is not None:
                raise self.fail
        self.made.append(Arena(nbytes, name))
        return self.made[-1]

    def all_freed(self) -> bool:
        return all(a.freed for a in self.made)


class HeldSettles(ThreadPoolExecutor):
    """An engine's settle thread (``Engine(settle_pool=HeldSettles())``) that holds every
    settle (the wait for a snapshot's copies, then its hand-out) until ``gate`` is set, and
    counts those handed to it: a snapshot is counted once its copies are issued."""

    def __init__(self, limit_s: float = 60.0) -> None:
        super().__init__(1, thread_name_prefix="dcp_datastates-settle")
        self.gate = threading.Event()
        self.limit_s = limit_s
        self.handed = 0
        self._handed = threading.Condition()

    def submit(self, fn: Callable, /, *args: object, **kwargs: object) -> Future:
        with self._handed:
            self.handed += 1
            self._handed.notify_all()
        return super().submit(self._held, fn, *args, **kwargs)

    def wait_handed(self, count: int, timeout: float) -> bool:
        """Block until ``count`` settles were handed over (False: ``timeout`` passed first)."""
        with self._handed:
            return self._handed.wait_for(lambda: self.handed >= count, timeout)

    def _held(self, fn: Callable, *args: object, **kwargs: object) -> object:
        self.gate.wait(self.limit_s)
        return fn(*args, **kwargs)


class HeldPinRoomEngine(HeldPinEngine):
    """:class:`HeldPinEngine` on a GPU that has room (``room``) to keep a snapshot aside, or
    none, as the memory tier's budget asks (``aside_room_for``)."""

    def __init__(self, room: bool, **kw: object) -> None:
        super().__init__(**kw)
        self.room = room

    def aside_room_for(self, nbytes: int) -> bool:
        return self.room


class NoGpuRoomEngine(Engine):
    """An engine that finds no GPU room for a snapshot aside (``aside_fits_on_gpu`` is False,
    even for CPU sources): a memory-tier save whose slot is not ready waits for it instead of
    copying aside, as one of GPU sources on a full device does."""

    def aside_fits_on_gpu(self, sources: list) -> bool:
        return False


class FakeGpuSource:
    """What :func:`dcp_datastates._memory.aside.fits_on_gpu` reads of a GPU tensor: its device and
    size (``nbytes`` of uint8), no memory."""

    is_cuda = True

    def __init__(self, device: int, nbytes: int) -> None:
        self.device = torch.device("cuda", device)
        self.nbytes = nbytes

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


class FileTarget:
    """A snapshot target of one file mapped by ``engine``: the snapshot is the data file."""

    pinned = True

    def __init__(self, engine: Engine, path: Path, nbytes: int) -> None:
        self.engine, self.path, self.room = engine, path, 64 << 10
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.posix_fallocate(self.fd, 0, self.room + round_up(nbytes))
        self.arena = engine.map_file(self.fd, self.room + round_up(nbytes), str(path))

    def lease(self, total: int, entries: int) -> Lease | None:
        return self.arena.pool.try_allocate_at(self.room, total)

    def need_room(self, header_len: int) -> None:
        raise AssertionError("the room fits the header")

    def adopt(self, path: Path) -> Path:
        os.rename(self.path, path)
        return path

    def when_ready(self, queue: Callable[[], None]) -> None:
        queue()

    def close(self) -> None:
        self.engine.unmap_file(self.arena)
        os.close(self.fd)

