"""Probe: what making one memory-tier slot costs, by the kind of page behind it (issue 49).

A slot is host memory that a save snapshots into and that outlives the save: today a file on
/dev/shm (4 KiB tmpfs pages), populated, then pinned with ``cudaHostRegister``. This times
populating and pinning ``GiB`` of it, and counts the page faults, for each backing the host
allows: 4 KiB tmpfs pages, tmpfs with transparent huge pages (a tmpfs mounted ``huge=always``,
root), hugetlbfs pages (``memfd_create(MFD_HUGETLB)`` from pages reserved in
``vm.nr_hugepages``, root; the reservation is given back after), and anonymous memory with
``MADV_HUGEPAGE`` (no file: for comparison); for the tmpfs backings also with the pages made
by another process first (``fallocate``: the trainer only maps and pins them). Meanwhile the
main thread runs a training-like loop (a matmul and a synchronize) and the table gives the
seconds it lost (its iterations' time beyond the same loop alone) and its longest iteration.
Needs cuda-python, torch and a GPU.

    python benchmarks/probe_slot_pages.py [GiB]       # default 16
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
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
    path = Path(mnt or "/dev/shm") / f"probe_slot_{os.getpid()}"
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
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
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
    cases.append(("anonymous, 4 KiB", lambda: make_slot(nbytes, None)))
    cases.append(("anonymous, MADV_HUGEPAGE", lambda: make_slot(nbytes, None, True)))
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


if __name__ == "__main__":
    main()
