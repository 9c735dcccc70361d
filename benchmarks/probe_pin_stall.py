"""Probe: how long a training thread's CUDA calls stall while another thread pins host memory
(``cudaHostRegister``, whole or in chunks) or allocates a large GPU buffer through torch.

The main thread launches a small matmul and synchronizes in a loop and records its longest
iteration; a second thread does one of the operations. Prints the longest iteration for each.

    python benchmarks/probe_pin_stall.py [GiB]       # default 8
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time

import torch
from cuda.bindings import runtime as rt

from dcp_datastates._cuda import cuda_copy
from dcp_datastates._cuda.cuda_copy import CudaCopier

GiB = 1 << 30


def populated(nbytes: int) -> mmap.mmap:
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x8000)  # POPULATE
    return mem


def address(mem: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))


def longest_step(work, seconds: float = 0.0) -> tuple[float, float]:
    """(longest main-thread iteration, the work's own time) while ``work`` runs on a thread."""
    a = torch.randn(2048, 2048, device="cuda")
    (a @ a).sum().item()  # warm: the first matmul's set-up is not a stall
    done, took = threading.Event(), [0.0]

    def run() -> None:
        t = time.perf_counter()
        work()
        took[0] = time.perf_counter() - t
        done.set()

    thread = threading.Thread(target=run)
    worst, last = 0.0, time.perf_counter()
    thread.start()
    while not done.is_set() or seconds > 0:
        (a @ a).sum().item()
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        if done.is_set():
            seconds -= 0.05
            time.sleep(0.05)
            last = time.perf_counter()
    thread.join()
    return worst, took[0]


def d2h(copier: CudaCopier, addr: int, nbytes: int) -> float:
    """GiB/s of a D2H copy of ``nbytes`` less 2 MiB into ``addr`` + 1 MiB (across pieces),
    through the engine's copier (best of 3)."""
    n = nbytes - (2 << 20)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        copier.copy([(0, addr + (1 << 20), src.data_ptr(), n)], "d2h")
        best = max(best, n / GiB / (time.perf_counter() - t))
    return best


def main() -> None:
    nbytes = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    torch.cuda.init()
    assert cuda_copy.available()
    base, _ = longest_step(lambda: time.sleep(1.0))
    print(f"no work: longest step {base * 1e3:.1f} ms", flush=True)
    copier = CudaCopier()
    for how in ("one call", "CudaCopier.pin"):
        mem = populated(nbytes)
        addr = address(mem)

        def pin(addr: int = addr, how: str = how) -> None:
            if how == "one call":
                (err,) = rt.cudaHostRegister(addr, nbytes, rt.cudaHostRegisterPortable)
                assert err == rt.cudaError_t.cudaSuccess, err
            else:
                CudaCopier.pin(addr, nbytes)

        worst, took = longest_step(pin)
        print(f"{how}: pinned {nbytes / GiB:.0f} GiB in {took:.2f} s, longest step "
              f"{worst * 1e3:.1f} ms; {d2h(copier, addr, nbytes):.1f} GiB/s D2H into it",
              flush=True)
        if how == "one call":
            rt.cudaHostUnregister(addr)
        else:
            CudaCopier.unpin(addr, nbytes)
        mem.close()
    copier.close()
    bufs = []
    worst, took = longest_step(lambda: bufs.append(torch.empty(nbytes, dtype=torch.uint8,
                                                               device="cuda")))
    print(f"torch.empty {nbytes / GiB:.0f} GiB on the GPU: {took * 1e3:.1f} ms, longest step "
          f"{worst * 1e3:.1f} ms", flush=True)
    bufs.clear()
    worst, took = longest_step(lambda: populated(nbytes).close())
    print(f"mmap MAP_POPULATE {nbytes / GiB:.0f} GiB: {took:.2f} s, longest step "
          f"{worst * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
