"""A snapshot's checksums, started by its save job the moment its copies are done: equal to the
flush's own, waited for before its lease goes (success, failure, a discarded snapshot), and
unused where DCP's plan is not the snapshot's copies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, Tiers, assert_state_equal, clone_state, load_into, rand_tensor
from fakes import FaultyBackend
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointManager, DataStatesReader, DataStatesWriter, Engine, cli
from dcp_datastates.checksums import BLOCK_BYTES
from dcp_datastates.io import make_backend

MiB = 1 << 20
TIMEOUT = 60

pytestmark = MARKS


class HashEngine(Engine):
    """An engine that records each checksum task: whether a save job started it from its
    snapshot (on the engine's own threads) or the flush did, the bytes it hashed, and the
    host cache leases live when it ended. With ``gated=True``, the snapshot's tasks wait for
    ``gate`` before they hash (they are fewer than the checksum threads: the flush's run)."""

    def __init__(self, gated: bool = False, **kw: object) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.tasks: list[tuple[bool, int, int]] = []  # (from the snapshot, bytes, live leases)
        self._record = threading.Lock()

    def compute(self, fn: Callable, *args: object) -> Future:
        if fn.__name__ != "_sum_pieces":  # a bytes item's serialization
            return super().compute(fn, *args)
        early = threading.current_thread().name.startswith("dcp_datastates-")
        nbytes = sum(n for _, _, n in args[0])

        def run() -> object:
            if early:
                self.gate.wait()
            try:
                return fn(*args)
            finally:
                with self._record:
                    self.tasks.append((early, nbytes, self.live_leases()))
        return super().compute(run)

    def hashed(self, early: bool) -> int:
        """Bytes hashed by the snapshot's tasks (``early``) or the flush's."""
        with self._record:
            return sum(n for e, n, _ in self.tasks if e == early)


@pytest.fixture
def hash_engine() -> Iterator[Callable[..., HashEngine]]:
    made: list[HashEngine] = []

    def make(**kw: object) -> HashEngine:
        kw = {"host_cache_size": "96MiB", "io_backend": "threads", "io_workers": 2, **kw}
        made.append(HashEngine(**kw))
        return made[-1]

    yield make
    for engine in made:
        engine.gate.set()
        assert engine.live_leases() == 0, "a save kept host cache memory after it ended"
        engine.close()


def _state(seed: int) -> dict:
    base = rand_tensor((64, 33), torch.float32, seed=seed)
    return {
        "big": rand_tensor((2 * BLOCK_BYTES + 4001,), torch.uint8, seed=seed + 1),
        "w": rand_tensor((128, 130), torch.bfloat16, seed=seed + 2),
        "base": base,
        "view": base.t()[1:30:2],
        "empty": torch.empty(0, 5),
        "nested": {"bias": rand_tensor((33,), torch.float16, seed=seed + 3), "step": seed},
    }


def _tensor_bytes(state: dict) -> int:
    flat = [state["big"], state["w"], state["base"], state["view"], state["nested"]["bias"]]
    return sum(t.numel() * t.element_size() for t in flat)


def _checksums(path: Path) -> dict[str, tuple[int, ...]]:
    metadata = DataStatesReader(path).read_metadata()
    return {index.fqn: loc.checksums for index, loc in metadata.storage_data.items()}


def _verified(path: Path, expected: dict) -> None:
    assert cli.main(["verify", "-q", str(path)]) == 0
    assert_state_equal(load_into(expected, path), expected)


def test_snapshot_checksums_equal_the_flushs_and_the_flush_hashes_only_the_rest(
        tmp_path: Path, hash_engine) -> None:
    engine = hash_engine()
    state = _state(1)
    expected = clone_state(state)
    for k in range(2):  # the first snapshot waits aside while the cache is made; then in it
        response = dcp.async_save(state, checkpoint_id=tmp_path / f"a{k}", no_dist=True,
                                  storage_writer=DataStatesWriter(engine=engine))
        response.upload_completion.result(timeout=TIMEOUT)
        assert engine.hashed(early=True) == _tensor_bytes(state)
        assert engine.hashed(early=False) < MiB, "the flush hashed the snapshot's tensors again"
        _verified(tmp_path / f"a{k}", expected)
        engine.tasks.clear()
    dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True,
             storage_writer=DataStatesWriter(engine=engine))
    assert engine.hashed(early=True) == 0
    assert engine.hashed(early=False) >= _tensor_bytes(state)
    plain = _checksums(tmp_path / "plain")
    assert len(plain["big"]) == 3
    assert _checksums(tmp_path / "a0") == _checksums(tmp_path / "a1") == plain


def test_a_plan_that_is_not_the_snapshots_copies_is_hashed_by_the_flush(
        tmp_path: Path, hash_engine) -> None:
    engine = hash_engine()
    writer = DataStatesWriter(engine=engine)
    staged = writer.stage(_state(2)).result(timeout=TIMEOUT)
    changed = {**staged, "w": staged["w"].clone().add_(1), "extra": torch.arange(7)}
    expected = clone_state(changed)
    dcp.save(changed, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    assert engine.hashed(early=True) == _tensor_bytes(staged)
    assert engine.hashed(early=False) >= _tensor_bytes(changed)
    _verified(tmp_path, expected)


def test_a_discarded_snapshot_gives_its_lease_back_only_after_its_checksums(
        hash_engine) -> None:
    engine = hash_engine(gated=True, io_workers=8)
    writer = DataStatesWriter(engine=engine)
    writer.stage(_state(3)).result(timeout=TIMEOUT)
    closing = threading.Thread(target=writer.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive() and engine.live_leases() == 1, "the lease went under the hashes"
    engine.gate.set()
    closing.join(TIMEOUT)
    assert engine.live_leases() == 0
    assert engine.tasks and all(live >= 1 for _, _, live in engine.tasks)


def test_a_failed_flush_gives_the_lease_back_only_after_the_snapshots_checksums(
        tmp_path: Path, hash_engine) -> None:
    backend = FaultyBackend(make_backend("threads")[0], fail_write_after=0)
    engine = hash_engine(gated=True, io_backend=backend, io_workers=8)
    try:
        response = dcp.async_save(_state(4), checkpoint_id=tmp_path, no_dist=True,
                                  storage_writer=DataStatesWriter(engine=engine))
        response.staging_completion.result(timeout=TIMEOUT)
        time.sleep(0.3)
        assert not response.upload_completion.done(), "the save ended under its hashes"
        assert engine.live_leases() >= 1
        engine.gate.set()
        with pytest.raises(CheckpointException):
            response.upload_completion.result(timeout=TIMEOUT)
        assert engine.live_leases() == 0
        early = [live for e, _, live in engine.tasks if e]
        assert early and all(live >= 1 for live in early)
    finally:
        engine.gate.set()
        engine.close()  # before its backend
        backend.close()


def test_memory_tier_saves_take_their_snapshots_checksums_in_the_slot(
        tiers: Tiers, hash_engine) -> None:
    engine = hash_engine(host_cache_size="8MiB")
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        for step in range(1, 4):  # the first waits aside for its slot, the next go in at once
            state = _state(10 + step)
            manager.save(step, state).committed.result(timeout=TIMEOUT)
            assert engine.hashed(early=True) == _tensor_bytes(state)
            assert engine.hashed(early=False) < MiB
            engine.tasks.clear()
            _verified(tiers.memory / f"step_{step}", state)
