"""Checksums taken as a snapshot's copies land (``jobs/sums.py``): the file's checksums are its
bytes', they are started while staging (not by the flush), and a save that fails waits for
them before its lease goes back."""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, Tiers, assert_state_equal, load_into, rand_tensor
from fakes import FaultyBackend
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine
from dcp_datastates.checksums import BLOCK_BYTES, block_checksums
from dcp_datastates.io import ThreadPoolBackend
from dcp_datastates.jobs.sums import Sums
from dcp_datastates.metadata_file import read_metadata
from dcp_datastates.snapshot import copy_into, layout

pytestmark = MARKS
TIMEOUT = 60
#: Threads a snapshot is copied on (the staging thread; the arena thread for one that waited
#: aside): checksum tasks started there were started as the copies landed.
STAGING = ("dcp_datastates-stage", "dcp_datastates-arena")


class CountingEngine(Engine):
    """An engine recording, for every task of its checksum threads, the thread that started
    it; each task first sleeps ``delay_s`` (a slow hash)."""

    def __init__(self, delay_s: float = 0.0, **kw: object) -> None:
        super().__init__(**kw)
        self.delay_s = delay_s
        self.tasks: list[tuple[str, Future]] = []
        self._tasks_lock = threading.Lock()

    def compute(self, fn, *args):
        def run():
            time.sleep(self.delay_s)
            return fn(*args)

        task = super().compute(run)
        with self._tasks_lock:
            self.tasks.append((threading.current_thread().name, task))
        return task

    def started_by(self, staging: bool) -> int:
        with self._tasks_lock:
            return sum(name.startswith(STAGING) == staging for name, _ in self.tasks)


@pytest.fixture
def counting():
    made: list[CountingEngine] = []

    def make(**kw: object) -> CountingEngine:
        made.append(CountingEngine(**kw))
        return made[-1]

    yield make
    for e in made:
        assert e.live_leases() == 0, "a save kept host cache memory after it ended"
        e.close()


def tensors_state(seed: int) -> dict:
    """Tensors only, none empty (no bytes items, and nothing that lands empty: the flush has
    nothing of its own to hash)."""
    return {"w": rand_tensor((300, 257), torch.float32, seed),
            "b": rand_tensor((1000,), torch.bfloat16, seed + 1),
            "big": rand_tensor((BLOCK_BYTES + 12345,), torch.uint8, seed + 2),
            "step": torch.tensor(seed, dtype=torch.int64)}


def assert_file_checksums(directory: Path) -> int:
    """Every item's checksums in ``.metadata`` are those of its bytes in the data file; the
    number of items."""
    items = read_metadata(directory).storage_data
    for index, loc in items.items():
        data = torch.from_file(str(directory / loc.file), size=loc.offset + loc.length,
                               dtype=torch.uint8)[loc.offset:].contiguous()
        assert loc.block == BLOCK_BYTES
        assert list(loc.checksums) == block_checksums(data.data_ptr(), loc.length), index.fqn
    return len(items)


def test_sums_are_each_keyed_items_block_checksums(counting) -> None:
    engine = counting()
    data = rand_tensor((3 * BLOCK_BYTES + 5,), torch.uint8, 1)
    addr = data.data_ptr()
    sums = Sums(engine)
    sums.start(["a", "b"], [(addr, 2 * BLOCK_BYTES + 1), (addr + 7, 0)])
    sums.start([9], [(addr + 11, BLOCK_BYTES + 3)])
    assert sums.started("a") and sums.started(9) and not sums.started("c")
    assert sums.of("c") is None
    assert sums.of("a") == block_checksums(addr, 2 * BLOCK_BYTES + 1)
    assert sums.of("b") == block_checksums(addr + 7, 0)
    assert sums.of(9) == block_checksums(addr + 11, BLOCK_BYTES + 3)
    sums.wait()


def test_copy_into_reports_the_sources_copied_into_the_lease(counting) -> None:
    engine = counting(host_cache_size="8MiB")
    sources = [rand_tensor((100,), torch.float32, 1), torch.empty(0),
               rand_tensor((3, 5), torch.int16, 2), rand_tensor((100_000,), torch.uint8, 3)]
    offsets, _ = layout(sources)  # the largest first, at 0
    lease = engine.reserve(offsets[0])  # the small ones do not fit: pageable memory
    landed: list[int] = []
    try:
        staged, overflow, _ = copy_into(lease, sources, offsets, None, None,
                                        landed=landed.extend)
        assert landed == [3] and overflow == 400 + 30
        for src, dst in zip(sources, staged, strict=True):
            assert torch.equal(src, dst)
    finally:
        lease.release()


def test_a_memory_tier_commit_takes_the_snapshots_checksums(tiers: Tiers, counting) -> None:
    engine = counting(io_backend="threads")
    state = {**tensors_state(3), "empty": torch.empty(0, 3), "extra": {"lr": 0.5, "tag": "x"}}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        for step in (1, 2):  # the first into a slot being made, the second into a ready one
            manager.save(step, state).committed.result(timeout=TIMEOUT)
            assert assert_file_checksums(tiers.memory / f"step_{step}") == 7
        assert engine.started_by(staging=True) > 0
        assert_state_equal(load_into(state, tiers.memory / "step_2"), state)


def test_an_async_save_of_tensors_hashes_nothing_in_its_flush(tmp_path: Path, counting) -> None:
    engine = counting(host_cache_size="64MiB")
    writer = DataStatesWriter(engine=engine)
    state = tensors_state(5)
    for k in range(2):  # the first aside (the cache is being made), the second straight in
        dcp.async_save(state, checkpoint_id=tmp_path / f"c{k}", storage_writer=writer,
                       no_dist=True).upload_completion.result(timeout=TIMEOUT)
        assert assert_file_checksums(tmp_path / f"c{k}") == len(state)
        assert_state_equal(load_into(state, tmp_path / f"c{k}"), state)
    assert engine.started_by(staging=True) > 0
    assert engine.started_by(staging=False) == 0, "the flush hashed the snapshot again"
    writer.close()


def test_a_plain_save_hashes_in_its_flush(tmp_path: Path, counting) -> None:
    engine = counting(host_cache_size="64MiB")
    writer = DataStatesWriter(engine=engine)
    state = tensors_state(6)
    dcp.save(state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    assert assert_file_checksums(tmp_path) == len(state)
    assert engine.started_by(staging=True) == 0 and engine.started_by(staging=False) > 0
    writer.close()


def test_a_failed_save_waits_for_its_checksums_before_its_lease_goes(tmp_path: Path,
                                                                     counting) -> None:
    backend = FaultyBackend(ThreadPoolBackend(), fail_write_after=0, errno_=errno.EIO)
    engine = counting(delay_s=0.2, host_cache_size="64MiB", io_backend=backend)
    writer = DataStatesWriter(engine=engine)
    state = tensors_state(7)
    for k in range(2):
        response = dcp.async_save(state, checkpoint_id=tmp_path / f"c{k}",
                                  storage_writer=writer, no_dist=True)
        with pytest.raises(CheckpointException, match="injected"):
            response.upload_completion.result(timeout=TIMEOUT)
        assert engine.live_leases() == 0
        assert all(task.done() for _, task in engine.tasks), "a checksum reads a freed lease"
    assert engine.started_by(staging=True) > 0
    writer.close()
    backend.close()
