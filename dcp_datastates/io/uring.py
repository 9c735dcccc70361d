"""io_uring backend: batched reads and writes through the ``libdcp_uring.so`` C shim (ctypes)."""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from .base import IOReq

__all__ = ["ABI_VERSION", "UringBackend", "UringUnavailable", "check_abi", "shim_path"]

log = logging.getLogger("dcp_datastates")

#: ``DSU_ABI_VERSION`` of native/dcp_uring.h that this module speaks.
ABI_VERSION = 3
#: Returned by ``dsu_rw`` when a read meets end of file (``DSU_EOF`` in native/dcp_uring.h).
_DSU_EOF = -65536
_DISABLED_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")
#: Failures of ``dsu_share_buffers`` worth another try later; any other means the kernel cannot
#: clone fixed buffers between rings (before Linux 6.12: EINVAL).
_TRANSIENT = frozenset({-errno.ENOMEM, -errno.EAGAIN, -errno.EINTR, -errno.EBADFD})

_Buf = tuple[int, int]  # addr, nbytes


class UringUnavailable(RuntimeError):
    """io_uring cannot be used in this process; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"io_uring backend unavailable: {reason}")
        self.reason = reason


def shim_path() -> Path:
    """``$DCP_DATASTATES_SHIM`` if set, else the shim built into ``dcp_datastates/_lib``."""
    env = os.environ.get("DCP_DATASTATES_SHIM")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "_lib" / "libdcp_uring.so"


def check_abi(lib: object, path: Path | str) -> None:
    """Raise :class:`UringUnavailable` unless ``lib`` (the loaded shim at ``path``) reports
    ``dsu_abi_version() == ABI_VERSION``; a shim without that function is version 1."""
    version_fn = getattr(lib, "dsu_abi_version", None)
    version = 1 if version_fn is None else int(version_fn())
    if version != ABI_VERSION:
        raise UringUnavailable(
            f"shim {path} has ABI version {version}, this package needs {ABI_VERSION}; rebuild it"
        )


def _load(path: Path) -> ctypes.CDLL:
    """Load the shim, check its ABI version and declare its signatures."""
    if not path.is_file():
        raise UringUnavailable(f"shim {path} not found (built without liburing-dev?)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise UringUnavailable(f"cannot load shim {path}: {e}") from e
    vp, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    if hasattr(lib, "dsu_abi_version"):
        lib.dsu_abi_version.argtypes, lib.dsu_abi_version.restype = [], c_int
    check_abi(lib, path)
    lib.dsu_create.argtypes, lib.dsu_create.restype = [ctypes.c_uint, ctypes.POINTER(vp)], c_int
    lib.dsu_destroy.argtypes, lib.dsu_destroy.restype = [vp], None
    lib.dsu_set_buffers.argtypes, lib.dsu_set_buffers.restype = [vp, vp, c_size], c_int
    lib.dsu_share_buffers.argtypes, lib.dsu_share_buffers.restype = [vp, vp], c_int
    lib.dsu_registered.argtypes, lib.dsu_registered.restype = [vp], c_int
    lib.dsu_rw.argtypes = [vp, c_int, c_int, vp, c_size, c_size]
    lib.dsu_rw.restype = ctypes.c_int64
    lib.dsu_fsync.argtypes, lib.dsu_fsync.restype = [vp, c_int], c_int
    return lib


def _check_sysctl() -> None:
    """Refuse early when the kernel has io_uring switched off for everyone."""
    try:
        value = _DISABLED_SYSCTL.read_text().strip()
    except OSError:
        return  # older kernels have no such knob
    if value == "2":
        raise UringUnavailable("disabled by sysctl kernel.io_uring_disabled=2")


class _Ring:
    """One native ring and the generation of the backend's buffer set it has registered."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.gen = -1


class UringBackend:
    """IOBackend over io_uring. One ring per concurrent caller, created lazily and kept in a pool.

    ``depth`` is the number of I/Os each call keeps in flight and ``max_io`` the largest single
    I/O. Buffers passed to :meth:`register` become fixed buffers of every ring: idle rings at
    once, busy ones when their call returns. A buffer the kernel refuses (``RLIMIT_MEMLOCK``, an
    unsuitable mapping) is logged once and served with plain reads and writes.

    The buffers are pinned (and charged to ``RLIMIT_MEMLOCK`` / ``VmPin``) once, however many
    rings there are: a ring of their own that does no I/O (the home ring) registers them, and
    the pool's rings get clones of its table (Linux 6.12+), which share the pinned pages. Where
    the kernel cannot clone, that is logged once at INFO and every ring registers (pins) the
    buffers itself, the home ring joining the pool.
    """

    name = "uring"

    def __init__(self, depth: int = 64, max_io: int = 4 << 20, shim: str | Path | None = None,
                 wrap_shim: Callable[[ctypes.CDLL], object] | None = None):
        """``wrap_shim`` wraps the loaded shim (tests inject kernel behaviours through it)."""
        _check_sysctl()
        self._lib = _load(Path(shim) if shim is not None else shim_path())
        if wrap_shim is not None:
            self._lib = wrap_shim(self._lib)
        self.depth, self.max_io = depth, max_io
        self._lock = threading.Lock()  # guards everything below and every ring in _idle
        self._idle: list[_Ring] = []
        self._bufs: list[_Buf] = []  # what the owner registered, in order
        self._plain: set[_Buf] = set()  # buffers the kernel refused to register
        self._gen = 0  # bumped whenever _bufs changes
        self._home: _Ring | None = None  # pins the buffers; the pool's rings share its table
        self._clone: bool | None = None  # whether the kernel clones tables (None: not tried yet)
        self._pid = os.getpid()
        self._closed = False
        try:
            ring = self._new_ring()
        except OSError as e:
            hint = (
                " (see sysctl kernel.io_uring_disabled / seccomp)" if e.errno == errno.EPERM else ""
            )
            raise UringUnavailable(f"io_uring_queue_init failed: {e.strerror}{hint}") from e
        self._idle.append(ring)

    # -- rings and their fixed buffers (the helpers before _acquire run with self._lock held) --
    def _new_ring(self) -> _Ring:
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
                home = self._home = self._new_ring()
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

    def _acquire(self) -> _Ring:
        with self._lock:
            if self._closed:
                raise RuntimeError("UringBackend is closed")
            self._forget_if_forked()
            while self._idle:
                ring = self._idle.pop()
                if self._sync(ring):
                    return ring
                self._lib.dsu_destroy(ring.handle)
            ring = self._new_ring()
            self._sync(ring)  # a fresh ring is not broken
            return ring

    def _release(self, ring: _Ring, ok: bool) -> None:
        with self._lock:
            mine = self._pid == os.getpid()
            if ok and mine and not self._closed and self._sync(ring):
                self._idle.append(ring)
                return
        self._lib.dsu_destroy(ring.handle)  # after an error the ring is not trusted again

    # -- IOBackend ------------------------------------------------------------------------------
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

    def _rw(self, write: bool, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        flat = array.array("Q")
        for r in reqs:
            if r.nbytes < 0 or r.offset < 0 or r.addr < 0:
                raise ValueError(f"invalid I/O request {r}")
            if r.nbytes:
                flat.extend((r.addr, r.nbytes, r.offset))
        n = len(flat) // 3
        if n == 0:
            return
        ring = self._acquire()
        ret = -errno.EBADFD
        try:
            ret = self._lib.dsu_rw(
                ring.handle, int(write), fd, flat.buffer_info()[0], n, self.max_io
            )
        finally:
            self._release(ring, ret == 0)
        if ret == _DSU_EOF:
            raise OSError(errno.EIO, "unexpected end of file while reading", path)
        if ret < 0:
            op = "write" if write else "read"
            raise OSError(-ret, f"{op} failed: {os.strerror(-ret)}", path)

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Write every request in full."""
        self._rw(True, fd, path, reqs)

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        """Read every request in full; EOF before the end raises ``OSError(EIO)``."""
        self._rw(False, fd, path, reqs)

    def fsync(self, fd: int, path: str) -> None:
        """Make the file's data durable (IORING_OP_FSYNC)."""
        ring = self._acquire()
        ret = -errno.EBADFD
        try:
            ret = self._lib.dsu_fsync(ring.handle, fd)
        finally:
            self._release(ring, ret == 0)
        if ret < 0:
            raise OSError(-ret, f"fsync failed: {os.strerror(-ret)}", path)

    def close(self) -> None:
        """Destroy the rings and forget every registration. Call it with no I/O in flight (a
        call still running destroys its ring when it returns)."""
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
