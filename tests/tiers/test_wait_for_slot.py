"""A memory-tier save whose snapshot would wait aside in pageable memory (no room on the GPU)
waits for its slot instead, on the engine's staging thread, and copies straight into it: the
training's guard then waits about one commit, not for a slow copy. Once the GPU has room again
(an earlier snapshot aside moved out) it stops waiting and goes aside.

The decision (:func:`~dcp_datastates._memory.aside.fits_on_gpu`) is fed fake sizes; the staging path
runs on CPU tensors through an engine that finds no GPU room (``helpers.fakes.NoGpuRoomEngine``).
Every wait is on an event or a log line, none on a wall clock threshold. While one manager's
save waits there for its slot, the saves of another manager on the same engine wait behind it,
and the log says so.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import MARKS, Tiers, assert_state_equal, blank_like
from helpers.fakes import FakeGpuSource, NoGpuRoomEngine
from helpers.tiers import (
    ASIDE,
    TIMEOUT,
    WAITS,
    HoldWrites,
    _messages,
    _wait_until,
    make_state,
    tier_files,
)

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates._memory.aside import fits_on_gpu, room_in

pytestmark = MARKS
MiB, GiB = 1 << 20, 1 << 30


def _mem_info(free: dict[int, int], total: int = 80 * GiB):
    """A ``torch.cuda.mem_get_info`` of devices with ``free`` bytes each of ``total``."""
    return lambda device: (free[device], total)


def _never_asked(device: int) -> tuple[int, int]:
    raise AssertionError(f"device {device} asked for its memory")


# -- the decision ---------------------------------------------------------------------------------
def test_fits_on_gpu_where_every_device_keeps_its_headroom() -> None:
    """Each device must keep ``headroom`` of its memory free after all of its sources (8 GiB
    of 80 here); one device short is enough for False. CPU sources do not count."""
    sources = [FakeGpuSource(0, 3 * GiB), FakeGpuSource(0, 2 * GiB), FakeGpuSource(1, GiB),
               torch.zeros(4)]
    cuda = object()  # only its presence is read
    assert fits_on_gpu(sources, cuda, 0.1, _mem_info({0: 13 * GiB, 1: 9 * GiB}))
    assert not fits_on_gpu(sources, cuda, 0.1, _mem_info({0: 13 * GiB - 1, 1: 9 * GiB}))
    assert not fits_on_gpu(sources, cuda, 0.1, _mem_info({0: 13 * GiB, 1: 9 * GiB - 1}))
    assert fits_on_gpu(sources, cuda, 0.0, _mem_info({0: 5 * GiB, 1: GiB}))
    assert not fits_on_gpu(sources, cuda, 1.0, _mem_info({0: 80 * GiB, 1: 80 * GiB}))


def test_room_aside_counts_torch_unused_segments_not_private_pools() -> None:
    """Room for a buffer aside: the driver's free bytes and the segments torch's allocator
    holds that no tensor uses (reserved, less allocated, less the free parts of segments in
    use); those of private pools (a CUDA graph's, which its replays use) do not count."""
    info = (5 * GiB, 80 * GiB)
    stats = {"reserved_bytes.all.current": 10 * GiB, "allocated_bytes.all.current": 2 * GiB,
             "inactive_split_bytes.all.current": GiB}
    assert room_in(info, {}) == info
    assert room_in(info, stats) == (12 * GiB, 80 * GiB)
    graphs = {**stats, "reserved_bytes_by_private_pools.0_1.all.current": 4 * GiB,
              "reserved_bytes_by_private_pools.0_1.large_pool.current": 4 * GiB,
              "reserved_bytes_by_private_pools.1_2.all.current": 2 * GiB}
    assert room_in(info, graphs) == (6 * GiB, 80 * GiB)
    assert room_in(info, {**graphs, "allocated_bytes.all.current": 9 * GiB}) == info


def test_fits_on_gpu_without_cuda_python_or_gpu_sources() -> None:
    """Without cuda-python GPU sources are copied into pageable memory (False); CPU sources
    alone never ask a device (True: their copy aside is a cheap memcpy)."""
    assert not fits_on_gpu([FakeGpuSource(0, MiB)], None, 0.0, _mem_info({0: 80 * GiB}))
    assert fits_on_gpu([torch.zeros(4), torch.empty(0)], object(), 1.0, _never_asked)
    assert fits_on_gpu([], None)


def test_engine_finds_room_for_cpu_sources() -> None:
    """The engine's question (the seam ``NoGpuRoomEngine`` overrides): CPU sources fit."""
    with Engine(io_backend="threads", io_workers=1) as engine:
        assert engine.aside_fits_on_gpu([torch.zeros(3), torch.empty(0)])


# -- the staging path -----------------------------------------------------------------------------
class _RoomLaterEngine(Engine):
    """An engine that finds no GPU room for a snapshot aside until ``room`` is set (an earlier
    snapshot aside has left the GPU)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.room = threading.Event()

    def aside_fits_on_gpu(self, sources: list) -> bool:
        return self.room.is_set()


@pytest.mark.parametrize("room", [False, True], ids=["no-room", "room-later"])
def test_a_save_with_every_slot_in_use_waits_for_its_slot_or_room(
        tiers: Tiers, caplog: pytest.LogCaptureFixture, room: bool) -> None:
    """Commits held back keep every slot (keep_memory=1: 4 of them): the fifth save returns
    at once, but its snapshot waits on the staging thread, not aside (nothing aside, no host
    cache), until a slot comes free; it is copied straight into it, and sources changed after
    ``wait_for_staging`` do not reach the checkpoint. The saves into slots not pinned yet
    are copied into them at once (no aside either). Where the GPU has room again before a
    slot comes free, the save stops waiting: its snapshot goes aside (the training may go on),
    then moves into the first slot that comes free and commits there, bit-exact."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    made = _RoomLaterEngine(io_backend=hold, host_cache_size="8MiB", io_workers=2)
    states = {s: make_state(s, big=MiB + 3) for s in range(1, 6)}
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=made) as manager:
            try:
                handles = [manager.save(s, states[s]) for s in range(1, 6)]
                _wait_until(lambda: _messages(caplog, WAITS))
                assert not handles[4].staged.done()
                assert made.arenas.aside_bytes() == 0
                if room:
                    made.room.set()
                    _wait_until(lambda: _messages(caplog, ASIDE))  # logged once it is staged
                    manager.wait_for_staging()
                    assert _messages(caplog, "has room again")
                    assert made.arenas.aside_bytes() > 0  # aside: no slot free yet
                assert not any(h.committed.done() for h in handles)
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
            manager.wait_for_staging()
            states[5]["model"]["w"].add_(1.0)
            states[5]["big"].add_(1)
            for handle in handles:
                handle.result(timeout=TIMEOUT)
            manager.wait()
            assert len(tier_files(tiers.memory)) <= 4
            out = blank_like(states[5])
            assert manager.load(out, step=5) == 5
            assert_state_equal(out, make_state(5, big=MiB + 3))
            assert made.arenas.aside_bytes() == 0
        assert len(_messages(caplog, WAITS)) == 1  # the fifth save only
        if not room:
            assert made.cache_bytes() == 2 * MiB, "bounce buffers only: no snapshot cache"
            assert _messages(caplog, "waited") and not _messages(caplog, ASIDE)
    finally:
        hold.gate.set()
        leases = made.live_leases()
        made.close()
    assert leases == 0


def test_a_save_waiting_for_its_slot_holds_up_another_managers_saves_and_says_so(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """Two managers on one engine share its staging thread: while manager A's save waits
    there for a slot (A's commits held), manager B's save cannot even start its snapshot,
    for as long as A's wait lasts (unbounded: until A's slot comes). The wait's log line
    says so; once A's slot comes both go on and nothing stays leased."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    engine = NoGpuRoomEngine(io_backend=hold, host_cache_size="8MiB", io_workers=2)
    a = CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None, engine=engine)
    b = CheckpointManager(memory_dir=tiers.scratch, keep_memory=1, persist=None, engine=engine)
    try:
        try:
            handles = [a.save(s, make_state(s, big=MiB + 3)) for s in range(1, 6)]
            waiting = _wait_for_log(caplog, "the snapshot waits for it")
            assert "saves staged after it wait too" in waiting
            other = b.save(1, make_state(7))
            with pytest.raises(TimeoutError):  # held behind A's wait, not failed
                other.staged.result(timeout=0.5)
        finally:
            hold.gate.set()
        other.result(timeout=TIMEOUT)
        for handle in handles:
            handle.result(timeout=TIMEOUT)
    finally:
        hold.gate.set()
        a.close()
        b.close()
        leases = engine.live_leases()
        engine.close()
    assert leases == 0


def _wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> str:
    stop = threading.Event()
    for _ in range(TIMEOUT * 100):
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        stop.wait(0.01)
    raise AssertionError(f"never logged: {text}")
