"""Round-trip, O_DIRECT, error and selection tests for the I/O backends.

Zero-length requests are part of the contract: they are accepted and do nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dcp_datastates.io as dio
from dcp_datastates.io import ALIGN, IOBackend, IOReq, ThreadPoolBackend, get_backend
from dcp_datastates.io.uring import UringBackend, UringUnavailable

MiB = 1 << 20
BUF = 16 * MiB


def _uring(**kw: int) -> UringBackend:
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


@pytest.fixture
def clean_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DCP_DATASTATES_IO", raising=False)
    monkeypatch.delenv("DCP_DATASTATES_SHIM", raising=False)
    dio._reset()
    yield
    dio._reset()


@pytest.mark.usefixtures("clean_selection")
def test_get_backend_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_DATASTATES_IO", "threads")
    b = get_backend("uring")
    assert isinstance(b, ThreadPoolBackend) and b.name == "threads"
    assert get_backend() is b  # one shared instance per name


@pytest.mark.usefixtures("clean_selection")
def test_get_backend_bad_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="auto, uring, threads"):
        get_backend("fast")
    monkeypatch.setenv("DCP_DATASTATES_IO", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        get_backend("threads")


@pytest.mark.usefixtures("clean_selection")
def test_get_backend_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    missing = tmp_path / "nope" / "libdcp_uring.so"
    monkeypatch.setenv("DCP_DATASTATES_SHIM", str(missing))
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        b = get_backend("auto")
        assert get_backend("auto") is b
        assert isinstance(b, ThreadPoolBackend)
    records = [r for r in caplog.records if r.name == "dcp_datastates"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING and str(missing) in records[0].getMessage()
    with pytest.raises(UringUnavailable, match="not found"):
        get_backend("uring")


@pytest.mark.usefixtures("clean_selection")
def test_get_backend_auto_prefers_uring(caplog: pytest.LogCaptureFixture) -> None:
    _uring().close()  # skips when io_uring is unavailable
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        b = get_backend()
        assert get_backend("uring") is b and b.name == "uring"
    assert [r.levelno for r in caplog.records if r.name == "dcp_datastates"] == [logging.INFO]
