"""Round-trip, O_DIRECT, error and selection tests for the I/O backends.

Zero-length requests are part of the contract: they are accepted and do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.fakes import FaultyBackend

from dcp_datastates._format.align import ALIGN
from dcp_datastates._io import IOBackend, IOReq, ThreadPoolBackend, make_backend
from dcp_datastates._io.uring import (
    ABI_VERSION,
    UringBackend,
    UringUnavailable,
    check_abi,
    shim_path,
)

MiB = 1 << 20
BUF = 16 * MiB


def _uring(**kw: object) -> UringBackend:
    try:
        return UringBackend(**kw)
    except UringUnavailable as e:
        pytest.skip(f"io_uring backend unavailable here: {e.reason}")


# Small pieces / shallow rings so that requests get split and outnumber the ring depth.
KINDS = ["threads", "uring", "uring-fixed"]


def _make(kind: str, registered: mmap.mmap | None = None) -> IOBackend:
    if kind == "threads":
        return ThreadPoolBackend(workers=4, piece=1 * MiB)
    b = _uring(depth=8, max_io=1 * MiB)
    if kind == "uring-fixed" and registered is not None:
        b.register(_addr(registered), len(registered))
    return b


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _addr(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _random_layout(seed: int, n: int = 300) -> list[tuple[int, int, int]]:
    """(mem_offset, nbytes, file_offset) triples; regions never overlap in memory or in the file."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.05:
            sizes.append(0)
        elif pick < 0.45:
            sizes.append(rng.randint(1, 5000))  # small, unaligned
        elif pick < 0.85:
            sizes.append(ALIGN * rng.randint(1, 16))  # page multiples
        else:
            sizes.append(rng.randint(MiB // 2, 3 * MiB))  # large, split into pieces
    sizes = sizes[: _fit(sizes)]
    out, fpos = [], 0
    mem = _place(sizes, rng)
    for size, moff in zip(sizes, mem, strict=True):
        fpos += rng.choice([0, 0, rng.randint(1, 999), ALIGN])
        if rng.random() < 0.5:
            fpos = -(-fpos // ALIGN) * ALIGN
        out.append((moff, size, fpos))
        fpos += size
    rng.shuffle(out)
    return out


def _fit(sizes: list[int]) -> int:
    total = 0
    for i, s in enumerate(sizes):
        total += s + 2 * ALIGN
        if total > BUF:
            return i
    return len(sizes)


def _place(sizes: list[int], rng: random.Random) -> list[int]:
    """Memory offsets in a shuffled order (so memory and file layouts differ)."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    offs, pos = [0] * len(sizes), 0
    for i in order:
        pos += rng.choice([0, rng.randint(1, ALIGN - 1), ALIGN])
        offs[i] = pos
        pos += sizes[i]
    assert pos <= BUF
    return offs


def _expected_file(layout: list[tuple[int, int, int]], src: bytes) -> bytes:
    img = bytearray(max(f + n for _, n, f in layout))
    for m, n, f in layout:
        img[f : f + n] = src[m : m + n]
    return bytes(img)


@pytest.fixture(scope="module")
def src() -> Iterator[mmap.mmap]:
    buf = mmap.mmap(-1, BUF)
    buf[:] = random.Random(7).randbytes(BUF)
    yield buf


def _roundtrip(kind: str, src: mmap.mmap, path: Path, seed: int) -> bytes:
    layout = _random_layout(seed)
    backend = _make(kind, src)
    dst = mmap.mmap(-1, BUF)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            reqs = [IOReq(_addr(src) + m, n, f) for m, n, f in layout]
            backend.write(fd, str(path), reqs)
            backend.fsync(fd, str(path))
            data = path.read_bytes()
            assert data == _expected_file(layout, bytes(src))
            if kind == "uring-fixed":
                backend.register(_addr(dst), BUF)
            backend.read(fd, str(path), [IOReq(_addr(dst) + m, n, f) for m, n, f in layout])
        finally:
            os.close(fd)
        for m, n, _ in layout:
            assert dst[m : m + n] == src[m : m + n]
        return data
    finally:
        backend.close()
        dst.close()


def test_roundtrip(kind: str, src: mmap.mmap, tmp_path: Path) -> None:
    _roundtrip(kind, src, tmp_path / "f.bin", seed=1)


def test_backends_write_identical_files(src: mmap.mmap, tmp_path: Path) -> None:
    a = _roundtrip("threads", src, tmp_path / "a.bin", seed=2)
    b = _roundtrip("uring-fixed", src, tmp_path / "b.bin", seed=2)
    assert a == b


def test_concurrent_callers(kind: str, src: mmap.mmap, tmp_path: Path) -> None:
    backend = _make(kind, src)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            p = tmp_path / f"c{i}.bin"
            off = i * 2 * MiB
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                backend.write(fd, str(p), [IOReq(_addr(src) + off, 2 * MiB, 0)])
            finally:
                os.close(fd)
            assert p.read_bytes() == src[off : off + 2 * MiB]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    backend.close()
    assert not errors


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"O_DIRECT unsupported on the filesystem of {path}")
        raise


def test_o_direct(kind: str, tmp_path: Path) -> None:
    n = 8 * MiB
    src, dst = mmap.mmap(-1, n), mmap.mmap(-1, n)
    src[:] = random.Random(3).randbytes(n)
    backend = _make(kind, src)
    path = tmp_path / "direct.bin"
    fd = _open_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        # aligned, out of order, several pieces each
        reqs = [IOReq(_addr(src) + o, 2 * MiB, o) for o in (6 * MiB, 0, 4 * MiB, 2 * MiB)]
        backend.write(fd, str(path), reqs)
        backend.fsync(fd, str(path))
        backend.read(
            fd, str(path), [IOReq(_addr(dst) + r.offset, r.nbytes, r.offset) for r in reqs]
        )
    finally:
        os.close(fd)
        backend.close()
    assert dst[:] == src[:]
    assert path.read_bytes() == src[:]


def test_o_direct_read_past_eof(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * (ALIGN + 100))
    buf = mmap.mmap(-1, 4 * ALIGN)
    backend = _make(kind, buf)
    fd = _open_direct(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            backend.read(fd, str(path), [IOReq(_addr(buf), 2 * ALIGN, 0)])
    finally:
        os.close(fd)
        backend.close()
    assert ei.value.errno == errno.EIO
    assert str(path) in str(ei.value)


@pytest.mark.parametrize("offset", [0, 600, 5000])
def test_read_past_eof(kind: str, tmp_path: Path, offset: int) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(b"y" * 1000)
    buf = mmap.mmap(-1, MiB)
    backend = _make(kind, buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            backend.read(fd, str(path), [IOReq(_addr(buf), 2000, offset)])
        assert ei.value.errno == errno.EIO
        assert "unexpected end of file" in str(ei.value) and str(path) in str(ei.value)
        backend.read(fd, str(path), [IOReq(_addr(buf), 1000, 0)])  # still usable afterwards
        assert buf[:1000] == b"y" * 1000
    finally:
        os.close(fd)
        backend.close()


def test_write_to_read_only_fd(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    buf = mmap.mmap(-1, MiB)
    backend = _make(kind, buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            backend.write(
                fd, str(path), [IOReq(_addr(buf) + i * 4096, 4096, i * 4096) for i in range(40)]
            )
    finally:
        os.close(fd)
        backend.close()
    assert ei.value.errno == errno.EBADF
    assert ei.value.filename == str(path) and str(path) in str(ei.value)
    assert "write failed" in str(ei.value)


def test_fsync(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    buf = mmap.mmap(-1, MiB)
    backend = _make(kind, buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        backend.write(fd, str(path), [IOReq(_addr(buf), MiB, 0), IOReq(_addr(buf), 0, 7)])
        backend.fsync(fd, str(path))
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        backend.fsync(fd, str(path))  # closed descriptor
    backend.close()
    assert ei.value.errno == errno.EBADF and str(path) in str(ei.value)


def test_zero_length_only(kind: str, tmp_path: Path) -> None:
    backend = _make(kind)
    fd = os.open(tmp_path / "z.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        backend.write(fd, "z", [IOReq(0, 0, 0)] * 5)
        backend.read(fd, "z", [IOReq(0, 0, 123)])
        backend.write(fd, "z", [])
    finally:
        os.close(fd)
        backend.close()


# -- selection -----------------------------------------------------------------------------------
@pytest.fixture
def clean_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_DATASTATES_IO", raising=False)
    monkeypatch.delenv("DCP_DATASTATES_SHIM", raising=False)


@pytest.mark.usefixtures("clean_selection")
def test_make_backend_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_DATASTATES_IO", "threads")
    b, msg = make_backend("uring")
    c, _ = make_backend()
    try:
        assert isinstance(b, ThreadPoolBackend) and b.name == "threads"
        assert c is not b  # a new backend per call
        assert msg.endswith("using the thread-pool I/O backend (DCP_DATASTATES_IO=threads)")
    finally:
        b.close()
        c.close()


@pytest.mark.usefixtures("clean_selection")
def test_make_backend_bad_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="auto, uring, threads"):
        make_backend("fast")
    monkeypatch.setenv("DCP_DATASTATES_IO", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        make_backend("threads")


@pytest.mark.usefixtures("clean_selection")
def test_make_backend_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "libdcp_uring.so"
    monkeypatch.setenv("DCP_DATASTATES_SHIM", str(missing))
    b, msg = make_backend("auto")
    b.close()
    assert isinstance(b, ThreadPoolBackend)
    assert str(missing) in msg and msg.endswith("falling back to the thread-pool I/O backend")
    with pytest.raises(UringUnavailable, match="not found"):
        make_backend("uring")


@pytest.mark.usefixtures("clean_selection")
def test_make_backend_auto_prefers_uring() -> None:
    _uring().close()  # skips when io_uring is unavailable
    b, msg = make_backend()
    b.close()
    assert isinstance(b, UringBackend) and b.name == "uring"
    assert msg == "dcp_datastates: using the io_uring I/O backend"


# -- shim ABI ------------------------------------------------------------------------------------
def test_shim_reports_abi_version(tmp_path: Path) -> None:
    _uring().close()
    assert ctypes.CDLL(str(shim_path())).dsu_abi_version() == ABI_VERSION
    copy = tmp_path / "libcopy.so"
    shutil.copy(shim_path(), copy)
    UringBackend(shim=copy).close()  # each backend loads the shim it is given


@pytest.mark.parametrize("version", [None, 1, ABI_VERSION - 1, ABI_VERSION + 1])
def test_check_abi_refuses_other_versions(version: int | None) -> None:
    lib = SimpleNamespace() if version is None else SimpleNamespace(dsu_abi_version=lambda: version)
    want = (
        f"shim /x/libdcp_uring.so has ABI version {version or 1}, "
        f"this package needs {ABI_VERSION}; rebuild it"
    )
    with pytest.raises(UringUnavailable) as ei:
        check_abi(lib, "/x/libdcp_uring.so")
    assert ei.value.reason == want
    check_abi(SimpleNamespace(dsu_abi_version=lambda: ABI_VERSION), "/x/libdcp_uring.so")


@pytest.mark.usefixtures("clean_selection")
def test_library_without_abi_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any shared object lacking ``dsu_abi_version`` (here libc) counts as ABI version 1."""
    _uring().close()
    libc = next((p for p in _mapped_files() if Path(p).name.startswith("libc.so")), None)
    if libc is None:
        pytest.skip("libc is not mapped from a file named libc.so*")
    with pytest.raises(UringUnavailable, match=f"ABI version 1, this package needs {ABI_VERSION}"):
        UringBackend(shim=libc)
    monkeypatch.setenv("DCP_DATASTATES_SHIM", libc)
    b, msg = make_backend()
    b.close()
    assert isinstance(b, ThreadPoolBackend) and "rebuild it; falling back" in msg


def _mapped_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if "/" in line]


# -- registration --------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED_NOREPLACE = 0x100000
_RW = mmap.PROT_READ | mmap.PROT_WRITE


@contextlib.contextmanager
def _anon(nbytes: int, at: int | None = None) -> Iterator[int]:
    """Anonymous memory mapped with libc (at ``at`` exactly, else the test skips)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_MAP_FIXED_NOREPLACE if at else 0)
    addr = _libc.mmap(at, nbytes, _RW, flags, -1, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        if at is not None and addr != at:
            pytest.skip("the kernel ignores MAP_FIXED_NOREPLACE")
        yield addr
    finally:
        _libc.munmap(addr, nbytes)


def _write_file(backend: IOBackend, path: Path, addr: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        backend.write(fd, str(path), [IOReq(addr, nbytes, 0)])
    finally:
        os.close(fd)
    return path.read_bytes()


def _plain(kind: str) -> IOBackend:
    return ThreadPoolBackend(workers=4, piece=MiB) if kind == "threads" else _uring(max_io=MiB)


@pytest.mark.parametrize("kind", ["threads", "uring"])
def test_unregister_then_new_memory_at_same_address(kind: str, tmp_path: Path) -> None:
    n, path = 2 * MiB, tmp_path / "f.bin"
    backend = _plain(kind)
    try:
        with _anon(n) as addr:
            ctypes.memset(addr, 0xAA, n)
            backend.register(addr, n)
            if isinstance(backend, UringBackend):
                assert backend.registered_buffers() == 1
            assert _write_file(backend, path, addr, n) == b"\xaa" * n
            backend.unregister(addr, n)
            if isinstance(backend, UringBackend):
                assert backend.registered_buffers() == 0
        with _anon(n, at=addr) as again:
            ctypes.memset(again, 0x55, n)
            assert _write_file(backend, path, again, n) == b"\x55" * n
    finally:
        backend.close()


def test_stale_registration_writes_freed_pages(tmp_path: Path) -> None:
    """Why ``unregister`` exists: a fixed buffer keeps its old pages, whatever is mapped now."""
    n, path = MiB, tmp_path / "f.bin"
    backend = _uring(max_io=MiB)
    try:
        with _anon(n) as addr:
            ctypes.memset(addr, 0xAA, n)
            backend.register(addr, n)
        with _anon(n, at=addr) as again:
            ctypes.memset(again, 0x55, n)
            assert _write_file(backend, path, again, n) == b"\xaa" * n
            backend.unregister(addr, n)
            assert _write_file(backend, path, again, n) == b"\x55" * n
    finally:
        backend.close()


def test_changing_the_set_keeps_existing_registrations(tmp_path: Path) -> None:
    """Registering or dropping another buffer leaves the others' registrations (and pins) as they
    are, instead of pinning every buffer anew: seen here through a stale registration, which
    keeps writing the pages it pinned first."""
    n, path = MiB, tmp_path / "f.bin"
    backend = _uring(max_io=MiB)
    other, third = mmap.mmap(-1, n), mmap.mmap(-1, n)
    try:
        with _anon(n) as addr:
            ctypes.memset(addr, 0xAA, n)
            backend.register(addr, n)
        with _anon(n, at=addr) as again:
            ctypes.memset(again, 0x55, n)
            backend.register(_addr(other), n)
            backend.register(_addr(third), n)
            backend.unregister(_addr(other), n)
            assert backend.registered_buffers() == 2
            assert _write_file(backend, path, again, n) == b"\xaa" * n  # the first pin
            backend.unregister(addr, n)
            assert _write_file(backend, path, again, n) == b"\x55" * n
    finally:
        backend.close()


def test_unregister_unknown_buffer(tmp_path: Path) -> None:
    backend = _uring()
    try:
        with pytest.raises(ValueError, match="not registered"):
            backend.unregister(0x10000, MiB)
    finally:
        backend.close()
    backend.unregister(0x10000, MiB)  # closed: every registration is gone already


def _uring_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]"
    return n


def _wait_for(cond: Callable[[], bool], timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _busy_rings(
    backend: UringBackend, k: int, into: int | None = None
) -> tuple[list[threading.Thread], list[int]]:
    """``k`` threads, each blocked in a read from its own pipe (write to the pipe to free it)
    of one byte to ``into + i * ALIGN`` (default: a buffer of its own)."""
    pipes = [os.pipe() for _ in range(k)]
    sink = mmap.mmap(-1, k * ALIGN)  # the threads keep it alive

    def read(i: int) -> None:
        base = _addr(sink) if into is None else into
        backend.read(pipes[i][0], "pipe", [IOReq(base + i * ALIGN, 1, 0)])
        os.close(pipes[i][0])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    return threads, [w for _, w in pipes]


def _free(threads: list[threading.Thread], writers: list[int]) -> None:
    for w in writers:
        os.write(w, b"x")
        os.close(w)
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_registration_reaches_idle_and_busy_rings() -> None:
    backend, k = _uring(depth=4), 3
    buf = mmap.mmap(-1, MiB)
    try:
        before = _uring_fds()
        threads, writers = _busy_rings(backend, k)  # the idle ring plus k - 1 new ones
        _wait_for(lambda: _uring_fds() == before + k - 1)
        backend.register(_addr(buf), MiB)
        assert backend.registered_buffers() == 0  # no ring is idle
        _free(threads, writers)
        assert backend.registered_buffers() == k  # each ring registered it when it came back

        threads, writers = _busy_rings(backend, k)
        _wait_for(lambda: backend.registered_buffers() == 0)  # all k rings taken
        backend.unregister(_addr(buf), MiB)
        _free(threads, writers)
        assert backend.registered_buffers() == 0  # they dropped it before going idle

        backend.register(_addr(buf), MiB)  # idle rings register at once
        assert backend.registered_buffers() == k
        backend.unregister(_addr(buf), MiB)
        assert backend.registered_buffers() == 0
    finally:
        backend.close()


def test_refused_registration_is_logged_once(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The kernel pins fixed buffers for writing, so it refuses a read-only mapping; writes
    from it still work (plain ops), and the other buffers stay fixed."""
    backend, n = _uring(max_io=MiB), MiB
    good, other = mmap.mmap(-1, n), mmap.mmap(-1, n)
    good[:] = b"g" * n
    try:
        with _anon(n) as ro, caplog.at_level(logging.WARNING, logger="dcp_datastates"):
            ctypes.memset(ro, 0x5A, n)
            assert _libc.mprotect(ro, n, mmap.PROT_READ) == 0
            backend.register(ro, n)
            backend.register(_addr(good), n)
            backend.register(_addr(other), n)  # the refused buffer is not tried (or logged) again
            assert backend.registered_buffers() == 2
            assert _write_file(backend, tmp_path / "ro.bin", ro, n) == b"\x5a" * n
            assert _write_file(backend, tmp_path / "good.bin", _addr(good), n) == b"g" * n
            backend.unregister(ro, n)
            assert backend.registered_buffers() == 2
        warnings = [r.getMessage() for r in caplog.records if r.name == "dcp_datastates"]
        assert len(warnings) == 1, warnings
        assert f"{ro:#x}" in warnings[0] and os.strerror(errno.EFAULT) in warnings[0]
        assert "plain reads and writes" in warnings[0]
    finally:
        backend.close()


def _status(key: str) -> str | None:
    """The first field of ``key`` in /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split()[1]
    return None


def _pinned_kib() -> int:
    """``VmPin``: where io_uring charges the pages of fixed buffers (``mm->pinned_vm``; VmLck
    counts mlock() only)."""
    kib = _status("VmPin")
    assert kib is not None
    return int(kib)


def _settled_pinned_kib() -> int:
    """``VmPin`` once rings closed earlier are gone: the kernel tears a closed ring down (and
    unpins its buffers) in the background."""
    last, end = _pinned_kib(), time.monotonic() + 10
    while time.monotonic() < end:
        time.sleep(0.1)
        now = _pinned_kib()
        if now == last:
            return now
        last = now
    return last


def _skip_unless_pinning_measurable(nbytes: int) -> None:
    if _status("VmPin") is None:
        pytest.skip("no VmPin in /proc/self/status")
    cap_eff = int(_status("CapEff") or "0", 16)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not cap_eff >> 14 & 1 and soft != resource.RLIM_INFINITY and soft < nbytes:  # IPC_LOCK
        pytest.skip(f"RLIMIT_MEMLOCK {soft} bytes is too small to register {nbytes} bytes")


def _make_rings(backend: UringBackend, k: int) -> None:
    """Leave ``k`` idle rings in the pool (``k`` calls in flight at once create them)."""
    before = _uring_fds()
    threads, writers = _busy_rings(backend, k)
    _wait_for(lambda: _uring_fds() == before + k - 1)
    _free(threads, writers)


def test_buffers_pinned_once_however_many_rings() -> None:
    """Every ring uses the fixed buffers, but their pages are pinned (and charged to VmPin /
    RLIMIT_MEMLOCK) once: the rings share one registration. A buffer registered or dropped
    while rings are busy keeps that bound, and after unregister nothing stays pinned."""
    a_n, b_n, k = 64 * MiB, 16 * MiB, 4
    _skip_unless_pinning_measurable(a_n + b_n)
    backend = _uring(depth=4, max_io=MiB)
    try:
        with _anon(a_n) as a, _anon(b_n) as b:
            _make_rings(backend, k)
            base = _settled_pinned_kib()
            backend.register(a, a_n)
            if backend.shares_buffers is False:
                pytest.skip("this kernel cannot clone fixed buffers (Linux < 6.12)")
            assert backend.registered_buffers() == k  # each ring holds the buffer ...
            grown = _pinned_kib() - base
            assert a_n // 1024 <= grown < 1.5 * a_n // 1024  # ... pinned once, not k times

            # k rings busy, each with a fixed-buffer read into `a` in flight
            threads, writers = _busy_rings(backend, k, into=a)
            _wait_for(lambda: backend.registered_buffers() == 0)
            backend.register(b, b_n)  # `a` keeps its pin: only `b` is pinned now
            both = _pinned_kib() - base
            assert (a_n + b_n) // 1024 <= both < (a_n + b_n + a_n // 2) // 1024
            backend.unregister(a, a_n)  # the busy rings still hold `a` ...
            assert _pinned_kib() - base == both
            _free(threads, writers)
            assert ctypes.string_at(a, k * ALIGN)[::ALIGN] == b"x" * k
            # ... until they come back and drop it
            assert backend.registered_buffers() == k  # `b` alone
            assert b_n // 1024 <= _pinned_kib() - base < 1.5 * b_n // 1024
            backend.unregister(b, b_n)
            assert backend.registered_buffers() == 0
            assert _pinned_kib() == base
    finally:
        backend.close()


class _NoClone:
    """The shim as on a kernel without IORING_REGISTER_CLONE_BUFFERS (before Linux 6.12)."""

    def __init__(self, lib: object) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    @staticmethod
    def dsu_share_buffers(dst: int, src: int) -> int:
        return -errno.EINVAL


def test_without_clone_every_ring_pins(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Where the kernel refuses cloning, every ring registers the buffers itself (as before
    Linux 6.12), which is said once at INFO; I/O and unregister work as usual."""
    n, k = MiB, 3
    _skip_unless_pinning_measurable((k + 1) * n)
    backend = _uring(depth=4, max_io=MiB, wrap_shim=_NoClone)
    try:
        with _anon(n) as a, caplog.at_level(logging.INFO, logger="dcp_datastates"):
            ctypes.memset(a, 0x3C, n)
            _make_rings(backend, k)
            base = _settled_pinned_kib()
            backend.register(a, n)
            assert backend.shares_buffers is False
            # the ring that was to be the home ring joined the pool with its registration
            assert backend.registered_buffers() == k + 1
            assert _pinned_kib() - base == (k + 1) * n // 1024
            assert _write_file(backend, tmp_path / "a.bin", a, n) == b"\x3c" * n
            backend.unregister(a, n)
            backend.register(a, n)
            backend.unregister(a, n)
            assert backend.registered_buffers() == 0
            assert _pinned_kib() == base
        infos = [r.getMessage() for r in caplog.records if r.name == "dcp_datastates"]
        assert len(infos) == 1, infos
        assert "pinned once per ring" in infos[0] and os.strerror(errno.EINVAL) in infos[0]
    finally:
        backend.close()


_MEMLOCK_SCRIPT = """
import ctypes, logging, mmap, os, resource, sys
from dcp_datastates._io import IOReq, UringBackend
logging.basicConfig(level=logging.WARNING, format="%(message)s")
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
backend, buf = UringBackend(max_io=1 << 20), mmap.mmap(-1, 4 << 20)
buf[:] = b"m" * len(buf)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
backend.register(addr, len(buf))
fd = os.open(sys.argv[1], os.O_WRONLY)
backend.write(fd, sys.argv[1], [IOReq(addr, len(buf), 0)])
print("fixed buffers:", backend.registered_buffers())
"""


def test_memlock_limit_refusal(tmp_path: Path) -> None:
    """Over RLIMIT_MEMLOCK (root: with CAP_IPC_LOCK dropped) a buffer is refused, and said so."""
    _uring().close()
    cmd = [sys.executable, "-c", _MEMLOCK_SCRIPT, str(tmp_path / "m.bin")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: CAP_IPC_LOCK bypasses RLIMIT_MEMLOCK")
        cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-ipc_lock", *cmd]
    (tmp_path / "m.bin").touch()
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "fixed buffers: 0\n"
    assert "Cannot allocate memory (raise RLIMIT_MEMLOCK" in out.stderr
    assert (tmp_path / "m.bin").read_bytes() == b"m" * (4 << 20)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads, Python 3.12
def test_fork_child_leaves_parent_rings_alone(tmp_path: Path) -> None:
    backend, n = _uring(max_io=MiB), MiB
    buf = mmap.mmap(-1, n)
    buf[:] = b"p" * n
    backend.register(_addr(buf), n)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:  # the parent's ring is shared kernel state: these must not touch it
                backend.unregister(_addr(buf), n)
                backend.register(_addr(buf), n)
                code = 0 if _write_file(backend, tmp_path / "c.bin", _addr(buf), n) == buf[:] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert backend.registered_buffers() == 1
        assert _write_file(backend, tmp_path / "p.bin", _addr(buf), n) == b"p" * n
    finally:
        backend.close()


# -- FaultyBackend -------------------------------------------------------------------------------
@pytest.fixture
def page() -> mmap.mmap:
    buf = mmap.mmap(-1, 4 * ALIGN)
    buf[:] = random.Random(5).randbytes(len(buf))
    return buf


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_faulty_fails_after_n_writes(code: int, page: mmap.mmap, tmp_path: Path) -> None:
    fb = FaultyBackend(ThreadPoolBackend(), fail_write_after=2, errno_=code)
    assert fb.name == "faulty(threads)"
    path = tmp_path / "f.bin"
    try:
        for _ in range(2):
            _write_file(fb, path, _addr(page), len(page))
        for _ in range(2):  # a dead disk stays dead
            with pytest.raises(OSError) as ei:
                _write_file(fb, path, _addr(page), len(page))
            assert ei.value.errno == code and ei.value.filename == str(path)
            assert "write failed" in str(ei.value)
        assert fb.writes == 4
    finally:
        fb.close()
    assert fb.closed


@pytest.mark.parametrize("direct", [False, True])
def test_faulty_short_writes(direct: bool, src: mmap.mmap, tmp_path: Path) -> None:
    fb = FaultyBackend(ThreadPoolBackend(workers=4, piece=MiB), short_writes=True)
    path = tmp_path / "f.bin"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    fd = _open_direct(path, flags) if direct else os.open(path, flags, 0o644)
    try:
        if direct:
            layout = [(o, 2 * MiB + ALIGN, o) for o in (0, 4 * MiB)]
        else:
            layout = _random_layout(4)
        fb.write(fd, str(path), [IOReq(_addr(src) + m, n, f) for m, n, f in layout])
    finally:
        os.close(fd)
        fb.close()
    assert fb.writes == 1
    assert path.read_bytes() == _expected_file(layout, bytes(src))


def test_faulty_torn_write(page: mmap.mmap, tmp_path: Path) -> None:
    fb = FaultyBackend(ThreadPoolBackend(), fail_write_after=0, short_writes=True)
    path = tmp_path / "f.bin"
    with pytest.raises(OSError, match="injected"):
        _write_file(fb, path, _addr(page), len(page))
    fb.close()
    assert path.read_bytes() == page[: len(page) // 2]


def test_faulty_gate_and_delay(page: mmap.mmap, tmp_path: Path) -> None:
    fb = FaultyBackend(ThreadPoolBackend(), gated=True, delay_s=0.2)
    path = tmp_path / "f.bin"
    t = threading.Thread(target=_write_file, args=(fb, path, _addr(page), len(page)))
    t.start()
    try:
        assert fb.write_started.wait(10)
        time.sleep(0.1)
        assert t.is_alive() and fb.writes == 0  # held at the gate
        start = time.monotonic()
        fb.gate.set()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - start >= 0.2
    finally:
        fb.gate.set()
        t.join(10)
        fb.close()
    assert path.read_bytes() == page[:]


def test_faulty_fsync_and_reads(page: mmap.mmap, tmp_path: Path) -> None:
    fb = FaultyBackend(ThreadPoolBackend(), fail_fsync=True, fail_read_after=1, errno_=errno.EIO)
    path = tmp_path / "f.bin"
    _write_file(fb, path, _addr(page), len(page))
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="fsync failed") as ei:
            fb.fsync(fd, str(path))
        assert ei.value.errno == errno.EIO
        fb.read(fd, str(path), [IOReq(_addr(page), ALIGN, 0)])
        with pytest.raises(OSError, match="read failed"):
            fb.read(fd, str(path), [IOReq(_addr(page), ALIGN, 0)])
    finally:
        os.close(fd)
        fb.close()
    assert (fb.fsyncs, fb.reads) == (1, 2)


def test_faulty_records_registrations() -> None:
    fb = FaultyBackend(_uring())
    assert fb.name == "faulty(uring)"
    a, b = mmap.mmap(-1, MiB), mmap.mmap(-1, MiB)
    try:
        fb.register(_addr(a), MiB)
        fb.register(_addr(b), MiB)
        fb.unregister(_addr(a), MiB)
        assert fb.live_buffers() == [(_addr(b), MiB)]
        assert isinstance(fb.inner, UringBackend) and fb.inner.registered_buffers() == 1
        fb.unregister(_addr(b), MiB)
        assert fb.live_buffers() == [] and fb.inner.registered_buffers() == 0
    finally:
        fb.close()
