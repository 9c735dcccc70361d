"""``NextSlot``: memory-tier saves taken while every slot is in use wait
aside for the next slot to come free. Writes are held (``HoldWrites``, ``FaultyBackend``
gated) so that every slot stays in use; the gates are opened from the test, never timed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import MARKS, Tiers, assert_state_equal, blank_like
from helpers.fakes import FaultyBackend
from helpers.tiers import HoldWrites, make_state, tier_files

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._slots import NextSlot, SlotPool

MiB = 1 << 20

pytestmark = MARKS


class Engines:
    """Engines made by a test, closed at its end with their leases counted."""

    def __init__(self) -> None:
        self.made: list[Engine] = []
        self.gates: list[threading.Event] = []

    def __call__(self, backend: object, gate: threading.Event) -> Engine:
        self.gates.append(gate)
        self.made.append(Engine(io_backend=backend, host_cache_size="8MiB", io_workers=2))
        return self.made[-1]


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    try:
        yield made
    finally:
        for gate in made.gates:
            gate.set()
        leases = [e.live_leases() for e in made.made]
        for e in made.made:
            e.close()
        assert leases == [0] * len(leases), f"leases left: {leases}"


def held_engine(engines: Engines, memory: Path) -> tuple[Engine, HoldWrites]:
    hold = HoldWrites(ThreadPoolBackend(), memory)
    return engines(hold, hold.gate), hold


def slot_dirs(memory: Path) -> list[Path]:
    return list(memory.glob(".slots.*"))


def six_saves_waiting(tiers: Tiers, engines: Engines
                      ) -> tuple[Engine, HoldWrites, CheckpointManager, list]:
    """A manager (keep_memory=1: 4 slots) whose commits are held, with six saves started:
    the last two wait aside for a slot."""
    made, hold = held_engine(engines, tiers.memory)
    manager = CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                                engine=made)
    handles = [manager.save(s, make_state(s, big=MiB)) for s in range(1, 7)]
    manager.wait_for_staging()
    return made, hold, manager, handles


def close_while_held(close: Callable[[], None], hold: HoldWrites, handles: list) -> None:
    """Run ``close`` on a thread, which waits while the writes are held; then let them go:
    it returns and every save has committed."""
    closer = threading.Thread(target=close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() waits for the held saves"
    hold.gate.set()
    closer.join(60)
    assert not closer.is_alive()
    for h in handles:
        h.result(timeout=1)


def test_close_while_saves_wait_for_a_slot(tiers: Tiers, engines: Engines) -> None:
    """close() called while two saves wait aside: it waits for them (they get slots as the
    commits go on), commits all, and leaves no slot directory or lease."""
    made, hold, manager, handles = six_saves_waiting(tiers, engines)
    close_while_held(manager.close, hold, handles)
    assert slot_dirs(tiers.memory) == []
    with CheckpointManager(memory_dir=tiers.memory, persist=None, engine=made) as again:
        out = blank_like(make_state(6, big=MiB))
        assert again.load(out) == 6
        assert_state_equal(out, make_state(6, big=MiB))


def test_failed_saves_free_the_slots_others_wait_for(tiers: Tiers, engines: Engines) -> None:
    """Every write fails (EIO) once let through: the saves holding the slots fail and lose
    them; the waiting saves make new slots (no more than the limit) and fail too; nothing
    hangs, close() raises nothing more (each handle raised its error), no lease is left."""
    faulty = FaultyBackend(ThreadPoolBackend(), fail_write_after=0, gated=True)
    made = engines(faulty, faulty.gate)
    manager = CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                                engine=made)
    handles = [manager.save(s, make_state(s, big=MiB)) for s in range(1, 7)]
    manager.wait_for_staging()
    faulty.gate.set()
    for h in handles:
        with pytest.raises(Exception, match="injected"):
            h.result(timeout=60)
    assert len(tier_files(tiers.memory)) <= 4
    manager.close()
    assert slot_dirs(tiers.memory) == []


def test_a_step_saved_again_while_every_slot_is_in_use(tiers: Tiers, engines: Engines) -> None:
    """Step 6 saved again while saves 1-6 hold every slot or wait for one: the save waits for
    them (the gate opens from another thread), replaces step 6, and loads exactly."""
    made, hold = held_engine(engines, tiers.memory)
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=3, persist=None,
                           engine=made) as manager:
        first = [manager.save(s, make_state(s, big=MiB)) for s in range(1, 7)]
        manager.wait_for_staging()
        opener = threading.Timer(0.2, hold.gate.set)
        opener.start()
        again = manager.save(6, make_state(20, big=MiB))
        opener.join()
        for h in [*first, again]:
            h.result(timeout=60)
        manager.wait()
        assert len(tier_files(tiers.memory)) <= 6
        out = blank_like(make_state(20, big=MiB))
        assert manager.load(out, step=6) == 6
        assert_state_equal(out, make_state(20, big=MiB))


def test_many_waiting_saves_with_a_large_keep_memory(tiers: Tiers, engines: Engines) -> None:
    """keep_memory=8 (11 slots), 30 saves taken while the commits are held: no slot file
    beyond the limit, none left free beyond it after, the newest steps kept and exact."""
    made, hold = held_engine(engines, tiers.memory)
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=8, persist=None,
                           engine=made) as manager:
        handles = [manager.save(s, make_state(s)) for s in range(30)]
        manager.wait_for_staging()
        assert not any(h.committed.done() for h in handles)
        hold.gate.set()
        for h in handles:
            h.result(timeout=60)
        manager.wait()
        assert len(tier_files(tiers.memory)) <= 11
        assert made.live_leases() == 0
        out = blank_like(make_state(29))
        assert manager.load(out) == 29
        assert_state_equal(out, make_state(29))


def test_two_managers_waiting_saves_do_not_hold_each_other(tiers: Tiers,
                                                           engines: Engines) -> None:
    """Two managers on one engine: the first's saves wait for slots (its commits held); the
    second's snapshots land in their slots meanwhile (no thread, the engine's arena thread
    least of all, waits for a slot: a waiting save's move is queued once its slot is given).
    Their commits come after the first's, in the engine's save order."""
    made, hold = held_engine(engines, tiers.memory)
    other = tiers.scratch / "other"
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                           engine=made) as stuck, \
            CheckpointManager(memory_dir=other, keep_memory=1, persist=None,
                              engine=made) as free:
        try:
            held = [stuck.save(s, make_state(s)) for s in range(1, 7)]
            others = [free.save(s, make_state(s)) for s in range(1, 4)]
            for h in others:
                h.staged.result(timeout=10)
            assert not any(h.committed.done() for h in held)
        finally:
            hold.gate.set()
        for h in held + others:
            h.result(timeout=60)


# -- the pool itself ------------------------------------------------------------------------------
def test_the_pool_gives_slots_to_waiting_saves_in_order_and_lets_them_go_at_close(
        tmp_path: Path) -> None:
    """Saves waiting for a slot get the slots that come free in save order (a later save,
    or one under a budget, takes none while they wait); each one's move is queued once its
    slot is given, not before; at close a waiting move is queued and finds no slot."""
    pool = SlotPool(None, tmp_path, 2)
    queued: list[str] = []
    try:
        taken = [pool.take(), pool.take()]
        first, second = pool.take(later=True), pool.take(later=True)
        assert isinstance(first, NextSlot) and isinstance(second, NextSlot)
        second.when_ready(lambda: queued.append("second"))
        first.when_ready(lambda: queued.append("first"))
        assert queued == []
        pool.settle(taken[0], tmp_path / "step_1", committed=False)  # back home: free
        assert queued == ["first"] and first.slot is not None and second.slot is None
        assert pool.take() is None, "a free slot goes to the saves waiting, not a new one"
        third = pool.take(later=True)
        pool.settle(taken[1], tmp_path / "step_2", committed=False)
        assert queued == ["first", "second"] and second.slot not in (None, first.slot)
        third.when_ready(lambda: queued.append("third"))
        assert third.slot is None and queued == ["first", "second"]
    finally:
        pool.close()
    assert queued == ["first", "second", "third"]
    with pytest.raises(RuntimeError, match="closed before one came free"):
        third.lease(4096, 1)


def test_engine_closed_while_saves_wait_for_a_slot(tiers: Tiers, engines: Engines) -> None:
    """The engine closed (not the manager) while two saves wait aside: its close finishes the
    manager, which commits every save once the writes go on; no slot directory is left."""
    made, hold, manager, handles = six_saves_waiting(tiers, engines)
    close_while_held(made.close, hold, handles)
    assert slot_dirs(tiers.memory) == []
    manager.close()
