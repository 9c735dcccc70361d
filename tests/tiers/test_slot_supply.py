"""Every save waiting for a memory-tier slot gets one: a slot lost while saves wait is made
again (and readied), a slot the tier has no room for holds none of the tier's pages, and
pinning that fails leaves no save waiting; under ``max_overhead``, a save while the slots are
being made waits aside for one where the GPU has room. Pinning is held or failed through an
injected engine (``HeldPinEngine``); waits are bounded, never timed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    MARKS,
    Tiers,
    assert_state_equal,
    blank_like,
    mounted_tmpfs,
    rand_tensor,
)
from helpers.fakes import (
    Costly,
    FakeClock,
    HeldPinEngine,
    HeldPinRoomEngine,
)
from helpers.tiers import make_state, slot_files, steps_in, tier_files, wait_until

from dcp_datastates import CheckpointManager, Engine, TierFullError
from dcp_datastates._format.align import round_up
from dcp_datastates._sizes import free_bytes
from dcp_datastates.tiers._manager import _snapshot_size
from dcp_datastates.tiers._memory_save import SLACK_BYTES, state_bytes
from dcp_datastates.tiers._slots import NextSlot, Slot, SlotPool, _header_room

MiB = 1 << 20

pytestmark = MARKS


@pytest.fixture
def engine() -> Iterator[HeldPinEngine]:
    made = HeldPinEngine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    made.gate.set()
    try:
        yield made
    finally:
        made.gate.set()
        made.close()


@pytest.fixture
def memory(tiers: Tiers) -> Path:
    tiers.memory.mkdir(parents=True)
    return tiers.memory


def test_a_slot_lost_while_a_save_waits_is_made_again(memory: Path,
                                                      engine: Engine) -> None:
    """Every slot in use (limit 1) and a save waiting for the next: the slot's save fails
    after its file went into the step directory (the slot is lost). The pool makes a new
    slot in its place, and its thread readies it for the waiting save (it was made and left
    unready: the save waited until some later save woke the thread, so ``wait()`` and
    ``close()`` hung at the end of a run)."""
    pool = SlotPool(engine, memory, 1)
    try:
        pool.prepare(MiB, 4, wait=True)
        slot = pool.take()
        waiting = pool.take(later=True)
        assert isinstance(waiting, NextSlot) and waiting.slot is None
        given = threading.Event()
        waiting.when_ready(given.set)
        time.sleep(0.3)  # the pool's thread, woken by take(), has gone idle: nothing to ready
        step = memory / "step_1"
        step.mkdir()
        slot.adopt(step / "data.safetensors")
        pool.settle(slot, step, committed=False)  # a failed save: its slot is lost
        assert given.wait(5), "the waiting save never got the slot made in place of the lost"
        assert waiting.slot is not None and waiting.slot.pinned
    finally:
        pool.close()


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """An 8 MiB tmpfs (root only; skipped where mounting is not permitted)."""
    with mounted_tmpfs("8m", "dcp_slots_enospc_") as mnt:
        yield mnt


def test_a_slot_the_tier_has_no_room_for_holds_none_of_its_pages(
        small_tmpfs: Path, engine: HeldPinEngine, caplog: pytest.LogCaptureFixture) -> None:
    """prepare() for a state larger than the tier (whose room others took once prepare()
    saw it): the pool's thread cannot size the slot.
    The slot's file gives back the pages it got before the tier ran out (they filled the
    tier: a save in flight, another process's /dev/shm, failed with ENOSPC), the log says
    the tier had no room (not that pinning failed), and pinning goes on: a slot that a save
    sized is pinned once it is free (a full tier turned pinning off for the run)."""
    caplog.set_level(logging.WARNING, logger="dcp_datastates")
    # the room prepare() sees: others' files fill the tier before the slot is sized
    pool = SlotPool(engine, small_tmpfs, 3, room=lambda: 64 * MiB)
    try:
        pool.prepare(16 * MiB, 4, wait=True)
        assert free_bytes(small_tmpfs) > 7 * MiB, "the slot not made holds the tier's pages"
        assert not any("not pinned" in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records]
        assert any("no room" in r.getMessage() for r in caplog.records)
        slot = pool.take()
        assert slot is not None, "a save sizes its slot itself"
        lease = slot.lease(2 * MiB, 4)  # a save of a state that fits
        lease.release()
        pool.settle(slot, slot.home, committed=False)
        wait_until(lambda: engine.pinned >= 1, "the slot a save sized to be pinned", 5)
        assert not pool.readying()
    finally:
        pool.close()


def test_a_waiting_save_counts_a_steps_slot_only_while_a_save_may_free_it(
        memory: Path, engine: Engine) -> None:
    """Every slot in use, a save waits for the next: a slot that a committed step holds comes
    free only when a save in flight commits (the step then leaves the tier), so the waiting
    save counts its pages as its own only while one is in flight. With none, it once counted
    them anyway, was admitted onto a tier with no room for it, and failed with ENOSPC
    half-way through its data file (seen in CI)."""
    pool = SlotPool(engine, memory, 2)
    try:
        pool.prepare(MiB, 4, wait=True)
        kept = pool.take()
        wait_until(lambda: not pool.readying(), "the spare slot to be made", 5)
        writing = pool.take()
        assert isinstance(kept, Slot) and isinstance(writing, Slot)
        step = memory / "step_1"
        step.mkdir()
        kept.adopt(step / "data.safetensors")
        pool.settle(kept, step, committed=True)  # step 1 holds its slot
        waiting = pool.take(later=True)
        assert isinstance(waiting, NextSlot)
        assert waiting.nbytes == kept.nbytes, "a save in flight frees step 1's slot for it"
        second = memory / "step_2"
        second.mkdir()
        writing.adopt(second / "data.safetensors")
        pool.settle(writing, second, committed=True)  # it commits: none is in flight now
        assert waiting.slot is None
        assert waiting.nbytes == 0, "a step's slot that no save in flight frees counted"
    finally:
        pool.close()


def test_a_short_tier_waits_for_slots_being_sized_not_pinned(memory: Path) -> None:
    """A save that found the tier short counts its room again once the slots being sized are
    (their pages move between the tier's free space and the slot), not once they are pinned
    (seconds on a GPU host, and no page moves): the pinning held, ``wait_sized`` returns."""
    engine = HeldPinEngine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    pool = SlotPool(engine, memory, 1)
    try:
        pool.prepare(MiB, 4)
        assert engine.pinning.wait(10), "the pool's thread never pinned the slot"
        waited = threading.Thread(target=pool.wait_sized, daemon=True)
        waited.start()
        waited.join(10)
        assert not waited.is_alive(), "a short tier's save waited for a slot being pinned"
        assert engine.pinned == 0  # still held
    finally:
        engine.gate.set()
        pool.close()
        engine.close()


def test_a_save_that_comes_while_its_slot_is_pinned_does_not_wait_for_it(
        tiers: Tiers) -> None:
    """``memory_limit`` holds two states (keep_memory=1: the kept step and the one being
    written), so prepare() makes two slots, not the rotation's three. The second save comes
    while the second slot is being pinned (held): its call returns at once (a save once
    waited for that pinning on the training thread: seconds on a GPU host), and once pinning
    goes on it commits into that slot and loads exactly."""
    engine = HeldPinEngine(free_pins=1, io_backend="threads", host_cache_size="8MiB",
                           io_workers=2)
    states = {s: make_state(s, big=2 * MiB) for s in (1, 2)}
    slot = 2 * MiB + 256 * 1024  # a slot of one state: data and header room
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=engine, memory_limit=2 * slot + 2 * MiB) as manager:
            manager.prepare(states[1])
            assert engine.pinning.wait(5), "the second slot is being pinned"
            manager.save(1, states[1]).result(timeout=10)
            opens = threading.Timer(3, engine.gate.set)  # bounds the wait where save() waits
            opens.start()
            start = time.monotonic()
            handle = manager.save(2, states[2])
            called = time.monotonic() - start
            engine.gate.set()
            opens.cancel()
            handle.result(timeout=10)
            assert called < 2, f"save() waited {called:.1f} s for its slot's pinning"
            out = blank_like(states[2])
            assert manager.load(out) == 2
            assert_state_equal(out, states[2])
    finally:
        engine.gate.set()
        engine.close()


def test_slots_follow_a_state_that_grew_after_prepare(tiers: Tiers,
                                                      engine: HeldPinEngine) -> None:
    """prepare() for a state of 1 MiB, then saves of a state of 4 MiB: the slots made and
    readied from then on are sized for what the saves take, and a free slot of the old size
    is sized again and pinned by the pool's thread (one kept the size prepare() gave: each
    save that took it sized it on the staging thread, and copied into memory not pinned);
    each step loads exactly."""
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                           engine=engine) as manager:
        manager.prepare(make_state(0, big=MiB), wait=True)
        for step in range(1, 6):
            state = make_state(step, big=4 * MiB)
            manager.save(step, state).result(timeout=10)
            out = blank_like(state)
            assert manager.load(out) == step
            assert_state_equal(out, state)
        data = {p.stat().st_size for p in tiers.memory.glob("step_*/*.safetensors")}

        def sizes() -> set[int]:
            return {p.stat().st_size for p in tiers.memory.glob(".slots.*/slot_*")} | data

        wait_until(lambda: min(sizes()) >= 4 * MiB, "every slot sized for the saves' state", 5)


def test_a_spare_the_limit_has_no_room_for_is_not_waited_for(tiers: Tiers,
                                                            engine: HeldPinEngine) -> None:
    """Under ``max_overhead`` with a ``memory_limit`` of two states (keep_memory=1): the
    second save taken makes a spare the limit has no room for, and gives it up at once
    while the pool's thread is still making it (pinning held): its call does not wait for
    that pinning (it did, on the training thread: seconds on a GPU host), and the tier
    ends with no spare."""
    clock = FakeClock()
    states = {s: make_state(s, big=2 * MiB) for s in (1, 2)}
    slot = 2 * MiB + 256 * 1024  # a slot of one state: data and header room
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                           engine=engine, memory_limit=2 * slot + 2 * MiB,
                           max_overhead=0.5, clock=clock) as manager:
        manager.prepare(states[1], wait=True)
        clock.now += 1.0
        manager.save(1, states[1]).result(timeout=10)
        wait_until(lambda: engine.pinned == 2, "the spare to be pinned", 5)
        engine.gate.clear()
        opens = threading.Timer(3, engine.gate.set)  # bounds the wait where save() waits
        opens.start()
        clock.now += 100.0
        start = time.monotonic()
        handle = manager.save(2, states[2])
        called = time.monotonic() - start
        engine.gate.set()
        opens.cancel()
        assert not handle.skipped, handle.reason
        handle.result(timeout=10)
        assert called < 2, f"save() waited {called:.1f} s for the spare's pinning"
        manager.wait()
        wait_until(lambda: len(list(tiers.memory.glob(".slots.*/slot_*"))) <= 1,
                   "the spare given up", 5)
        out = blank_like(states[2])
        assert manager.load(out) == 2
        assert_state_equal(out, states[2])


def test_the_slots_prepare_makes_leave_room_for_what_a_save_asks_beyond_its_slot(
        tiers: Tiers, engine: HeldPinEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A state of many small tensors (an optimizer's step counters, biases) asks the tier for
    more than its slot holds (each tensor counts a page; the slot packs them). Under a
    ``memory_limit`` with room for the rotation's three slots but not for that excess as
    well, prepare() makes the slots a save's admission leaves alone: the first save removes
    none of them (it removed two, populated and pinned for nothing; no slot was made ahead
    of the saves from then on)."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    state = {"big": torch.randint(0, 255, (4 * MiB,), dtype=torch.uint8),
             "optim": {f"p{i}": {"step": torch.tensor(float(i)), "bias": torch.randn(200)}
                       for i in range(300)}}
    total, entries = _snapshot_size(state)
    slot = _header_room(entries) + round_up(total)
    assert state_bytes(state) > slot + MiB // 2  # what a save asks beyond its slot
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                           engine=engine, memory_limit=3 * slot + SLACK_BYTES + MiB // 4
                           ) as manager:
        manager.prepare(state, wait=True)
        made = len(slot_files(tiers.memory))
        assert made >= 1
        manager.save(1, state).result(timeout=10)
        assert not any("had no room for a save" in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records]
        assert len(tier_files(tiers.memory)) == made
        for step in (2, 3):  # each once retention dropped the older step (keep_memory=1)
            wait_until(lambda s=step: steps_in(tiers.memory) == [s - 1],
                       f"retention before step {step}", 5)
            manager.save(step, state).result(timeout=10)
        out = blank_like(state)
        assert manager.load(out) == 3
        assert_state_equal(out, state)


def test_no_slot_is_made_ahead_that_the_tier_has_no_room_for(
        engine: HeldPinEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A tmpfs with room for two and a half states (a container's small /dev/shm),
    keep_memory=1: prepare() makes the two slots it has room for, not the rotation's three,
    and no spare follows them (one made by the second save ran out of room on the pool's
    thread, and no slot was made ahead for the rest of the run); the saves rotate through the
    two and each loads exactly."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    states = {s: make_state(s, big=2 * MiB) for s in range(1, 5)}
    total, entries = _snapshot_size(states[1])
    slot = _header_room(entries) + round_up(total)
    with mounted_tmpfs(f"{(2 * slot + slot // 2 + SLACK_BYTES) // 1024}k",
                       "dcp_slots_room_") as mnt:
        tier = mnt / "tier"
        with CheckpointManager(memory_dir=tier, keep_memory=1, persist=None,
                               engine=engine) as manager:
            manager.prepare(states[1], wait=True)
            assert len(slot_files(tier)) == 2
            for step, state in states.items():  # each once retention dropped the older
                # step and its slot is free again (a save before that gets a slot made)
                wait_until(lambda s=step: steps_in(tier) == [s - 1][:s - 1]
                           and len(slot_files(tier)) == (2 if s == 1 else 1),
                           f"retention before step {step}", 5)
                manager.save(step, state).result(timeout=10)
            out = blank_like(states[4])
            assert manager.load(out) == 4
            assert_state_equal(out, states[4])
            assert len(tier_files(tier)) <= 2
    assert not [r.getMessage() for r in caplog.records if "no room" in r.getMessage()]


@pytest.mark.parametrize("room", [True, False], ids=["gpu-room", "no-gpu-room"])
def test_a_budgeted_save_while_the_slots_are_made_waits_aside_for_one(
        tiers: Tiers, room: bool) -> None:
    """Under ``max_overhead``, a fresh manager after ``prepare(state)`` (no wait): the first
    save comes while the first slot is still being pinned (held). Where the GPU has room to
    keep its snapshot aside, it is taken, waits aside, and commits into that slot once it
    is pinned, loading exactly (every save was skipped until a slot was made: a new or
    restarted job had no checkpoint for seconds); a second save meanwhile is skipped (one
    save waits at a time). Where the GPU has no room, the first is skipped too (an aside in
    pageable memory would hold the CUDA driver). No state dict is taken for a save skipped,
    and one taken is charged its state dict's time (taken before the ranks decide, a
    collective state dict hung ranks that decided on other paths)."""
    engine = HeldPinRoomEngine(room, io_backend="threads", host_cache_size="8MiB",
                               io_workers=2)
    clock = FakeClock()
    states = {s: make_state(s, big=2 * MiB) for s in (1, 2)}
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=engine, max_overhead=0.5, clock=clock) as manager:
            manager.prepare(states[1])
            assert engine.pinning.wait(10)
            clock.now += 1.0
            before = clock.now
            first = manager.save(1, {"app": Costly(states[1], clock, 0.25)})
            if not room:
                engine.gate.set()
                assert first.skipped and first.reason.startswith("no memory-tier slot free")
                assert clock.now == before  # no state dict taken
                return
            assert not first.skipped, first.reason
            assert first.figures.cost_s == 0.25  # the state dict's time, in the call
            manager.wait_for_staging()  # the guard's wait: for the copy aside, not the slot
            clock.now += 1.0
            before = clock.now
            second = manager.save(2, {"app": Costly(states[2], clock, 0.25)})
            assert second.skipped and second.reason.startswith("no memory-tier slot free")
            assert clock.now == before
            assert not first.committed.done()  # it waits aside for the slot being pinned
            engine.gate.set()
            first.result(timeout=10)
            out = {"app": Costly(blank_like(states[1]), clock, 0.0)}
            assert manager.load(out) == 1
            assert_state_equal(out["app"].state, states[1])
    finally:
        engine.gate.set()
        engine.close()


@pytest.mark.parametrize("prepare", [True, False], ids=["prepare", "no-prepare"])
@pytest.mark.parametrize("durable", [False, True], ids=["memory", "persisted"])
def test_a_tier_with_room_for_one_state_refuses_the_next_save_before_writing(
        tiers: Tiers, engine: Engine, prepare: bool, durable: bool) -> None:
    """A tmpfs with room for one state and a third (a 48 MiB state in a 64 MiB tier, scaled
    down), keep_memory=1: prepare() makes the one slot it has room for. The second save
    needs a slot with pages of its own (the first step's slot stays until it commits): it
    fails with TierFullError before writing anything, as without prepare() (not with ENOSPC
    half-way through its data file). Where the first step is persisted, it leaves the tier
    to make room, and every save commits."""
    size = 6 * MiB
    with mounted_tmpfs("8m", "dcp_tier_one_state_") as mnt:
        tier = mnt / "tier"
        with CheckpointManager(tiers.durable if durable else None, memory_dir=tier,
                               keep_memory=1, persist=1 if durable else None,
                               engine=engine) as manager:
            states = {s: {"x": rand_tensor((size,), torch.uint8, s)} for s in (1, 2, 3)}
            if prepare:
                manager.prepare(states[1], wait=True)
            manager.save(1, states[1]).result(timeout=30)
            for step in (2, 3):
                handle = manager.save(step, states[step])
                if durable:
                    handle.result(timeout=30)
                    continue
                with pytest.raises(TierFullError, match=rf"the checkpoint of step {step} "
                                                        r"needs .*Nothing was written"):
                    handle.result(timeout=30)
                assert sorted(p.name for p in tier.glob("step_*")) == ["step_1"]
            with contextlib.suppress(TierFullError):
                manager.wait()
            newest = 3 if durable else 1
            out = blank_like(states[newest])
            assert manager.load(out) == newest
            assert_state_equal(out, states[newest])
