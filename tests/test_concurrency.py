"""Saves faster than the disk, one checkpoint per step, loads during saves, bounded memory."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, assert_state_equal, clone_state, load_into, rand_tensor

from dcp_datastates.io import get_backend

MiB = 1 << 20
TIMEOUT = 60

pytestmark = MARKS


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every data write of the threads backend takes 5 ms more: saves outrun the disk."""
    backend = get_backend("threads")
    real = backend.write

    def write(fd, path, reqs):
        time.sleep(0.005)
        return real(fd, path, reqs)

    monkeypatch.setattr(backend, "write", write)


def _base() -> dict:
    return {
        "big": rand_tensor((MiB,), torch.uint8, seed=1),
        "w": rand_tensor((128, 257), torch.float32, seed=2),
        "b": rand_tensor((300,), torch.bfloat16, seed=3),
        "step": 0,
    }


def _advance(state: dict, step: int) -> None:
    """One training step, in place: the state at step k is a function of k alone."""
    state["big"].add_(1)
    state["w"].mul_(-1).add_(0.5)
    state["b"].add_(1)
    state["step"] = step


def _state_at(base: dict, step: int) -> dict:
    state = clone_state(base)
    for k in range(1, step + 1):
        _advance(state, k)
    return state


class _PoolWatch:
    """Samples the writer's pools from a thread; records the largest use seen."""

    def __init__(self, writer) -> None:
        self.cache = writer.engine.cache
        self.max_snap = self.max_bounce = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_snap = max(self.max_snap, self.cache.snapshots.used)
            self.max_bounce = max(self.max_bounce, self.cache.bounce.used)
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.max_snap <= self.cache.snapshots.capacity, self.max_snap
        assert self.max_bounce <= self.cache.bounce.capacity, self.max_bounce


def _record_stats(writer, monkeypatch: pytest.MonkeyPatch) -> list:
    """The SaveStats of every snapshot the writer takes, in order."""
    stager = writer.engine.stager
    real = stager.stage
    seen: list = []

    def stage(state_dict, stats):
        seen.append(stats)
        return real(state_dict, stats)

    monkeypatch.setattr(stager, "stage", stage)
    return seen


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_back_to_back_async_saves_outrun_the_disk(
    tmp_path: Path, make_writer, slow_disk: None
) -> None:
    writer = make_writer(host_cache_size="8MiB")
    base = _base()
    state = clone_state(base)
    responses = []
    for step in range(8):
        responses.append(dcp.async_save(state, checkpoint_id=tmp_path / f"c{step}",
                                        storage_writer=writer, no_dist=True))
        responses[-1].staging_completion.result(timeout=TIMEOUT)
        _advance(state, step + 1)
    for r in responses:
        r.upload_completion.result(timeout=TIMEOUT)
    for step in range(8):
        expected = _state_at(base, step)
        assert_state_equal(load_into(expected, tmp_path / f"c{step}"), expected)


@pytest.mark.parametrize("in_flight", ["one", "many"])
def test_checkpoint_every_step_with_a_small_cache(
    tmp_path: Path, make_writer, slow_disk: None, monkeypatch: pytest.MonkeyPatch, in_flight: str
) -> None:
    cache = 4 * MiB
    steps = 50
    writer = make_writer(host_cache_size=cache)
    writer.wait_ready()
    stats = _record_stats(writer, monkeypatch)
    base = _base()
    state = clone_state(base)
    # Warm up (threads, allocator arenas, the cache's pages), then measure.
    dcp.async_save(state, checkpoint_id=tmp_path / "warm", storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=TIMEOUT)
    rss0 = _rss()
    watch = _PoolWatch(writer)
    pending = []
    peak = rss0
    try:
        for step in range(steps):
            r = dcp.async_save(state, checkpoint_id=tmp_path / f"c{step}",
                               storage_writer=writer, no_dist=True)
            r.staging_completion.result(timeout=TIMEOUT)
            _advance(state, step + 1)
            if in_flight == "one":
                r.upload_completion.result(timeout=TIMEOUT)
            else:
                pending.append(r)
            peak = max(peak, _rss())
        for r in pending:
            r.upload_completion.result(timeout=TIMEOUT)
    finally:
        watch.stop()
    peak = max(peak, _rss())
    assert peak - rss0 < cache + 64 * MiB, f"RSS grew by {(peak - rss0) / MiB:.1f} MiB"
    assert len(stats) == steps + 1
    assert [s.overflow_bytes for s in stats] == [0] * (steps + 1)
    assert all(s.staged_bytes > MiB for s in stats)
    assert writer.engine.cache.snapshots.used == 0 and writer.engine.cache.bounce.used == 0
    expected = clone_state(base)
    for step in range(steps):
        assert_state_equal(load_into(expected, tmp_path / f"c{step}"), expected, f"step {step}")
        _advance(expected, step + 1)


def test_load_checkpoint_k_while_saving_k_plus_1(
    tmp_path: Path, make_writer, slow_disk: None
) -> None:
    writer = make_writer(host_cache_size="4MiB")
    base = _base()
    state = clone_state(base)
    dcp.async_save(state, checkpoint_id=tmp_path / "c0", storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=TIMEOUT)
    expected = clone_state(base)
    overlapped = 0
    for step in range(1, 8):
        _advance(state, step)
        r = dcp.async_save(state, checkpoint_id=tmp_path / f"c{step}", storage_writer=writer,
                           no_dist=True)
        loaded = load_into(expected, tmp_path / f"c{step - 1}")  # while step's save flushes
        overlapped += not r.upload_completion.done()
        assert_state_equal(loaded, expected, f"step {step - 1}")
        r.upload_completion.result(timeout=TIMEOUT)
        _advance(expected, step)
    assert overlapped, "no load overlapped a save: the test did not test anything"
    assert_state_equal(load_into(expected, tmp_path / "c7"), expected)
