"""The GPU checksums (``_cuda/gpu_sums.py``): may a snapshot's
checksums be lost, or attached to bytes they were not made of?

CPU: the kernel's build and load bookkeeping (fakes for the architecture, the compiler and
the loading) and which tensors of a flush take the digests made on the GPU.
"""

from __future__ import annotations

import threading
import time

import torch
from helpers import MARKS

from dcp_datastates._cuda.gpu_sums import GpuSums
from dcp_datastates._jobs.flush import _made_on_gpu
from dcp_datastates._jobs.snapshot import Snapshot, offsets_of, place_sources
from dcp_datastates._memory.host_cache import nbytes_of

pytestmark = MARKS
TIMEOUT = 10


def _until(check, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_build_that_ends_while_ready_asks_still_gets_loaded() -> None:
    """The first ready() starts the build and looks again under the lock: a build over in
    between (a fast compiler, or the scheduler) must be loaded, not taken for one that
    failed (which would hash every later save on the CPU, and say nothing)."""
    for _ in range(20):
        assert _built_and_loaded() == [(0, b"cubin-sm_90")]


def _built_and_loaded() -> list[tuple[int, bytes]]:
    """What a fresh GpuSums with an instant compiler loads once ready(0) says True."""
    loaded: list[tuple[int, bytes]] = []
    sums = GpuSums(arch_of=lambda d: "sm_90", build=lambda arch: b"cubin-" + arch.encode(),
                   load=lambda d, cubin: loaded.append((d, cubin)) or "kernel")
    try:
        _until(lambda: sums.ready(0), "the kernel was built but never loaded")
    finally:
        sums.close()
    return loaded


def test_a_build_that_fails_is_told_once_and_never_loaded() -> None:
    """A compiler that raises: ready() stays False for every device, nothing is loaded."""
    built, loaded = threading.Event(), []

    def build(arch: str) -> bytes:
        built.set()
        raise RuntimeError("NVRTC: no")

    sums = GpuSums(arch_of=lambda d: "sm_90", build=build,
                   load=lambda d, cubin: loaded.append(d) or "kernel")
    try:
        assert not sums.ready(0)
        assert built.wait(TIMEOUT)
        sums.close()  # joins the builder
        assert not sums.ready(0) and not sums.ready(1)
    finally:
        sums.close()
    assert loaded == []


def test_one_build_per_architecture_one_load_per_device() -> None:
    """Two devices of one architecture: one compile, a load on each device."""
    builds, loaded, release = [], [], threading.Event()

    def build(arch: str) -> bytes:
        builds.append(arch)
        release.wait(TIMEOUT)
        return b"cubin"

    sums = GpuSums(arch_of=lambda d: "sm_90", build=build,
                   load=lambda d, cubin: loaded.append(d) or f"kernel{d}")
    try:
        assert not sums.ready(0) and not sums.ready(1)  # compiling
        release.set()
        _until(lambda: sums.ready(0) and sums.ready(1), "not loaded")
        assert sums.ready(0) and sums.ready(1)
    finally:
        sums.close()
    assert builds == ["sm_90"] and sorted(loaded) == [0, 1]


def test_a_flush_takes_gpu_digests_only_for_a_whole_copy_in_its_bytes_order() -> None:
    """snapshot.copies maps a staged copy's address to its source, snapshot.sums a GPU
    source to its digests: a tensor of the flush takes them only where it is that copy in
    full, in order (a plan's chunk at the copy's address, a transpose, a copy elsewhere or a
    source hashed on the CPU take the CPU's checksums)."""
    sources = [torch.zeros(64, 32), torch.zeros(16), torch.zeros(8, 8)]
    placements = place_sources(sources)
    offsets, total = offsets_of(placements, len(sources))
    base = torch.zeros(total, dtype=torch.uint8)
    staged = [base[o : o + nbytes_of(s)].view(s.dtype).view(s.shape)
              for o, s in zip(offsets, sources, strict=True)]
    snapshot = Snapshot(None, placements)
    snapshot.copies = {t.data_ptr(): k for k, t in enumerate(staged)}
    snapshot.sums = {0: [1, 2], 2: [3]}  # source 1 was a CPU source
    w, b, m = staged
    tensors = [w, w.view(torch.int32), w[:32], w.t(), b, m, m.clone(), w.reshape(-1)]
    assert _made_on_gpu(snapshot, tensors) == [[1, 2], [1, 2], None, None, None, [3], None,
                                               [1, 2]]
    assert _made_on_gpu(None, tensors) == [None] * len(tensors)
