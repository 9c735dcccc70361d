"""Probe: a memory tier behind a small pinned ring against today's pinned slots (issue 49).

A training-like loop (matmuls, one synchronize per step) runs ``--steps`` steps on one GPU
and saves a state of ``--gib`` GiB of GPU tensors every ``--every`` steps into /dev/shm, in one
of two designs, timed from the first step:

- ``slot`` (today's memory tier): a tmpfs file per kept step, mapped, populated (16 MiB pieces,
  4 threads) and pinned with ``cudaHostRegister`` by a thread of its own from step 0; a save
  copies the state into a free pinned slot on a side stream (the step after waits for the
  copies), and a save that finds no slot ready is skipped.
- ``ring``: nothing of the tier is ever mapped or pinned by the trainer. A save copies the state
  GPU to GPU (a buffer kept on the GPU, ``cudaMemcpyAsync`` on a side stream: the step after
  waits for that only), then a thread streams it through a 256 MiB pinned ring (two halves,
  one copied into while the other is written) into ``--files`` files per step with ``pwrite``,
  one writer thread per file (writes to one file take its inode's lock).

Prints each mode's mean and longest step against the loop with no save, the seconds until each
save is in the tier, and what the tier made and pinned. Needs cuda-python, torch and a GPU.

    python benchmarks/probe_ring_tier.py [--gib 8] [--steps 40] [--every 10] [--keep 2]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from cuda.bindings import runtime as rt

GiB = 1 << 30
PIECE = 16 << 20
RING = 256 << 20
MADV_POPULATE_WRITE = 23


def check(result: tuple, what: str) -> None:
    if result[0] != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what}: {rt.cudaGetErrorString(result[0])[1]}")


def make_state(gib: float) -> list[torch.Tensor]:
    n = max(1, int(gib * GiB) // (128 << 20))
    return [torch.randn(32 << 20, device="cuda") for _ in range(n)]  # 128 MiB each


class Slot:
    """A tmpfs file mapped shared, populated in pieces on 4 threads, then pinned."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, nbytes)
        self.mem = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda o: libc.madvise(self.addr + o, min(PIECE, nbytes - o),
                                                 MADV_POPULATE_WRITE), range(0, nbytes, PIECE)))
        check(rt.cudaHostRegister(self.addr, nbytes, rt.cudaHostRegisterPortable), "register")
        self.tensor = torch.frombuffer((ctypes.c_char * nbytes).from_address(self.addr),
                                       dtype=torch.uint8)

    def close(self) -> None:
        check(rt.cudaHostUnregister(self.addr), "unregister")
        del self.tensor
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class Tier:
    """One design's saves; ``save`` is called on the training thread between steps."""

    def __init__(self, design: str, state: list[torch.Tensor], root: Path, keep: int,
                 files: int) -> None:
        self.design, self.state, self.root, self.keep, self.files = design, state, root, keep, files
        self.nbytes = sum(t.numel() * t.element_size() for t in state)
        self.stream = torch.cuda.Stream()
        self.done: list[tuple[int, float]] = []  # (step, seconds until in the tier)
        self.skipped: list[int] = []
        self.made_s = 0.0
        self.pinned = 0
        self._io = ThreadPoolExecutor(1)
        self._writers = ThreadPoolExecutor(files)
        self._slots: list[Slot] = []
        self._free: list[Slot] = []
        self._lock = threading.Lock()
        self._steps: list[int] = []
        if design == "slot":
            self._maker = threading.Thread(target=self._make_slots)
            self._maker.start()
        else:
            start = time.perf_counter()
            self.ring = torch.empty(RING, dtype=torch.uint8, pin_memory=True)
            self.aside = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
            self.made_s, self.pinned = time.perf_counter() - start, RING

    def _make_slots(self) -> None:
        start = time.perf_counter()
        for k in range(self.keep + 2):
            slot = Slot(self.root / f"slot_{k}", self.nbytes)
            with self._lock:
                self._slots.append(slot)
                self._free.append(slot)
                self.pinned += self.nbytes
        self.made_s = time.perf_counter() - start

    def save(self, step: int) -> None:
        start = time.perf_counter()
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        if self.design == "slot":
            with self._lock:
                slot = self._free.pop(0) if self._free else None
            if slot is None:
                self.skipped.append(step)
                return
            with torch.cuda.stream(self.stream):
                self._copy_into(slot.tensor)
        else:
            with torch.cuda.stream(self.stream):
                self._copy_into(self.aside)
        done = torch.cuda.Event()
        done.record(self.stream)
        main.wait_event(done)  # the next step's work (the optimizer's) runs after the copies
        self._io.submit(self._finish, step, start, done, slot if self.design == "slot" else None)

    def _copy_into(self, out: torch.Tensor) -> None:
        offset = 0
        for t in self.state:
            n = t.numel() * t.element_size()
            out[offset:offset + n].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
            offset += n

    def _finish(self, step: int, start: float, done: torch.cuda.Event, slot: Slot | None
                ) -> None:
        done.synchronize()
        if slot is None:
            self._stream_out(step)
        self.done.append((step, time.perf_counter() - start))
        with self._lock:
            self._steps.append(step)
            if slot is not None:
                self._free.append(slot)  # kept as a step in the real tier; reused here

    def _stream_out(self, step: int) -> None:
        """The aside copy through the ring's two halves into ``files`` files of the step:
        each half is cut in ``files`` stripes, one per file, written at once."""
        directory = self.root / f"step_{step}"
        directory.mkdir()
        fds = [os.open(directory / f"part_{k}", os.O_WRONLY | os.O_CREAT, 0o600)
               for k in range(self.files)]
        half = RING // 2
        stripe = half // self.files
        base = self.ring.data_ptr()
        views = [memoryview((ctypes.c_char * half).from_address(base + h * half)).cast("B")
                 for h in range(2)]
        pending: list[list[Future]] = [[], []]
        try:
            for c, offset in enumerate(range(0, self.nbytes, half)):
                h, n = c % 2, min(half, self.nbytes - offset)
                for job in pending[h]:
                    job.result()
                with torch.cuda.stream(self.stream):
                    self.ring[h * half:h * half + n].copy_(self.aside[offset:offset + n],
                                                           non_blocking=True)
                self.stream.synchronize()
                pending[h] = [self._writers.submit(os.pwrite, fds[k],
                                                   views[h][k * stripe:min(n, (k + 1) * stripe)],
                                                   c * stripe)
                              for k in range(self.files) if k * stripe < n]
            for jobs in pending:
                for job in jobs:
                    job.result()
        finally:
            for fd in fds:
                os.close(fd)
        old = sorted(int(p.name[5:]) for p in self.root.glob("step_*"))[:-self.keep]
        for s in old:
            shutil.rmtree(self.root / f"step_{s}")

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        if self.design == "slot":
            self._maker.join()
            for slot in self._slots:
                slot.close()


def run(design: str | None, state: list[torch.Tensor], args: argparse.Namespace,
        root: Path) -> tuple[list[float], Tier | None]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm
        (a @ a).sum().item()
    root.mkdir(parents=True, exist_ok=True)
    tier = Tier(design, state, root, args.keep, args.files) if design else None
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        for _ in range(args.matmuls):
            a = (a @ a) / 8192.0
        torch.cuda.synchronize()
        if tier is not None and step % args.every == args.every // 2:
            tier.save(step)
        times.append(time.perf_counter() - start)
    if tier is not None:
        tier.close()
    shutil.rmtree(root, ignore_errors=True)
    return times, tier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--matmuls", type=int, default=100, help="per step (about 150 ms on an H200)")
    ap.add_argument("--root", default="/dev/shm/probe_ring_tier")
    args = ap.parse_args()
    check(rt.cudaFree(0), "cudaFree")
    state = make_state(args.gib)
    gib = sum(t.numel() * t.element_size() for t in state) / GiB
    base, _ = run(None, state, args, Path(args.root))
    median = statistics.median(base)
    print(f"state {gib:.2f} GiB on the GPU; {args.steps} steps, a save every {args.every}; "
          f"no save: mean step {statistics.mean(base) * 1e3:.1f} ms, median {median * 1e3:.1f}")
    print("| design | mean step vs none | longest step / median | saves in the tier "
          "(s until there) | skipped | tier made in s | pinned by the tier |")
    print("|---|--:|--:|---|---|--:|--:|")
    for design in ("slot", "ring"):
        times, tier = run(design, state, args, Path(args.root))
        assert tier is not None
        took = ", ".join(f"{s}: {t:.2f}" for s, t in tier.done)
        print(f"| {design} | {statistics.mean(times) / statistics.mean(base) - 1:+.1%} | "
              f"{max(times) / median:.2f}x | {took} | {tier.skipped} | {tier.made_s:.2f} | "
              f"{tier.pinned / GiB:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
