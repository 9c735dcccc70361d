"""Hostile review of the GPU checksums (gpu_sums.py, 79cd91b..1b218f1): may a snapshot's
checksums be lost, or attached to bytes they were not made of?

CPU: the kernel's build and load bookkeeping (fakes for the architecture, the compiler and
the loading) and which tensors of a flush take the digests made on the GPU.
"""

from __future__ import annotations

import threading
import time

from conftest import MARKS

from dcp_datastates.gpu_sums import GpuSums

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
