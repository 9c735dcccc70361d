"""The memory tier's slots and the manager's lifecycle: a step saved again,
a second manager on the same memory tier, a save after close, ``memory_limit`` with a state
that grows, states whose layout changes between saves, and a save that fails after its slot
became the step's data file. Real files under /dev/shm and on disk; no private functions
patched (faults come in through ``Engine(io_backend=...)``)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    Tiers,
    assert_state_equal,
    blank_like,
    data_files,
    load_into,
    rand_tensor,
)
from helpers.fakes import FakeClock, FaultyBackend
from helpers.tiers import FailFsync, make_state, save_through, steps_in
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import (
    CheckpointError,
    CheckpointManager,
    DataStatesReader,
    Engine,
    TierFullError,
)
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._claims import LOCK_NAME
from dcp_datastates.tiers._manager import HISTORY_KEPT

MiB = 1 << 20

pytestmark = MARKS


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def slot_mappings() -> list[str]:
    """Lines of /proc/self/maps that map a memory-tier slot file (``.slots.`` in the path)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "/.slots." in line or "slot_" in line]


def tier_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take (allocated blocks)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


# -- a step saved again --------------------------------------------------------------------------
def test_saving_a_step_again_does_not_leak_its_slot(tiers: Tiers, engine: Engine,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Saving a step that the memory tier holds (a rollback, a retried save) replaces its data
    file; the slot that held the old one must come back (free, or forgotten and unmapped), not
    stay mapped for ever while no list knows it: six re-saves keep snapshotting into slots and
    close() leaves no slot mapped."""
    caplog.set_level(logging.WARNING, logger="dcp_datastates")
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1, persist=None,
                           engine=engine) as manager:
        for k in range(6):
            state = make_state(10 + k, big=MiB)
            manager.save(1, state).result(timeout=30)
            manager.wait()
            assert_state_equal(load_into(state, tiers.memory / "step_1"), state)
        assert not any("memory-tier slots are in use" in r.getMessage() for r in caplog.records)
        assert engine.cache_bytes() == 2 * MiB, "every snapshot went into a slot"
    assert slot_mappings() == [], "close() unmaps every slot"
    assert steps_in(tiers.memory) == [1]


# -- a second manager on the same memory tier ----------------------------------------------------
def test_second_manager_on_the_same_memory_tier_leaves_the_first_ones_slots(
        tiers: Tiers, engine: Engine) -> None:
    """A second manager of the same process on the same memory directory (one that only reads
    the latest step, say) is refused at construction (one manager per tier directory),
    naming the directory and the holder's pid, and touches nothing: it must not delete the
    first one's slot files, whose saves go on committing."""
    first = CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                              persist=None, engine=engine)
    try:
        first.save(1, make_state(1, big=MiB)).result(timeout=30)
        first.wait()
        refused = rf"memory tier {tiers.memory} is in use by another CheckpointManager "
        with pytest.raises(CheckpointError, match=refused + rf"\(pid {os.getpid()}"):
            CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                              engine=engine)
        assert first.latest_step() == 1
        for step in (2, 3, 4, 5):
            state = make_state(step, big=MiB)
            first.save(step, state).result(timeout=30)
            first.wait()
            assert_state_equal(load_into(state, tiers.memory / f"step_{step}"), state)
    finally:
        first.close()
    assert slot_mappings() == []


# -- a save after close --------------------------------------------------------------------------
def test_save_after_close_is_refused_before_anything_is_written(
        tiers: Tiers, engine: Engine) -> None:
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1, engine=engine)
    manager.save(1, make_state(1)).result(timeout=30)
    manager.close()
    before = sorted(p.name for p in tiers.memory.iterdir())
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(2, make_state(2))
    assert sorted(p.name for p in tiers.memory.iterdir()) == before
    assert steps_in(tiers.durable) == [1]


# -- memory_limit with a state that grows --------------------------------------------------------
def test_memory_limit_holds_when_the_state_grows_into_a_reused_slot(
        tiers: Tiers, engine: Engine) -> None:
    """The bytes of the slot a save reuses are on the tier until the save resizes it: a state
    that doubles must not take the tier past ``memory_limit`` (it fails with TierFullError)."""
    size = 4 * MiB
    limit = 2 * size + size // 2 + MiB
    full: list[int] = []
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1, persist=None,
                           memory_limit=limit, engine=engine) as manager:
        for step, nbytes in ((1, size), (2, size), (3, 2 * size), (4, 2 * size)):
            state = {"x": rand_tensor((nbytes,), torch.uint8, step)}
            try:
                manager.save(step, state).result(timeout=30)
                manager.wait()
            except TierFullError:
                full.append(step)
                with pytest.raises(TierFullError):
                    manager.wait()  # reported once more, by wait()
            used = tier_bytes(tiers.memory)
            assert used <= limit, f"step {step}: the tier holds {used} bytes, limit {limit}"
    assert full == [3, 4]
    assert steps_in(tiers.memory) == [2]


@pytest.mark.parametrize("keep", [1, 2])
def test_the_spare_slot_gives_way_to_saves_under_memory_limit(tiers: Tiers, engine: Engine,
                                                              keep: int) -> None:
    """prepare() keeps a slot sized ahead of the next save; where ``memory_limit`` holds the
    kept steps and the save being written but not that spare, the spare gives way: every
    save is taken (as without prepare()), and the tier stays within the limit."""
    size = 4 * MiB
    limit = (keep + 1) * size + size // 2 + MiB
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=keep,
                           persist=None, memory_limit=limit, engine=engine) as manager:
        for step in range(1, keep + 5):
            state = {"x": rand_tensor((size,), torch.uint8, step)}
            manager.prepare(state, wait=True)  # the spare is sized before each save
            manager.save(step, state).result(timeout=30)
            manager.wait()
            used = tier_bytes(tiers.memory)
            assert used <= limit, f"step {step}: the tier holds {used} bytes, limit {limit}"
        out = blank_like(state)
        assert manager.load(out) == keep + 4
        assert_state_equal(out, state)
    assert steps_in(tiers.memory) == list(range(5, keep + 5))
    assert slot_mappings() == []


# -- layouts that change between saves -----------------------------------------------------------
def _layouts() -> list[dict]:
    long = "n" * 900  # long names: a header larger than a slot's first room
    return [
        {"a": rand_tensor((1000,), torch.float32, 1), "b": rand_tensor((7,), torch.int8, 2),
         "blob": b"x" * 10},
        {"a": rand_tensor((3000,), torch.float32, 3), "b": rand_tensor((7,), torch.int8, 4),
         "blob": b"y" * 50_000},  # a grows, the bytes item grows
        {"a": rand_tensor((10,), torch.float32, 5), "blob": b"z"},  # shrinks, one tensor fewer
        {"b": rand_tensor((5000,), torch.int16, 6), "a": rand_tensor((10,), torch.float32, 7),
         "c": rand_tensor((33,), torch.float64, 8)},  # other order, one more, no bytes item
        {f"{long}{k}": rand_tensor((k + 1,), torch.float32, 9 + k) for k in range(200)},
        {f"{long}{k}": rand_tensor((k + 1,), torch.float32, 300 + k) for k in range(200)},
        {"a": rand_tensor((1000,), torch.float32, 11), "blob": b"q" * 3},
        # one page each: the same slot size, the file cut short of the page by the last save
        {"u": rand_tensor((100,), torch.uint8, 12)},
        {"u": rand_tensor((4000,), torch.uint8, 13)},
        {"u": rand_tensor((100,), torch.uint8, 14)},
        {"u": rand_tensor((4096,), torch.uint8, 15)},
    ]


@pytest.mark.parametrize("keep", [1, 3])
def test_slot_reuse_with_layouts_that_change(tiers: Tiers, engine: Engine,
                                             keep: int) -> None:
    """Tensors that grow or shrink, bytes items that grow or shrink, tensors added, dropped or
    reordered, and headers larger than the slot's room: every step loads exactly, from the
    memory tier and from its persisted copy, with no byte of an older step in it."""
    states = _layouts()
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=keep,
                           keep_durable=None, persist=1, engine=engine) as manager:
        for step, state in enumerate(states, start=1):
            manager.save(step, state).result(timeout=60)
            manager.wait()
            for root in (tiers.memory, tiers.durable):
                assert_state_equal(load_into(state, root / f"step_{step}"), state)
            out = blank_like(state)
            assert manager.load(out, step=step) == step
            assert_state_equal(out, state)
    assert slot_mappings() == []


# -- a save that fails after its slot became the data file --------------------------------------
def test_failed_saves_after_the_slot_rename_lose_nothing(tiers: Tiers) -> None:
    """A save whose data file fails (after its slot was renamed into the step directory) fails
    alone: the steps committed before stay loadable, the next saves go into slots again, and
    the slot files stay bounded by keep_memory + 3."""
    io = FailFsync(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                               persist=None, engine=engine) as manager:
            good = {}
            for step in range(1, 11):
                state = make_state(step, big=MiB)
                io.failing = step % 3 == 0
                if save_through(manager, io, step, state):
                    good[step] = state
                files = [p for p in tiers.memory.rglob("*")
                         if p.is_file() and (p.name.startswith("slot_")
                                             or p.suffix == ".safetensors")]
                assert len(files) <= 2 + 3, files
            io.failing = False
            for step in steps_in(tiers.memory):
                assert_state_equal(load_into(good[step], tiers.memory / f"step_{step}"),
                                   good[step])
            assert steps_in(tiers.memory) == [8, 10]
            assert len(data_files(tiers.memory / "step_10")) == 1
        assert slot_mappings() == []
    finally:
        engine.close()
        io.close()


def test_a_failed_memory_commit_is_logged_naming_its_step_and_tier(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """A memory commit that fails is logged where it fails, naming the step and the tier, once,
    before anything waits for its handle (a loop that never looks at its handles, or an
    adapter that does not wait, still hears of it); the handle carries the error."""
    caplog.set_level(logging.ERROR, logger="dcp_datastates")
    io = FailFsync(ThreadPoolBackend(), tiers.memory)
    io.failing = True
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                               engine=engine) as manager:
            handle = manager.save(1, make_state(1))
            done = threading.Event()
            handle.committed.add_done_callback(lambda _: done.set())
            assert done.wait(30), "the commit never ended"
            logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(logged) == 1 and logged[0].startswith(
                f"dcp_datastates: checkpoint of step 1 not committed to the memory tier "
                f"{tiers.memory}: [Errno 5] injected EIO: '{tiers.memory / 'step_1'}/"), logged
            with pytest.raises(OSError, match="injected EIO"):
                handle.result(timeout=30)
            io.failing = False
            manager.save(2, make_state(2)).result(timeout=30)
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
        assert steps_in(tiers.memory) == [2]
    finally:
        engine.close()
        io.close()


def test_a_failed_save_leaves_nothing_in_the_memory_tier_after_close(tiers: Tiers) -> None:
    """The newest save fails after its slot became its data file: once the manager closes,
    its step directory and data file are gone from the memory tier (no orphan holding node
    memory), and the step committed before is left whole."""
    io = FailFsync(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    state = make_state(1, big=MiB)
    try:
        manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                                    engine=engine)
        try:
            manager.save(1, state).result(timeout=30)
            io.failing = True
            with pytest.raises(OSError, match="injected EIO"):
                manager.save(2, make_state(2, big=MiB)).result(timeout=30)
            assert (tiers.memory / "step_2").is_dir()  # what the failed save left, until close
        finally:
            io.failing = False
            manager.close()
        assert sorted(p.name for p in tiers.memory.glob("step_*")) == ["step_1"]
        left = [p.name for p in tiers.memory.rglob("*")
                if p.is_file() and "step_1" not in p.relative_to(tiers.memory).parts]
        assert left == [LOCK_NAME], left  # no slot, no data file of step 2
        assert_state_equal(load_into(state, tiers.memory / "step_1"), state)
    finally:
        engine.close()
        io.close()


@pytest.mark.parametrize("verify_checksums", [False, True])
def test_a_load_fails_where_its_step_is_dropped_and_its_slot_reused_meanwhile(
        tiers: Tiers, engine: Engine, verify_checksums: bool) -> None:
    """Another reader (another engine: an evaluation job) loads memory-tier step 1 while the
    manager (keep_memory=1) commits steps 2 and 3: step 1 is dropped and its data file, a slot,
    is reused in place by step 3 before the reader's reads run. The load fails saying that the
    checkpoint was replaced, with or without checksums: it never hands step 3's bytes out as
    step 1's, nor calls them corrupt."""
    states = {s: make_state(s, big=MiB) for s in (1, 2, 3)}
    io = FaultyBackend(ThreadPoolBackend(), hold_reads_after=0)
    reader_engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=2)
    errors: list[BaseException] = []

    def load_step_1() -> None:
        try:
            dcp.load(blank_like(states[1]), checkpoint_id=tiers.memory / "step_1", no_dist=True,
                     storage_reader=DataStatesReader(engine=reader_engine,
                                                     verify_checksums=verify_checksums))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                               persist=None, engine=engine) as manager:
            manager.save(1, states[1]).result(timeout=30)
            (slot_file,) = data_files(tiers.memory / "step_1")
            inode = slot_file.stat().st_ino
            reader = threading.Thread(target=load_step_1)
            reader.start()
            assert io.reads_held.wait(30), "the load never read"
            for step in (2, 3):
                manager.save(step, states[step]).result(timeout=30)
                manager.wait()
            (reused,) = data_files(tiers.memory / "step_3")
            assert reused.stat().st_ino == inode, "step 3 reuses step 1's slot file in place"
            io.read_gate.set()
            reader.join(60)
        assert len(errors) == 1, errors
        error = errors[0]
        if isinstance(error, CheckpointException):
            (error,) = [e for e, _trace in error.failures.values()]
        assert isinstance(error, CheckpointError), repr(error)
        assert f"checkpoint {tiers.memory / 'step_1'} was removed or replaced while this load "\
               "read it" in str(error), str(error)
    finally:
        io.read_gate.set()
        reader_engine.close()


def test_a_save_whose_planning_fails_holds_nothing_after_its_error(tiers: Tiers,
                                                                   engine: Engine) -> None:
    """A state that cannot be saved (a torch.uint1 tensor: torch cannot copy it, DCP's planner
    fails on its element size): the handle raises the error naming it, and the save holds
    nothing once it has (its snapshot, its slot): close() right after raises nothing more and
    gives the tiers up, and the next
    manager on them saves and loads."""
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                                engine=engine)
    bad = manager.save(1, {"x": torch.zeros(8, dtype=torch.uint1), "y": torch.ones(3)})
    with pytest.raises(TypeError, match="'x': a torch.uint1 tensor torch cannot copy"):
        bad.result(timeout=30)
    manager.close()
    state = make_state(2)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        manager.save(2, state).result(timeout=30)
        out = blank_like(state)
        assert manager.load(out) == 2
        assert_state_equal(out, state)
    assert engine.live_leases() == 0


# -- rollback ------------------------------------------------------------------------------------
def test_going_back_sets_the_newer_steps_aside(tiers: Tiers, engine: Engine,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """load(step=older), then training on: the first save moves the newer durable steps to
    durable/.abandoned/<time>/ (still loadable there) and drops them from memory, so
    latest_step() follows the new run, and a step number reached again is persisted anew (not
    taken for the old, committed copy)."""
    caplog.set_level(logging.WARNING, logger="dcp_datastates")
    old = {s: make_state(s) for s in (1, 2, 3, 4)}
    new = {s: make_state(100 + s) for s in (3, 4)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=5,
                           keep_durable=None, persist=1, engine=engine) as manager:
        for step, state in old.items():
            manager.save(step, state)
            manager.wait()
        assert steps_in(tiers.durable) == [1, 2, 3, 4]
        out = blank_like(old[2])
        assert manager.load(out, step=2) == 2
        assert_state_equal(out, old[2])
        assert manager.latest_step() == 4, "nothing moves before training goes on"
        for step, state in new.items():
            manager.save(step, state)
            manager.wait()
        assert manager.latest_step() == 4
        assert steps_in(tiers.memory) == [1, 2, 3, 4]
        for step, state in new.items():
            out = blank_like(state)
            assert manager.load(out, step=step) == step
            assert_state_equal(out, state)
    assert steps_in(tiers.durable) == [1, 2, 3, 4]
    for step, state in new.items():  # the durable copies are the new run's
        assert_state_equal(load_into(state, tiers.durable / f"step_{step}"), state)
    (aside,) = (tiers.durable / ".abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step_3", "step_4"]
    for step in (3, 4):  # the old run's steps are kept, whole
        assert_state_equal(load_into(old[step], aside / f"step_{step}"), old[step])
    messages = [r.getMessage() for r in caplog.records]
    assert any("loading step 2 while steps [3, 4] are newer" in m for m in messages), messages
    assert any(f"durable steps [3, 4] were moved to {aside}" in m for m in messages), messages


def test_a_save_of_an_older_step_is_refused_naming_the_newest(tiers: Tiers,
                                                               engine: Engine) -> None:
    """A step counter that starts again (a script run again from scratch into the same
    durable_dir, a counter per epoch): save() of a step older than the newest one raises at
    once, naming that step and the ways out, and writes nothing; the newer steps stay, and
    latest_step() still names them. Going back with load(step=) first is allowed."""
    states = {s: make_state(s) for s in (10, 20, 11)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                           engine=engine) as manager:
        for step in (10, 20):
            manager.save(step, states[step]).result(timeout=30)
        with pytest.raises(ValueError, match=r"step 3 refused: step 20 is the newest"):
            manager.save(3, make_state(3))
    memory = tiers.scratch / "memory2"  # a run started again: the same durable_dir
    with CheckpointManager(tiers.durable, memory_dir=memory, persist=1,
                           engine=engine) as manager:
        with pytest.raises(ValueError, match=r"step 5 refused: step 20 is the newest .*new "
                                             r"directories .*load\(state, step=N\)") as info:
            manager.save(5, make_state(5))
        assert str(tiers.durable / ".abandoned") in str(info.value)
        assert not (memory / "step_5").exists()
        assert manager.latest_step() == 20
        out = blank_like(states[10])
        assert manager.load(out, step=10) == 10
        manager.save(11, states[11]).result(timeout=30)
        assert manager.latest_step() == 11
    assert steps_in(tiers.durable) == [10, 11]
    assert_state_equal(load_into(states[11], tiers.durable / "step_11"), states[11])


def test_abandoned_keeps_the_newest_keep_durable_sets(tiers: Tiers, engine: Engine) -> None:
    """Going back again and again (load(step=1), then a new step 2, three times): each go-back
    sets the durable step 2 aside, and durable/.abandoned keeps only the newest keep_durable
    sets (here 1): the last state left, still loadable, not one checkpoint per go-back."""
    runs = [make_state(20 + r) for r in range(4)]
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                           keep_durable=1, persist=1, engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
        manager.save(2, runs[0]).result(timeout=30)
        for state in runs[1:]:
            assert manager.load(blank_like(make_state(1)), step=1) == 1
            manager.save(2, state).result(timeout=30)
    assert steps_in(tiers.durable) == [2]
    assert_state_equal(load_into(runs[3], tiers.durable / "step_2"), runs[3])
    (aside,) = (tiers.durable / ".abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step_2"]
    assert_state_equal(load_into(runs[2], aside / "step_2"), runs[2])


def test_history_keeps_the_figures_of_the_latest_saves(tiers: Tiers, engine: Engine) -> None:
    """``manager.history`` is bounded: it keeps the figures of the latest HISTORY_KEPT saves,
    not one more per save for as long as the run goes on (here a save every step under an
    overhead budget that no training time pays for: the first is taken, the rest skipped)."""
    with CheckpointManager(memory_dir=tiers.memory, max_overhead=0.05, clock=FakeClock(),
                           engine=engine) as manager:
        for step in range(HISTORY_KEPT + 3):
            manager.save(step, {"x": torch.full((4,), float(step))})
        manager.wait()
        steps = [f.step for f in manager.history]  # in the order they were settled
        assert len(steps) == len(set(steps)) == HISTORY_KEPT
        assert HISTORY_KEPT + 2 in steps


# -- the persist that close() (or a new manager) makes ------------------------------------------
def test_a_failed_final_persist_is_raised_by_close(tiers: Tiers) -> None:
    """close() persists the newest step when the durable tier lacks it: when that persist
    fails, close() raises its error (it is the run's last checkpoint: a log line alone would
    let the job end as if it were durable); so does wait() for the persist of what an earlier
    process left."""
    io = FailFsync(ThreadPoolBackend(), tiers.durable)
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    try:
        manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=100,
                                    engine=engine)
        manager.save(1, make_state(1, big=MiB))
        manager.wait()
        io.failing = True
        with pytest.raises(OSError, match="injected EIO"):
            manager.close()
        assert steps_in(tiers.durable) == []
        # a new manager persists the step left in memory: its failure is reported too
        manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=100,
                                    engine=engine)
        with pytest.raises(OSError, match="injected EIO"):
            manager.wait()
        io.failing = False
        manager.close()
        assert steps_in(tiers.durable) == [1]
    finally:
        engine.close()
        io.close()
