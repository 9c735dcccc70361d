"""Probe: GPU->host copy speed into pinned memory of each backing, on an idle and a busy GPU.

Backings: anonymous memory (the engine's arenas) and ``/dev/shm`` file mappings (the memory
tier's slots), each with and without ``MADV_HUGEPAGE``; each pinned with ``cudaHostRegister``.
The copies run on a side stream with cuda-python, as the engine's do, in one request and in 64;
"busy" runs them while bf16 GEMMs keep the default stream full. Prints GiB/s measured with CUDA
events (the copy engine's time) and with the wall clock, plus the kernel's huge-page settings.

    python benchmarks/probe_pinned_d2h.py [GiB]       # default 4
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch
from cuda.bindings import runtime as rt

GiB = 1 << 30
MADV_HUGEPAGE = 14
THP = Path("/sys/kernel/mm/transparent_hugepage")

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def ok(result: tuple) -> object:
    """The value of a cuda-python call, raising on an error."""
    if result[0] != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(str(result))
    return result[1] if len(result) == 2 else None


def mapping(kind: str, nbytes: int) -> tuple[int, int]:
    """(address, fd or -1) of ``nbytes`` mapped as ``kind`` says, every page touched."""
    fd = -1
    if kind.startswith("anon"):
        addr = libc.mmap(None, nbytes, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    else:
        path = f"/dev/shm/probe_pinned_d2h_{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(path)
        os.posix_fallocate(fd, 0, nbytes)
        addr = libc.mmap(None, nbytes, 3, mmap.MAP_SHARED, fd, 0)
    if kind.endswith("huge"):
        libc.madvise(addr, nbytes, MADV_HUGEPAGE)
    ctypes.memset(addr, 0, nbytes)
    return addr, fd


def copy_speed(dst: int, src: int, nbytes: int, stream: object, requests: int) -> tuple:
    """GiB/s of one GPU->host copy of ``nbytes`` in ``requests`` pieces: (events, wall)."""
    step = nbytes // requests
    start, end = ok(rt.cudaEventCreate()), ok(rt.cudaEventCreate())
    t = time.perf_counter()
    ok(rt.cudaEventRecord(start, stream))
    for i in range(requests):
        ok(rt.cudaMemcpyAsync(dst + i * step, src + i * step, step,
                              rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream))
    ok(rt.cudaEventRecord(end, stream))
    ok(rt.cudaEventSynchronize(end))
    wall = time.perf_counter() - t
    ms = ok(rt.cudaEventElapsedTime(start, end))
    return nbytes / GiB / (ms / 1e3), nbytes / GiB / wall


def gemms(stop: threading.Event) -> None:
    """Keep the default stream busy until ``stop``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def _speeds(runs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{n}x {e:.1f} {w:.1f}" for n, (e, w) in zip((1, 64), runs, strict=True))


def main() -> None:
    nbytes = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 4 * GiB
    for name in ("enabled", "shmem_enabled"):
        path = THP / name
        print(f"{path}: {path.read_text().strip() if path.exists() else '-'}")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ok(rt.cudaSetDevice(0))
    stream = ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    for kind in ("anon", "anon_huge", "shm", "shm_huge"):
        addr, fd = mapping(kind, nbytes)
        t = time.perf_counter()
        ok(rt.cudaHostRegister(addr, nbytes, rt.cudaHostRegisterPortable))
        pin_s = time.perf_counter() - t
        idle = [copy_speed(addr, src.data_ptr(), nbytes, stream, n) for n in (1, 64)]
        stop = threading.Event()
        load = threading.Thread(target=gemms, args=(stop,))
        load.start()
        time.sleep(0.3)
        busy = [copy_speed(addr, src.data_ptr(), nbytes, stream, n) for n in (1, 64)]
        stop.set()
        load.join()
        print(f"{kind:10s} pin {pin_s / (nbytes / GiB):.2f} s/GiB; GiB/s (events, wall): "
              f"idle {_speeds(idle)}; busy {_speeds(busy)}", flush=True)
        ok(rt.cudaHostUnregister(addr))
        libc.munmap(addr, nbytes)
        if fd >= 0:
            os.close(fd)


if __name__ == "__main__":
    main()
