"""io_uring backend: batched reads and writes through the ``libdcp_uring.so`` C shim (ctypes)."""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import UringUnavailable
from .base import IOReq
from .rings import RingPool, Shim

__all__ = ["ABI_VERSION", "UringBackend", "check_abi", "shim_path"]

log = logging.getLogger("dcp_datastates")

#: ``DSU_ABI_VERSION`` of native/dcp_uring.h that this module speaks.
ABI_VERSION = 3
#: Returned by ``dsu_rw`` when a read meets end of file (``DSU_EOF`` in native/dcp_uring.h).
_DSU_EOF = -65536
_DISABLED_SYSCTL = Path("/proc/sys/kernel/io_uring_disabled")


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
                 wrap_shim: Callable[[ctypes.CDLL], Shim] | None = None):
        """``wrap_shim`` wraps the loaded shim (tests inject kernel behaviours through it)."""
        _check_sysctl()
        lib = _load(Path(shim) if shim is not None else shim_path())
        self._lib: Shim = wrap_shim(lib) if wrap_shim is not None else lib
        self.depth, self.max_io = depth, max_io
        try:
            self._rings = RingPool(self._lib, depth)
        except OSError as e:
            hint = (
                " (see sysctl kernel.io_uring_disabled / seccomp)" if e.errno == errno.EPERM else ""
            )
            raise UringUnavailable(f"io_uring_queue_init failed: {e.strerror}{hint}") from e

    # -- IOBackend ------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int) -> None:
        """Make ``[addr, addr+nbytes)`` a fixed buffer of every ring (idle ones now)."""
        self._rings.register(addr, nbytes)

    def unregister(self, addr: int, nbytes: int) -> None:
        """Drop a registered buffer from every idle ring now (busy rings drop it before their
        next use). Call it with no I/O in flight on the buffer, before freeing its memory."""
        self._rings.unregister(addr, nbytes)

    @property
    def shares_buffers(self) -> bool | None:
        """Whether the rings share one pinned copy of the fixed buffers (kernel buffer cloning);
        None until a ring needed them."""
        return self._rings.shares_buffers

    def registered_buffers(self) -> int:
        """Fixed-buffer iovecs (one per started GiB of a buffer) the idle rings hold, summed
        (a table shared with the home ring counts in each ring; the home ring is not counted)."""
        return self._rings.registered_buffers()

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
        ring = self._rings.acquire()
        ret = -errno.EBADFD
        try:
            ret = self._lib.dsu_rw(
                ring.handle, int(write), fd, flat.buffer_info()[0], n, self.max_io
            )
        finally:
            self._rings.release(ring, ret == 0)
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
        ring = self._rings.acquire()
        ret = -errno.EBADFD
        try:
            ret = self._lib.dsu_fsync(ring.handle, fd)
        finally:
            self._rings.release(ring, ret == 0)
        if ret < 0:
            raise OSError(-ret, f"fsync failed: {os.strerror(-ret)}", path)

    def close(self) -> None:
        """Destroy the rings and forget every registration. Call it with no I/O in flight (a
        call still running destroys its ring when it returns)."""
        self._rings.close()
