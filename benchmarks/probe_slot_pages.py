"""Probe: what making one memory-tier slot costs, by the kind of page behind it (issue 49).

A slot is host memory that a save snapshots into and that outlives the save: today a file on
/dev/shm (4 KiB tmpfs pages), populated, then pinned with ``cudaHostRegister``. This times
populating and pinning ``GiB`` of it, and counts the page faults, for each backing the host
allows: 4 KiB tmpfs pages, tmpfs with transparent huge pages (a tmpfs mounted ``huge=always``,
root), hugetlbfs pages (``memfd_create(MFD_HUGETLB)`` from pages reserved in
``vm.nr_hugepages``, root; the reservation is given back after), and anonymous memory with
``MADV_HUGEPAGE`` (no file: for comparison); for the tmpfs backings also with the pages made
by another process first (``fallocate``: the trainer only maps and pins them). Two more rows
time the slot as a file the trainer never maps nor pins: written with ``pwrite`` from a small
pinned ring (the engine's cache, made once; a fixed pinned staging ring in front of unpinned
memory), first into new tmpfs pages, then over the same file's pages again (a slot reused);
and one pins a mapped slot in 1 GiB pieces rather than at once. Meanwhile the
main thread runs a training-like loop (a matmul and a synchronize) and the table gives the
seconds it lost (its iterations' time beyond the same loop alone) and its longest iteration.
Needs cuda-python, torch and a GPU.

    python benchmarks/probe_slot_pages.py [GiB] [--ring]   # default 16; --ring: those rows only
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from cuda.bindings import runtime as rt

GiB = 1 << 30
HUGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; not in every mmap
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def check(result: tuple, what: str) -> None:
    if result[0] != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what}: {rt.cudaGetErrorString(result[0])[1]}")


def faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


@contextmanager
def tmpfs_file(nbytes: int, options: str | None, made: bool = False) -> Iterator[int]:
    """A file of ``nbytes`` on /dev/shm, or on a tmpfs mounted with ``options``; ``made``:
    its pages allocated by another process first (``fallocate``)."""
    mnt = None
    if options is not None:
        mnt = tempfile.mkdtemp(prefix="probe_slot_")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", mnt], check=True)
    path = Path(mnt or "/dev/shm") / f"probe_slot_{os.getpid()}_{os.urandom(4).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if made:
            subprocess.run(["fallocate", "-l", str(nbytes), str(path)], check=True)
        yield fd
    finally:
        os.close(fd)
        path.unlink()
        if mnt is not None:
            subprocess.run(["umount", mnt], check=False)
            os.rmdir(mnt)


@contextmanager
def hugetlb_file(nbytes: int) -> Iterator[int]:
    """A memfd of ``nbytes`` in 2 MiB hugetlbfs pages reserved for it (given back after)."""
    before = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(before + nbytes // HUGE))
    try:
        fd = os.memfd_create("probe_slot", os.MFD_HUGETLB)
        try:
            os.ftruncate(fd, nbytes)
            yield fd
        finally:
            os.close(fd)
    finally:
        NR_HUGEPAGES.write_text(str(before))


def make_slot(nbytes: int, fd: int | None, huge_anon: bool = False) -> dict[str, float]:
    """Populate and pin ``nbytes`` of ``fd`` (None: anonymous memory); seconds and faults."""
    start, f0 = time.perf_counter(), faults()
    if fd is None:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_anon:
            mem.madvise(mmap.MADV_HUGEPAGE)
        mem.madvise(MADV_POPULATE_WRITE)
    else:
        mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    populated, f1 = time.perf_counter(), faults()
    view = ctypes.c_char.from_buffer(mem)
    addr = ctypes.addressof(view)
    check(rt.cudaHostRegister(addr, nbytes, rt.cudaHostRegisterPortable), "cudaHostRegister")
    pinned = time.perf_counter()
    check(rt.cudaHostUnregister(addr), "cudaHostUnregister")
    unpinned = time.perf_counter()
    del view  # the mapping closes only once nothing points into it
    mem.close()
    return {"populate_s": populated - start, "pin_s": pinned - populated,
            "unpin_s": unpinned - pinned, "faults": f1 - f0}


def pin_in_pieces(nbytes: int, fd: int, piece: int = GiB) -> dict[str, float]:
    """Populate ``nbytes`` of ``fd`` (mapped shared), then pin it ``piece`` bytes at a time."""
    start, f0 = time.perf_counter(), faults()
    mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    populated, f1 = time.perf_counter(), faults()
    view = ctypes.c_char.from_buffer(mem)
    addr = ctypes.addressof(view)
    pieces = range(0, nbytes, piece)
    for offset in pieces:
        check(rt.cudaHostRegister(addr + offset, min(piece, nbytes - offset),
                                  rt.cudaHostRegisterPortable), "cudaHostRegister")
    pinned = time.perf_counter()
    for offset in pieces:
        check(rt.cudaHostUnregister(addr + offset), "cudaHostUnregister")
    unpinned = time.perf_counter()
    del view
    mem.close()
    return {"populate_s": populated - start, "pin_s": pinned - populated,
            "unpin_s": unpinned - pinned, "faults": f1 - f0}


def write_from_ring(nbytes: int, fd: int, ring: torch.Tensor, threads: int = 4,
                    read: bool = False) -> dict[str, float]:
    """Write ``nbytes`` into ``fd`` with ``pwrite`` from the pinned ``ring`` (``threads`` at a
    time, a ring's piece each), never mapping the file; ``read``: ``preadv`` them into the
    ring instead (a restore from the memory tier)."""
    piece = ring.numel() // threads
    base = ring.data_ptr()
    views = [memoryview((ctypes.c_char * piece).from_address(base + k * piece)).cast("B")
             for k in range(threads)]

    def one(k: int) -> None:
        for offset in range(k * piece, nbytes, threads * piece):
            size = min(piece, nbytes - offset)
            done = (os.preadv(fd, [views[k][:size]], offset) if read
                    else os.pwrite(fd, views[k][:size], offset))
            if done != size:
                raise OSError(f"short {'read' if read else 'write'} at {offset}")

    start, f0 = time.perf_counter(), faults()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    return {"populate_s": time.perf_counter() - start, "pin_s": 0.0, "unpin_s": 0.0,
            "faults": faults() - f0}


def steps_while(work: Callable[[], dict[str, float]] | None, seconds: float = 2.0
                ) -> tuple[list[float], dict[str, float]]:
    """The main thread's iterations (a matmul, a synchronize) while ``work`` runs on a thread
    (None: for ``seconds``), and what ``work`` returned."""
    a = torch.randn(4096, 4096, device="cuda")
    out: dict[str, float] = {}
    thread = None
    if work is not None:
        thread = threading.Thread(target=lambda: out.update(work()))
        thread.start()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (thread.is_alive() if thread is not None else time.perf_counter() < end):
        start = time.perf_counter()
        (a @ a).sum()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if thread is not None:
        thread.join()
    return times, out


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--ring"]
    gib = float(args[0]) if args else 16.0
    nbytes = int(gib * GiB) // HUGE * HUGE
    check(rt.cudaSetDevice(0), "cudaSetDevice")
    check(rt.cudaFree(0), "cudaFree")  # the context, before anything is timed
    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    print(f"{gib:g} GiB; THP anon: "
          f"{Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}; "
          f"THP shmem: {shmem.read_text().strip() if shmem.exists() else 'n/a'}")
    steps_while(None, 1.0)  # warm
    alone, _ = steps_while(None)
    base = sorted(alone)[len(alone) // 2]
    print(f"training-like step alone: median {base * 1e3:.2f} ms, longest "
          f"{max(alone) * 1e3:.2f} ms")
    cases: list[tuple[str, Callable[[], dict[str, float]]]] = []

    def on_file(opener: Callable[[], AbstractContextManager[int]]
                ) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            with opener() as fd:
                return make_slot(nbytes, fd)
        return run

    huge = f"size={nbytes + HUGE},huge=always"
    cases.append(("tmpfs /dev/shm, 4 KiB", on_file(lambda: tmpfs_file(nbytes, None))))
    cases.append(("tmpfs /dev/shm, 4 KiB, made by another process",
                  on_file(lambda: tmpfs_file(nbytes, None, made=True))))
    cases.append(("tmpfs huge=always", on_file(lambda: tmpfs_file(nbytes, huge))))
    cases.append(("tmpfs huge=always, made by another process",
                  on_file(lambda: tmpfs_file(nbytes, huge, made=True))))
    cases.append(("hugetlbfs 2 MiB (memfd)", on_file(lambda: hugetlb_file(nbytes))))
    ring = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)  # made once, off the clock

    def written(threads: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            with tmpfs_file(nbytes, None) as fd:
                return write_from_ring(nbytes, fd, ring, threads)
        return run

    def in_pieces() -> dict[str, float]:
        with tmpfs_file(nbytes, None) as fd:
            return pin_in_pieces(nbytes, fd)
    cases.append(("tmpfs /dev/shm, 4 KiB, pinned in 1 GiB pieces", in_pieces))
    for threads in (4, 8, 16):
        cases.append((f"tmpfs /dev/shm, 4 KiB, pwrite from a 256 MiB pinned ring, new pages, "
                      f"{threads} threads", written(threads)))
    reused = contextlib.ExitStack()  # a slot written once already, off the clock
    fd = reused.enter_context(tmpfs_file(nbytes, None))
    write_from_ring(nbytes, fd, ring)
    def split(threads: int) -> dict[str, float]:
        """Each thread writes a file of its own (writes to one file take its inode's lock)."""
        with contextlib.ExitStack() as files:
            fds = [files.enter_context(tmpfs_file(nbytes // threads, None))
                   for _ in range(threads)]
            part = ring.numel() // threads
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: write_from_ring(nbytes // threads, fds[k],
                                                        ring[k * part:(k + 1) * part], 1),
                              range(threads)))
            return {"populate_s": time.perf_counter() - start, "pin_s": 0.0, "unpin_s": 0.0,
                    "faults": 0}
    for threads in (8, 16):
        cases.append((f"tmpfs /dev/shm, 4 KiB, pwrite from the ring into {threads} files, new "
                      f"pages, {threads} threads", functools.partial(split, threads)))
    for threads in (4, 8, 16):
        cases.append((f"tmpfs /dev/shm, 4 KiB, pwrite from the ring over the file's pages, "
                      f"{threads} threads", functools.partial(write_from_ring, nbytes, fd, ring,
                                                              threads)))
    cases.append(("tmpfs /dev/shm, 4 KiB, preadv into the ring (a restore), 8 threads",
                  functools.partial(write_from_ring, nbytes, fd, ring, 8, read=True)))
    cases.append(("anonymous, 4 KiB", lambda: make_slot(nbytes, None)))
    cases.append(("anonymous, MADV_HUGEPAGE", lambda: make_slot(nbytes, None, True)))
    if "--ring" in sys.argv:
        cases = [c for c in cases if "ring" in c[0]]
    print("| backing | populate s | GiB/s | pin s | unpin s | page faults "
          "| training s lost | longest step ms |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, run in cases:
        try:
            times, r = steps_while(run)
            if not r:
                raise RuntimeError("the slot was not made (its thread failed)")
        except Exception as exc:  # noqa: BLE001 - a backing this host does not allow
            print(f"| {name} | not allowed here: {exc} |||||||")
            continue
        lost = sum(times) - len(times) * base
        print(f"| {name} | {r['populate_s']:.2f} | {gib / r['populate_s']:.1f} | "
              f"{r['pin_s']:.2f} | {r['unpin_s']:.2f} | {r['faults']:.0f} | "
              f"{lost:.2f} | {max(times) * 1e3:.1f} |", flush=True)
    reused.close()


if __name__ == "__main__":
    main()
