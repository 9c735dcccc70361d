"""The io_uring backend's rings and their fixed buffers: one ring per concurrent call, pooled.

Buffers registered with the backend become fixed buffers of every ring: idle rings at once,
busy ones when their call returns. They are pinned once, however many rings there are: a ring
of its own that does no I/O (the home ring) registers them, and the pool's rings get clones of
its table (Linux 6.12+). Where the kernel cannot clone, every ring registers them itself.
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("dcp_datastates")

#: Failures of ``dsu_share_buffers`` worth another try later; any other means the kernel cannot
#: clone fixed buffers between rings (before Linux 6.12: EINVAL).
_TRANSIENT = frozenset({-errno.ENOMEM, -errno.EAGAIN, -errno.EINTR, -errno.EBADFD})

_Buf = tuple[int, int]  # addr, nbytes


class Shim(Protocol):
    """The loaded io_uring shim (a ``ctypes.CDLL``, or a test's wrapper of one): its functions
    take handles, addresses and sizes and return an int (negative: ``-errno``)."""

    # read-only members, so that a CDLL's function pointers (found by __getattr__) match
    @property
    def dsu_create(self) -> Callable[..., int]: ...
    @property
    def dsu_destroy(self) -> Callable[..., int]: ...
    @property
    def dsu_set_buffers(self) -> Callable[..., int]: ...
    @property
    def dsu_share_buffers(self) -> Callable[..., int]: ...
    @property
    def dsu_registered(self) -> Callable[..., int]: ...
    @property
    def dsu_rw(self) -> Callable[..., int]: ...
    @property
    def dsu_fsync(self) -> Callable[..., int]: ...


class _Ring:
    """One native ring and the generation of the backend's buffer set it has registered."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.gen = -1


class RingPool:
    """The rings of one backend (over the loaded shim ``lib``), each keeping ``depth`` I/Os in
    flight, and the set of fixed buffers they share."""

    def __init__(self, lib: Shim, depth: int) -> None:
        self._lib = lib
        self.depth = depth
        self._lock = threading.Lock()  # guards everything below and every ring in _idle
        self._idle: list[_Ring] = []
        self._bufs: list[_Buf] = []  # what the owner registered, in order
        self._plain: set[_Buf] = set()  # buffers the kernel refused to register
        self._gen = 0  # bumped whenever _bufs changes
        self._home: _Ring | None = None  # pins the buffers; the pool's rings share its table
        self._clone: bool | None = None  # whether the kernel clones tables (None: not tried yet)
        self._pid = os.getpid()
        self._closed = False
        self._idle.append(self.new_ring())

    # -- the helpers before acquire run with self._lock held ------------------------------------
    def new_ring(self) -> _Ring:
        handle = ctypes.c_void_p()
        ret = self._lib.dsu_create(self.depth, ctypes.byref(handle))
        if ret < 0:
            raise OSError(-ret, f"io_uring_queue_init failed: {os.strerror(-ret)}")
        assert handle.value is not None
        return _Ring(handle.value)

    def _forget_if_forked(self) -> None:
        """After fork() the rings are the parent's (shared kernel state): never touch them."""
        if self._pid != os.getpid():
            self._idle, self._home, self._pid = [], None, os.getpid()

    def _set(self, ring: _Ring, bufs: list[_Buf]) -> int:
        flat = array.array("Q", [v for buf in bufs for v in buf])
        ptr = flat.buffer_info()[0] if bufs else None
        return self._lib.dsu_set_buffers(ring.handle, ptr, len(bufs))

    def _usable(self, ring: _Ring) -> bool:
        return self._lib.dsu_registered(ring.handle) >= 0

    def _want(self) -> list[_Buf]:
        return [b for b in dict.fromkeys(self._bufs) if b not in self._plain]

    def _sync(self, ring: _Ring) -> bool:
        """Make ``ring``'s fixed buffers the current set; False if the ring is broken."""
        if ring.gen != self._gen:
            home = self._home_ring() if self._clone is not False and self._want() else None
            if home is None:
                self._register(ring)
            else:
                ret = self._lib.dsu_share_buffers(ring.handle, home.handle)
                if ret == 0:
                    self._clone, ring.gen = True, self._gen
                elif self._usable(ring) and ret not in _TRANSIENT:
                    self._stop_cloning(ret)
                    self._register(ring)
                # else: no fixed buffers for now; ring.gen stays stale, so it tries again
        return self._usable(ring)

    def _register(self, ring: _Ring) -> None:
        """Pin the current set in ``ring`` itself (pages already held keep their pin)."""
        want = self._want()
        if self._set(ring, want) < 0 and self._usable(ring):
            self._set_one_by_one(ring, want)
        ring.gen = self._gen

    def _home_ring(self) -> _Ring | None:
        """The home ring, holding the current set; None where it cannot be had now."""
        home = self._home
        if home is None:
            try:
                home = self._home = self.new_ring()
            except OSError:
                return None
        if home.gen != self._gen:
            self._register(home)
        if not self._usable(home):
            self._home = None
            self._lib.dsu_destroy(home.handle)
            return None
        return home

    def _stop_cloning(self, ret: int) -> None:
        self._clone = False
        log.info(
            "dcp_datastates: this kernel cannot share io_uring fixed buffers between rings "
            "(IORING_REGISTER_CLONE_BUFFERS: %s); fixed buffers are pinned once per ring "
            "(up to one per concurrent I/O call) on this kernel",
            os.strerror(-ret),
        )
        home, self._home = self._home, None
        if home is not None:  # it holds the current set: a ring of the pool like any other
            self._idle.append(home)

    def _set_one_by_one(self, ring: _Ring, want: list[_Buf]) -> None:
        """Find the buffers the kernel refuses: each is logged once and served by plain ops."""
        ok: list[_Buf] = []
        ret = 0
        for buf in want:
            ret = self._set(ring, [*ok, buf])
            if not self._usable(ring):
                return
            if ret < 0:
                self._plain.add(buf)
                hint = " (raise RLIMIT_MEMLOCK: ulimit -l)" if ret == -errno.ENOMEM else ""
                log.warning(
                    "dcp_datastates: io_uring cannot register the buffer at %#x (%d bytes): "
                    "%s%s; its I/O uses plain reads and writes",
                    buf[0], buf[1], os.strerror(-ret), hint,
                )
            else:
                ok.append(buf)
        if ret < 0:  # a failed call may leave a part of its set (or none) in the ring
            self._set(ring, ok)

    def _sync_home(self) -> None:
        """Bring the home ring up to date now, even while every pool ring is busy, so that a
        refused buffer is reported by the call that registers it."""
        if self._clone is not False and (self._home is not None or self._want()):
            self._home_ring()

    def _sync_idle(self) -> None:
        for ring in list(self._idle):
            if not self._sync(ring):
                self._idle.remove(ring)
                self._lib.dsu_destroy(ring.handle)

    def acquire(self) -> _Ring:
        with self._lock:
            if self._closed:
                raise RuntimeError("UringBackend is closed")
            self._forget_if_forked()
            while self._idle:
                ring = self._idle.pop()
                if self._sync(ring):
                    return ring
                self._lib.dsu_destroy(ring.handle)
            ring = self.new_ring()
            self._sync(ring)  # a fresh ring is not broken
            return ring

    def release(self, ring: _Ring, ok: bool) -> None:
        with self._lock:
            mine = self._pid == os.getpid()
            if ok and mine and not self._closed and self._sync(ring):
                self._idle.append(ring)
                return
        self._lib.dsu_destroy(ring.handle)  # after an error the ring is not trusted again

    def register(self, addr: int, nbytes: int) -> None:
        """Make ``[addr, addr+nbytes)`` a fixed buffer of every ring (idle ones now)."""
        if nbytes <= 0:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("UringBackend is closed")
            self._forget_if_forked()
            self._bufs.append((addr, nbytes))
            self._gen += 1
            self._sync_home()
            self._sync_idle()

    def unregister(self, addr: int, nbytes: int) -> None:
        """Drop a registered buffer from every idle ring now (busy rings drop it before their
        next use). Call it with no I/O in flight on the buffer, before freeing its memory."""
        if nbytes <= 0:
            return
        with self._lock:
            if self._closed:
                return  # close() dropped every registration
            self._forget_if_forked()
            try:
                self._bufs.remove((addr, nbytes))
            except ValueError:
                raise ValueError(f"buffer {addr:#x} ({nbytes} bytes) is not registered") from None
            if (addr, nbytes) not in self._bufs:
                self._plain.discard((addr, nbytes))
            self._gen += 1
            self._sync_home()
            self._sync_idle()

    @property
    def shares_buffers(self) -> bool | None:
        """Whether the rings share one pinned copy of the fixed buffers (kernel buffer cloning);
        None until a ring needed them."""
        return self._clone

    def registered_buffers(self) -> int:
        """Fixed-buffer iovecs (one per started GiB of a buffer) the idle rings hold, summed
        (a table shared with the home ring counts in each ring; the home ring is not counted)."""
        with self._lock:
            self._forget_if_forked()
            return sum(max(0, self._lib.dsu_registered(r.handle)) for r in self._idle)

    def close(self) -> None:
        """Destroy the rings and forget every registration (a ring still in use is destroyed
        when its call returns)."""
        with self._lock:
            self._closed = True
            rings, self._idle = self._idle, []
            if self._home is not None:
                rings.append(self._home)
                self._home = None
            self._bufs, self._plain = [], set()
            mine = self._pid == os.getpid()
        if mine:
            for ring in rings:
                self._lib.dsu_destroy(ring.handle)
