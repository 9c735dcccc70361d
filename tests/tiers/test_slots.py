"""The memory tier's slots, and resuming at memory speed: slots are made from ``prepare()``
on (the rotation the saves need) and pinned in the background, so a save is taken while
pinning is still under way (into an unpinned slot); a close while ``prepare(wait=True)`` pins
leaks no slot; and a manager started after a process was killed adopts the slot files that
process left in the tier instead of deleting them (never files a link or an odd entry of a
dead slot directory points at). Pinning is held through an injected engine
(``HeldPinEngine``); no test is timed against the wall clock.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    MARKS,
    ROOT,
    TESTS,
    Tiers,
    assert_state_equal,
    blank_like,
    data_files,
    rand_tensor,
    run_then_kill,
)
from helpers.fakes import Costly, FakeClock, HeldPinEngine
from helpers.tiers import HoldWrites, make_state, slot_files, steps_in, tier_files, wait_until

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates._memory.aside import stash
from dcp_datastates.tiers._slots import NextSlot, Slot, SlotPool

MiB = 1 << 20
TIMEOUT = 60

pytestmark = MARKS


@pytest.fixture
def held() -> Iterator[HeldPinEngine]:
    """An engine whose slot pinning waits until the test sets ``gate``."""
    made = HeldPinEngine(io_backend="threads", host_cache_size="8MiB", io_workers=4)
    try:
        yield made
    finally:
        made.gate.set()
        leases = made.live_leases()
        made.close()
        assert leases == 0, f"{leases} lease(s) still held after the test"


def in_use_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "slots are in use" in r.getMessage()]


# -- pinning in the background -------------------------------------------------------------------
def test_a_save_into_a_slot_not_ready_waits_aside(tiers: Tiers, held: HeldPinEngine,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Without prepare(), with pinning held: the first save's slot is neither sized nor
    pinned, so its snapshot is copied aside at once (the guard waits for that copy only) and
    moved into the slot on the engine's arena thread; the slot's file still becomes the
    step's data file, and the step loads exactly."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    state = make_state(1, big=MiB + 3)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=held) as manager:
        handle = manager.save(1, state)
        manager.wait_for_staging()
        for value in state.values():  # after the copy aside: must not reach the checkpoint
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.add_(1.0)
        handle.result(timeout=30)
        assert held.pinned == 0 and not held.gate.is_set()
        assert any("is not ready yet; the snapshot waits aside" in r.getMessage()
                   for r in caplog.records)
        assert not in_use_warnings(caplog)
        out = blank_like(state)
        assert manager.load(out) == 1
        assert_state_equal(out, make_state(1, big=MiB + 3))


def test_prepare_wait_returns_once_every_slot_is_pinned(tiers: Tiers,
                                                        held: HeldPinEngine) -> None:
    """prepare(wait=True) (a benchmark's set-up, off the clock): the calling thread helps the
    pool's thread and returns with the rotation's slots (``keep_memory + 2``) sized and
    pinned, no more; saves then go into them."""
    held.gate.set()
    state = make_state(1, big=MiB + 3)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=held) as manager:
        manager.prepare(state, wait=True)
        made = slot_files(tiers.memory)
        assert len(made) == 3 and held.pinned == 3, (made, held.pinned)
        manager.save(1, state).result(timeout=30)
        manager.wait()
        out = blank_like(state)
        assert manager.load(out) == 1
        assert_state_equal(out, state)


@pytest.mark.parametrize("keep_memory", [1, 3])
def test_prepare_makes_the_rotation_and_saves_hold_no_more(tiers: Tiers, held: HeldPinEngine,
                                                          keep_memory: int) -> None:
    """prepare() makes the slots that saves committed before the next one rotate through
    (the kept steps, the one being written, the spare: ``keep_memory + 2``), not the limit's
    ``keep_memory + 3``, and the saves that follow hold no more; every slot made is
    pinned."""
    held.gate.set()
    state = make_state(1, big=MiB + 3)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=keep_memory,
                           persist=None, engine=held) as manager:
        manager.prepare(state, wait=True)
        counts = [len(tier_files(tiers.memory))]
        for step in range(1, 3 * keep_memory + 3):
            manager.save(step, state).result(timeout=30)
            manager.wait()
            wait_until(lambda: len(list(tiers.memory.glob("step_*")))  # dropped ones gone
                       == len(steps_in(tiers.memory)), f"retention after step {step}")
            counts.append(len(tier_files(tiers.memory)))
        manager.prepare(state, wait=True)  # to count the pins of the spare made last
        assert held.pinned == len(tier_files(tiers.memory))
    assert counts == [keep_memory + 2] * len(counts), counts
    assert steps_in(tiers.memory)[-1] == 3 * keep_memory + 2


@pytest.mark.parametrize("keep_memory", [1, 2])
def test_saves_the_budget_skips_make_no_slots(tiers: Tiers, held: HeldPinEngine,
                                             keep_memory: int) -> None:
    """Under ``max_overhead``, saves skipped (each costs 0.5 s in its call: one in ten fits)
    leave no slot behind (each once made a spare, readied in turn: seconds of populating and
    pinning each); the tier holds the rotation's slots that prepare() made, no more."""
    held.gate.set()
    state = make_state(1, big=MiB + 3)
    clock = FakeClock()
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=keep_memory,
                           persist=None, engine=held, max_overhead=0.05,
                           clock=clock) as manager:
        manager.prepare(state, wait=True)
        handles = []
        for step in range(1, 12):
            clock.now += 1.0
            manager.order_after_staging()  # what the guard calls
            handles.append(manager.save(step, {"app": Costly(state, clock, 0.5)}))
        manager.wait()
        manager.prepare(state, wait=True)  # every slot left free is readied
        taken = [h.step for h in handles if not h.skipped]
        made = len(tier_files(tiers.memory))
    assert 1 <= len(taken) < 11 and handles[1].reason.startswith("budget"), [
        h.reason for h in handles]
    assert made == keep_memory + 2, (made, taken)


def test_a_persist_that_lags_holds_one_slot_more(tiers: Tiers) -> None:
    """persist="idle" (the default) on a durable tier slower than the saves: the step being
    persisted stays in the memory tier beside the kept ones, so saves that each commit before
    the next hold ``keep_memory + 3`` slots (the limit, never more), and the slots made stay
    for later saves once the persist is over. Every save is taken."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.durable)
    made = Engine(io_backend=hold, host_cache_size="8MiB", io_workers=4)
    counts = []
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                               persist="idle", engine=made) as manager:
            try:
                manager.prepare(make_state(1), wait=True)
                assert manager.save(1, make_state(1)).persisted is not None
                assert hold.held.wait(30), "the persist of step 1 never reached the disk"
                for step in range(2, 6):
                    manager.save(step, make_state(step)).committed.result(30)
                    # the dropped step's directory gone too (its .metadata goes first)
                    wait_until(lambda s=step: sorted(p.name for p in tiers.memory.glob("step_*"))
                               == sorted(["step_1", f"step_{s}"]), f"retention after step {step}")
                    counts.append(len(tier_files(tiers.memory)))
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
            manager.wait()
            for step in range(6, 9):
                manager.save(step, make_state(step)).result(timeout=30)
                manager.wait()
                counts.append(len(tier_files(tiers.memory)))
    finally:
        hold.gate.set()
        made.close()
    assert max(counts[:4]) == 1 + 3, counts  # step 1 (persisting), the newest, saving, spare
    assert counts[4:] == [1 + 3] * 3, counts  # kept: the most the tier needed
    assert steps_in(tiers.durable) == [6, 7, 8]


def test_prepare_and_saves_do_not_wait_for_pinning(tiers: Tiers, held: HeldPinEngine,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """prepare() and save() return while the pool's thread is held in the first pin; the
    snapshots wait aside meanwhile (the guard waits for that copy only: no copy into memory
    not pinned yet) and reach the tier once pinning goes on, in save order; each step loads
    exactly, and close() joins the thread."""
    caplog.set_level(logging.WARNING, logger="dcp_datastates")
    states = {s: make_state(s, big=MiB + 3) for s in (1, 2, 3)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                           persist=None, engine=held) as manager:
        manager.prepare(states[1])
        assert held.pinning.wait(30), "the pool's thread never started pinning"
        handles = [manager.save(step, state) for step, state in states.items()]
        manager.wait_for_staging()
        assert not any(h.committed.done() for h in handles), "committed before any pin"
        assert held.pinned == 0
        held.gate.set()
        for handle in handles:
            handle.result(timeout=30)
        manager.wait()
        assert held.pinned >= 3
        for step in (2, 3):
            out = blank_like(states[step])
            assert manager.load(out, step=step) == step
            assert_state_equal(out, states[step])
    assert in_use_warnings(caplog) == [], "the saves waited for slots being made, not in use"
    assert steps_in(tiers.memory) == [2, 3]
    assert slot_files(tiers.memory) == {}, "close() removes the free slots"


def test_a_pin_that_fails_is_logged_and_saves_go_on(tiers: Tiers, held: HeldPinEngine,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Pinning that fails (cudaHostRegister refused) stops the background pinning with one
    warning; the slots stay in use, unpinned."""
    caplog.set_level(logging.WARNING, logger="dcp_datastates")
    held.fail = True
    state = make_state(5, big=MiB)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=held) as manager:
        manager.prepare(state)
        assert held.pinning.wait(30)
        for step in (1, 2, 3):
            manager.save(step, state).result(timeout=30)
        manager.wait()
        out = blank_like(state)
        assert manager.load(out) == 3
        assert_state_equal(out, state)
    warned = [r.getMessage() for r in caplog.records if "not pinned" in r.getMessage()]
    assert len(warned) == 1, warned
    assert in_use_warnings(caplog) == []


# -- a restart after kill -9 ---------------------------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from helpers.tiers import make_state
    from dcp_datastates import CheckpointManager, Engine

    memory, durable, big = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = Engine(io_backend="threads", host_cache_size="8MiB")
    manager = CheckpointManager(durable, memory_dir=memory, keep_memory=1, persist=None,
                                engine=engine)
    manager.prepare(make_state(1, big))
    for step in (1, 2, 3):
        manager.save(step, make_state(step, big)).committed.result(timeout=60)
    manager.wait()  # retention dropped steps 1 and 2: their slots are free again
    print("COMMITTED", flush=True)
    time.sleep(600)  # the test kills us
    """
)


def run_and_kill(tiers: Tiers, big: int) -> None:
    """A process that saves steps 1..3 of ``make_state(step, big)`` into the memory tier,
    killed with SIGKILL once they are committed."""
    run_then_kill([sys.executable, "-c", _CHILD.format(tests=str(TESTS)), str(tiers.memory),
                   str(tiers.durable), str(big)], "COMMITTED", tiers.scratch / "child.err", ROOT)


def test_restart_adopts_the_dead_process_slots(tiers: Tiers, held: HeldPinEngine,
                                               logs: pytest.LogCaptureFixture) -> None:
    """After kill -9, a new manager takes the free slot files the dead process left (same
    inodes, moved into its own slot directory: no new file), loads the newest committed step
    exactly, and snapshots its next save into one of them once it is pinned again (the save
    waits aside meanwhile); the dead process's slot directory is gone."""
    run_and_kill(tiers, big=MiB + 7)
    left = slot_files(tiers.memory)
    assert len(left) >= 2, "the dead process left its free slots"
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=held) as manager:
        adopted = slot_files(tiers.memory)
        assert sorted(adopted.values()) == sorted(left.values())
        assert not set(adopted) & set(left), "moved into the new manager's slot directory"
        expected = make_state(3, big=MiB + 7)
        out = blank_like(expected)
        assert manager.load(out) == 3
        assert_state_equal(out, expected)
        manager.prepare(expected)
        assert held.pinning.wait(30)
        state = make_state(4, big=MiB + 7)
        handle = manager.save(4, state)  # waits aside for the adopted slot being pinned
        held.gate.set()
        handle.result(timeout=30)
        manager.wait()
        (data,) = data_files(tiers.memory / "step_4")
        assert data.stat().st_ino in left.values(), "the save went into an adopted slot"
    assert any("adopted" in r.getMessage() for r in logs.records)
    assert steps_in(tiers.memory) == [4]
    assert_state_equal(out, expected)
    assert slot_files(tiers.memory) == {}


def test_restart_with_a_larger_state_resizes_the_adopted_slots(tiers: Tiers,
                                                               held: HeldPinEngine) -> None:
    """Adopted slots too small for the new state are emptied and sized anew (their pages
    are not kept): the saves of the larger state load exactly."""
    run_and_kill(tiers, big=4096)
    assert slot_files(tiers.memory)
    held.gate.set()
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=held) as manager:
        for step in (4, 5):
            state = {"x": rand_tensor((3 * MiB,), torch.uint8, step)}
            manager.save(step, state).result(timeout=30)
            manager.wait()
            out = blank_like(state)
            assert manager.load(out) == step
            assert_state_equal(out, state)
    assert steps_in(tiers.memory) == [5]


# -- every slot in use ---------------------------------------------------------------------------
def test_a_save_with_every_slot_in_use_waits_aside_for_the_next_one(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """Commits held back keep every slot (keep_memory=1: 4 of them): the fifth and sixth
    saves' snapshots are copied aside at once (the sources may change after it), then go into
    the first slots to come free once the commits go on; no slot file beyond the four, none
    through the engine's host cache, logged once; the newest step loads exactly."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    made = Engine(io_backend=hold, host_cache_size="8MiB", io_workers=2)
    states = {s: make_state(s, big=MiB + 3) for s in range(1, 7)}
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=made) as manager:
            try:
                handles = [manager.save(s, states[s]) for s in range(1, 7)]
                manager.wait_for_staging()
                states[6]["model"]["w"].add_(1.0)  # after its copy aside
                states[6]["big"].add_(1)
                assert not any(h.committed.done() for h in handles)
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
            for handle in handles:
                handle.result(timeout=30)
            manager.wait()  # retention after the commits too
            assert len(tier_files(tiers.memory)) <= 4
            assert made.cache_bytes() == 2 * MiB, "bounce buffers only: no snapshot cache"
            out = blank_like(states[6])
            assert manager.load(out, step=6) == 6
            assert_state_equal(out, make_state(6, big=MiB + 3))
        assert len(in_use_warnings(caplog)) == 1
        assert any("waits aside for the next free slot" in m for m in in_use_warnings(caplog))
    finally:
        hold.gate.set()
        leases = made.live_leases()
        made.close()
    assert leases == 0


def test_a_header_that_outgrows_the_slots_room_gives_every_slot_the_room(
        tiers: Tiers, held: HeldPinEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A state whose header is larger than a slot keeps for it (long names): the first save
    is copied into the tier (logged once), and from then on every slot has the room: the next
    saves, each into another slot, are in place; the newest loads exactly."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    held.gate.set()
    state = {"k" * 4000 + str(i): torch.full((300,), float(i)) for i in range(40)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           persist=None, engine=held) as manager:
        for step in (1, 2, 3):
            manager.save(step, state).result(timeout=30)
        misses = [r.getMessage() for r in caplog.records
                  if "does not fit before the data" in r.getMessage()]
        assert len(misses) == 1, misses
        out = blank_like(state)
        assert manager.load(out) == 3
        assert_state_equal(out, state)


# -- a close during prepare, and the slot directories of dead processes ----------------------------
class HelperHeldEngine(Engine):
    """An engine whose ``pin_file`` holds a thread that is not the slot pool's own (the caller
    of ``prepare(wait=True)``, helping) until ``release`` is set; the pool's thread waits only
    until the helper pins (so each has a slot of its own)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.helping, self.release = threading.Event(), threading.Event()

    def pin_file(self, arena: object) -> None:
        if threading.current_thread().name.startswith("dcp_datastates-pin"):
            if not self.helping.wait(TIMEOUT):
                raise RuntimeError("the helper never pinned")
        else:
            self.helping.set()
            if not self.release.wait(TIMEOUT):
                raise RuntimeError("the test never released the helper")
        super().pin_file(arena)


def _fds_under(directory: Path) -> list[str]:
    """Descriptors of this process open on files under ``directory`` (deleted ones too)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


def test_close_while_prepare_wait_pins_leaks_no_slot(tiers: Tiers) -> None:
    """manager.close() while another thread's prepare(wait=True) is pinning a slot: the slot
    it was pinning is not left open (file descriptor, mapping) once both are over."""
    held = HelperHeldEngine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    try:
        manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                                    persist=None, engine=held)
        state = {"x": rand_tensor((MiB,), torch.uint8, 1)}
        helper = threading.Thread(target=manager.prepare, args=(state,),
                                  kwargs={"wait": True})
        helper.start()
        assert held.helping.wait(TIMEOUT)
        manager.close()
        held.release.set()
        helper.join(TIMEOUT)
        assert not helper.is_alive()
        assert _fds_under(tiers.memory) == []
        assert list(tiers.memory.glob(".slots.*/slot_*")) == []
    finally:
        held.release.set()
        held.close()


def test_a_symlinked_slot_directory_is_not_adopted(tiers: Tiers, engine: Engine) -> None:
    """A link named like a dead process's slot directory points at a directory of the user's:
    the files there are neither moved nor truncated by a new manager."""
    theirs = tiers.scratch / "theirs"
    theirs.mkdir(parents=True)
    (theirs / "slot_0").write_bytes(b"precious" * 1000)
    tiers.memory.mkdir(parents=True)
    (tiers.memory / ".slots.999999.abc").symlink_to(theirs)
    state = {"x": rand_tensor((MiB,), torch.uint8, 2)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=engine) as manager:
        manager.save(1, state).result(timeout=TIMEOUT)
        manager.wait()
    assert (theirs / "slot_0").read_bytes() == b"precious" * 1000


def test_odd_files_in_a_dead_slot_directory(tiers: Tiers, engine: Engine) -> None:
    """A dead process's slot directory holding an empty file, a file of a few bytes, a
    directory and a link named like slots: the link's target is untouched, saves load exactly,
    and nothing is left once the manager closes."""
    dead = tiers.memory / ".slots.999999.odd"
    dead.mkdir(parents=True)
    (dead / "slot_0").write_bytes(b"")
    (dead / "slot_1").write_bytes(b"12345")
    (dead / "slot_2").mkdir()
    target = tiers.scratch / "target"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"keep me")
    (dead / "slot_3").symlink_to(target)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=engine) as manager:
        for step in (1, 2, 3):
            state = {"x": rand_tensor((MiB + step,), torch.uint8, step), "step": step}
            manager.save(step, state).result(timeout=TIMEOUT)
            manager.wait()
            out = blank_like(state)
            assert manager.load(out) == step
            assert_state_equal(out, state)
    assert target.read_bytes() == b"keep me"
    assert not dead.exists() and list(tiers.memory.glob(".slots.*/slot_*")) == []


@pytest.fixture
def waiting(tiers: Tiers, engine: Engine) -> Iterator[tuple[SlotPool, Slot, NextSlot]]:
    """A pool of one slot, taken (``first``), and a save waiting for the next one."""
    pool = SlotPool(engine, tiers.memory, limit=1)
    try:
        first = pool.take()
        assert isinstance(first, Slot)
        next_slot = pool.take(later=True)
        assert isinstance(next_slot, NextSlot)
        yield pool, first, next_slot
    finally:
        pool.close()


@pytest.fixture
def given(tiers: Tiers, waiting: tuple[SlotPool, Slot, NextSlot]) -> tuple[SlotPool, NextSlot]:
    """A save that waited for the next slot, asked for it (``when_ready``) and was given it
    (the first slot went back unused)."""
    pool, first, next_slot = waiting
    asked = threading.Event()
    next_slot.when_ready(asked.set)
    assert not asked.is_set()
    pool.settle(first, tiers.scratch, committed=False)  # never made: a new slot is given
    assert asked.wait(TIMEOUT) and next_slot.slot is not None
    return pool, next_slot


def test_a_second_wait_for_a_slot_already_given_is_served_at_once(
        given: tuple[SlotPool, NextSlot]) -> None:
    """A save waiting for the next slot asks twice where it stops waiting once the GPU has
    room (its staging thread's wait, then its move's): when the slot was given between the
    two, the second call is served at once, not left waiting for a slot that will not come."""
    _, waiting = given
    again = threading.Event()
    waiting.when_ready(again.set)
    assert again.is_set()


def test_a_save_that_ended_gets_no_slot_when_it_asks_again(
        tiers: Tiers, given: tuple[SlotPool, NextSlot]) -> None:
    """A save that ended after its slot was given (failed, abandoned) gives the slot back; a
    later call of that save's (its move, to let its snapshot aside go) is called at once but
    finds no slot (another save may have the slot by then)."""
    pool, waiting = given
    slot = waiting.slot
    assert slot is not None
    slot.fit(MiB, 1)  # made, as a save sizes it
    pool.settle(waiting, tiers.scratch, committed=False)  # the save ended
    again = threading.Event()
    waiting.when_ready(again.set)
    assert again.is_set() and waiting.slot is None
    with pytest.raises(RuntimeError):
        waiting.lease(MiB, 1)
    assert pool.take() is slot  # free again, for another save


@pytest.mark.parametrize("registered", ["before", "after"])
def test_the_aside_of_a_save_that_ended_waiting_for_its_slot_is_let_go(
        tiers: Tiers, engine: Engine, waiting: tuple[SlotPool, Slot, NextSlot],
        registered: str) -> None:
    """A save whose snapshot waits aside for the next slot ends (failed, abandoned, its
    engine closing) before a slot comes free: its move is still queued (with no slot), so
    the arena thread lets its copy aside go, whether the move was registered before the
    save was settled or after (a save that went aside as it ended). No GPU memory or pageable
    buffer is left held by the engine."""
    pool, _, next_slot = waiting
    aside = stash([torch.ones(4096)], None, None)
    moved, failed = threading.Event(), []
    if registered == "after":
        next_slot.when_ready(lambda: None)  # the staging thread's wait for the slot
        pool.settle(next_slot, tiers.scratch, committed=False)  # the save ended
    engine.arenas.move_aside(aside, lambda: moved.set(), when=next_slot.when_ready,
                             failed=failed.append)
    assert engine.arenas.aside_bytes() > 0 or moved.is_set()
    if registered == "before":
        pool.settle(next_slot, tiers.scratch, committed=False)  # the save ended
    assert moved.wait(10), "the move of the ended save was never queued"
    wait_until(lambda: engine.arenas.aside_bytes() == 0, "the aside let go")
    assert failed == [] and next_slot.slot is None


def test_a_move_asked_for_while_the_pool_serves_it_is_queued_once(tiers: Tiers,
                                                                  engine: Engine) -> None:
    """The pool serves the saves waiting for a slot, then calls their queues outside its lock;
    a save whose staging thread asks again meanwhile (it went aside once the GPU had room) is
    served at once by that call: the pool must not call the new queue a second time (its
    move would run twice: two copies, and the aside let go twice)."""
    pool = SlotPool(engine, tiers.memory, limit=2)
    go_on = threading.Event()
    try:
        assert isinstance(pool.take(), Slot) and isinstance(pool.take(), Slot)
        w1, w2 = pool.take(later=True), pool.take(later=True)
        assert isinstance(w1, NextSlot) and isinstance(w2, NextSlot)
        inside = threading.Event()

        def held() -> None:  # the first save's queue: the pool's call stops here
            inside.set()
            go_on.wait(TIMEOUT)
        w1.when_ready(held)
        w2.when_ready(lambda: None)  # the second save's staging thread waits for its slot
        closer = threading.Thread(target=pool.close)
        closer.start()  # serves both (the pool closed), w1 first
        assert inside.wait(TIMEOUT)
        moves: list[int] = []
        w2.when_ready(lambda: moves.append(1))  # its move, once its snapshot went aside
        go_on.set()
        closer.join(TIMEOUT)
        assert moves == [1]
    finally:
        go_on.set()
        pool.close()
