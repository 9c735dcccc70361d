"""The machine's ceilings, measured in the run, and page-cache dropping for cold reads.

Each is the plainest way to move the bytes: one stream, no checksums, no planning. Several
ranks measure at once where each is given the same ``barrier`` (every rank its own file, its
own GPU); ``*_together`` makes one figure of theirs.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from harness.timing import median, sync

GiB = 2**30
BLOCK = 4 << 20  # dd bs=4M


def drop_cache(paths: list[Path]) -> str:
    """Evict files from the page cache: drop_caches if allowed, else fadvise(DONTNEED) each."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def _rw(fd: int, views: list[memoryview], write: bool) -> float:
    """Seconds to write (then fsync) or read ``views`` at the start of ``fd``, in order."""
    t0, offset = time.perf_counter(), 0
    for view in views:
        done = 0
        while done < view.nbytes:
            n = (os.pwritev if write else os.preadv)(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short {'write' if write else 'read'} in a ceiling test")
            done += n
        offset += view.nbytes
    if write:
        os.fsync(fd)
    return time.perf_counter() - t0


def _write_file(path: Path, views: list[memoryview], flags: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        return _rw(fd, views, write=True)
    finally:
        os.close(fd)


def _gib_s(nbytes: int, write_s: float, read_s: float, **more: object) -> dict:
    return {"write_s": write_s, "read_s": read_s, "write_gib_s": nbytes / GiB / write_s,
            "read_gib_s": nbytes / GiB / read_s, **more}


def _alone() -> None:
    """The barrier of a rank measuring alone."""


def disk_ceiling(directory: Path, nbytes: int, *, name: str = "ceiling_disk.bin",
                 barrier: Callable[[], None] = _alone) -> dict:
    """A write of ``nbytes`` (then fsync) and a cold read back, one 4 MiB block at a time with
    O_DIRECT, as ``dd bs=4M oflag=direct conv=fsync`` and ``dd iflag=direct`` do; buffered
    where the file system refuses O_DIRECT (``o_direct`` False, the page cache dropped).
    ``barrier`` is passed before the write, before the cache is dropped and before the read."""
    path, count = directory / name, max(1, nbytes // BLOCK)
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(BLOCK))
    views = [memoryview(buf)] * count
    barrier()
    try:
        write_s, direct = _write_file(path, views, os.O_DIRECT), True
    except OSError:
        write_s, direct = _write_file(path, views, 0), False
    barrier()
    evict = drop_cache([path])
    barrier()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return _gib_s(count * BLOCK, write_s, read_s, o_direct=direct, evict=evict,
                  bytes=count * BLOCK)


def memory_ceiling(directory: Path, src: list[memoryview], dst: list[memoryview]) -> dict:
    """A buffered write of the views ``src`` into a new file (then fsync) and a read of the file,
    still cached, back into ``dst``: what tmpfs or the page cache allow."""
    path = directory / "ceiling_memory.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_s = _rw(fd, src, write=True)
        read_s = _rw(fd, dst, write=False)
    finally:
        os.close(fd)
        path.unlink()
    return _gib_s(sum(v.nbytes for v in src), write_s, read_s)


def copy_ceiling(nbytes: int = GiB, reps: int = 5, barrier: Callable[[], None] = _alone) -> dict:
    """Pinned D2H and H2D, and pageable H2D (from memory nobody pinned, its pages present),
    bandwidth of one ``nbytes`` copy (median of ``reps``), GiB/s; ``barrier`` is passed before
    each copy."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    out = {}
    for name, dst, src in (("d2h_gib_s", host, dev), ("h2d_gib_s", dev, host),
                           ("h2d_pageable_gib_s", dev, pageable)):
        times = []
        for _ in range(reps + 1):  # the first copy warms up
            sync()
            barrier()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / GiB / median(times, skip=1)
    return out


def copies_together(per_rank: list[dict]) -> dict:
    """Every rank's :func:`copy_ceiling`, measured at once, as the job's: each rate the
    slowest rank's, and (``*_sum``) the sum of the ranks' rates."""
    out = {k: min(r[k] for r in per_rank) for k in per_rank[0]}
    return {**out, **{f"{k}_sum": sum(r[k] for r in per_rank) for k in out}, "ranks": per_rank}


def disk_together(per_rank: list[dict]) -> dict:
    """Every rank's :func:`disk_ceiling`, measured at once (each its own file), as the job's:
    the bytes of every rank over the slowest rank's seconds."""
    nbytes = sum(r["bytes"] for r in per_rank)
    return _gib_s(nbytes, max(r["write_s"] for r in per_rank),
                  max(r["read_s"] for r in per_rank), bytes=nbytes,
                  o_direct=all(r["o_direct"] for r in per_rank), evict=per_rank[0]["evict"],
                  ranks=per_rank)
