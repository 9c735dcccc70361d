"""io_uring backend: batched reads and writes through the ``libdcp_uring.so`` C shim (ctypes)."""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from .base import IOReq

__all__ = ["UringBackend", "UringUnavailable", "shim_path"]

log = logging.getLogger("dcp_datastates")

#: Returned by ``dsu_rw`` when a read meets end of file (``DSU_EOF`` in native/dcp_uring.h).
_DSU_EOF = -65536
_DISABLED_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")
_libs: dict[str, ctypes.CDLL] = {}
_libs_lock = threading.Lock()


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


def _load(path: Path) -> ctypes.CDLL:
    """Load the shim once per path and declare its signatures."""
    key = str(path)
    with _libs_lock:
        if key in _libs:
            return _libs[key]
        if not path.is_file():
            raise UringUnavailable(f"shim {path} not found (build it with CMake)")
        try:
            lib = ctypes.CDLL(key)
        except OSError as e:
            raise UringUnavailable(f"cannot load shim {path}: {e}") from e
        vp, c_int = ctypes.c_void_p, ctypes.c_int
        lib.dsu_create.argtypes, lib.dsu_create.restype = [ctypes.c_uint, ctypes.POINTER(vp)], c_int
        lib.dsu_destroy.argtypes, lib.dsu_destroy.restype = [vp], None
        lib.dsu_register.argtypes, lib.dsu_register.restype = [vp, vp, ctypes.c_size_t], c_int
        lib.dsu_registered.argtypes, lib.dsu_registered.restype = [vp], c_int
        lib.dsu_rw.argtypes = [vp, c_int, c_int, vp, ctypes.c_size_t, ctypes.c_size_t]
        lib.dsu_rw.restype = ctypes.c_int64
        lib.dsu_fsync.argtypes, lib.dsu_fsync.restype = [vp, c_int], c_int
        _libs[key] = lib
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
    """One native ring plus how many of the backend's buffers it has registered."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.nbufs = 0


class UringBackend:
    """IOBackend over io_uring. One ring per concurrent caller, created lazily and kept in a pool.

    ``depth`` is the number of I/Os each call keeps in flight and ``max_io`` the largest single
    I/O. Buffers passed to :meth:`register` become fixed buffers of every ring (best effort).
    """

    name = "uring"

    def __init__(self, depth: int = 64, max_io: int = 4 << 20, shim: str | Path | None = None):
        _check_sysctl()
        self._lib = _load(Path(shim) if shim is not None else shim_path())
        self.depth, self.max_io = depth, max_io
        self._lock = threading.Lock()
        self._idle: list[_Ring] = []
        self._bufs: list[tuple[int, int]] = []
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

    def _new_ring(self) -> _Ring:
        handle = ctypes.c_void_p()
        ret = self._lib.dsu_create(self.depth, ctypes.byref(handle))
        if ret < 0:
            raise OSError(-ret, f"io_uring_queue_init failed: {os.strerror(-ret)}")
        assert handle.value is not None
        return _Ring(handle.value)

    def _acquire(self) -> _Ring:
        with self._lock:
            if self._closed:
                raise RuntimeError("UringBackend is closed")
            if self._pid != os.getpid():  # forked: the parent's rings are not ours to use
                self._idle, self._pid = [], os.getpid()
            ring = self._idle.pop() if self._idle else None
            bufs = list(self._bufs)
        if ring is None:
            ring = self._new_ring()
        for addr, nbytes in bufs[ring.nbufs :]:
            ret = self._lib.dsu_register(ring.handle, addr, nbytes)
            if ret < 0:
                log.debug(
                    "io_uring buffer registration failed (%s); using plain ops", os.strerror(-ret)
                )
        ring.nbufs = len(bufs)
        return ring

    def _release(self, ring: _Ring, ok: bool) -> None:
        with self._lock:
            if ok and not self._closed and self._pid == os.getpid():
                self._idle.append(ring)
                return
        self._lib.dsu_destroy(ring.handle)  # after an error the ring is not trusted again

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr+nbytes)`` as a fixed buffer of every ring (lazily)."""
        if nbytes > 0:
            with self._lock:
                self._bufs.append((addr, nbytes))

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
        """Destroy idle rings (busy ones are destroyed when their call returns)."""
        with self._lock:
            self._closed = True
            rings, self._idle = self._idle, []
            self._bufs = []
            mine = self._pid == os.getpid()
        if mine:
            for ring in rings:
                self._lib.dsu_destroy(ring.handle)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # half-built object or interpreter shutdown
            self.close()
