"""A step saved again (the step just loaded, saved after training on) keeps its copies in every
tier until the new save commits: a save that fails, or a process killed mid-save, leaves the
old copies, and ``latest_step()`` returns that step.

Faults come in through ``Engine(io_backend=...)``; the kill is a child's, never a patch.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from helpers import (
    MARKS,
    ROOT,
    TESTS,
    Tiers,
    assert_state_equal,
    blank_like,
    data_files,
    load_into,
    run_then_kill,
    save,
)
from helpers.fakes import FaultyBackend
from helpers.tiers import make_state, steps_in

from dcp_datastates import (
    CheckpointError,
    CheckpointManager,
    DataStatesWriter,
    Engine,
    TierFullError,
)
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._steps import (
    REPLACING_NAME,
    check_complete,
    complete,
    mark_replacing,
)

pytestmark = MARKS


def _persist(durable: bool) -> int | None:
    return 1 if durable else None


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "memory+durable"])
def test_a_failed_save_of_a_step_again_keeps_its_copies(tiers: Tiers, durable: bool) -> None:
    """Step 1 committed (and persisted), then saved again while every write fails: the save
    fails, and step 1 is still the latest, with its first state, in every tier it was in."""
    first = make_state(1)
    faulty = FaultyBackend(ThreadPoolBackend())
    engine = Engine(io_backend=faulty, host_cache_size="8MiB", io_workers=2)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                               persist=_persist(durable), engine=engine) as manager:
            manager.save(1, first).result(timeout=30)
            manager.wait()
            faulty.fail_write_after = faulty.writes  # every write from now on fails
            handle = manager.save(1, make_state(2))
            with pytest.raises(OSError, match="injected"):
                handle.result(timeout=30)
            faulty.fail_write_after = None
            assert manager.latest_step() == 1, "the first save of step 1 is still there"
            out = blank_like(first)
            assert manager.load(out) == 1
            assert_state_equal(out, first)
            assert steps_in(tiers.memory) == [1]
            assert len(data_files(tiers.memory / "step_1")) == 1, "the failed save's file goes"
            assert steps_in(tiers.durable) == ([1] if durable else [])
        assert_state_equal(load_into(first, tiers.memory / "step_1"), first)
        if durable:
            assert_state_equal(load_into(first, tiers.durable / "step_1"), first)
    finally:
        engine.close()


def test_a_save_of_a_step_again_the_tier_has_no_room_for_keeps_its_copy(
        tiers: Tiers, engine: Engine) -> None:
    """Step 1 saved again with a state the memory tier has no room for: TierFullError,
    nothing written, and step 1 is still the latest, with its first state."""
    first = make_state(1)
    with CheckpointManager(None, memory_dir=tiers.memory, memory_limit="2MiB", persist=None,
                           engine=engine) as manager:
        manager.save(1, first).result(timeout=30)
        with pytest.raises(TierFullError, match="Nothing was written"):
            manager.save(1, make_state(2, big=4 << 20)).result(timeout=30)
        assert manager.latest_step() == 1
        out = blank_like(first)
        assert manager.load(out) == 1
        assert_state_equal(out, first)


_CHILD = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, {tests!r})
    from helpers.tiers import HoldWrites, make_state
    from dcp_datastates import CheckpointManager, Engine
    from dcp_datastates._io import ThreadPoolBackend

    memory, durable, persist = sys.argv[1:4]
    hold = HoldWrites(ThreadPoolBackend(), memory, let_through=1 << 30)
    engine = Engine(io_backend=hold, host_cache_size="8MiB")
    manager = CheckpointManager(durable, memory_dir=memory, keep_memory=1,
                                persist=int(persist) if persist != "none" else None,
                                engine=engine)
    manager.save(1, make_state(1)).result(timeout=60)
    manager.wait()
    hold.let_through = hold.durable_writes  # the memory tier's writes are held from now on
    threading.Thread(target=manager.save, args=(1, make_state(2)), daemon=True).start()
    assert hold.held.wait(60), "the save of step 1 again never wrote"
    print("HELD", flush=True)
    time.sleep(600)  # the test kills us
    """
)


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "memory+durable"])
def test_a_save_of_a_step_again_killed_mid_write_keeps_its_copies(tiers: Tiers, engine: Engine,
                                                                   durable: bool) -> None:
    """A process killed while it writes step 1 again: the next manager finds step 1 with its
    first state, in every tier it was in."""
    first = make_state(1)
    run_then_kill([sys.executable, "-c", _CHILD.format(tests=str(TESTS)), str(tiers.memory),
                   str(tiers.durable), "1" if durable else "none"], "HELD",
                  tiers.scratch / "child.err", ROOT)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=_persist(durable), engine=engine) as manager:
        assert manager.latest_step() == 1, "the first save of step 1 is still there"
        out = blank_like(first)
        assert manager.load(out) == 1
        assert_state_equal(out, first)
        step = tiers.memory / "step_1"
        assert len(data_files(step)) == 1, "the killed save's data file is gone"
        assert not (step / REPLACING_NAME).exists()
    assert_state_equal(load_into(first, tiers.memory / "step_1"), first)
    if durable:
        assert_state_equal(load_into(first, tiers.durable / "step_1"), first)


def test_a_copy_not_every_rank_committed_is_not_complete(tiers: Tiers, engine: Engine) -> None:
    """A save of a step again marks the copy it replaces; a copy committed over it is part of
    no checkpoint until every rank has committed theirs (a rank killed meanwhile: a restart
    must not load a mix of two saves): the next manager on the tier removes it."""
    first, second = make_state(1), make_state(2)
    directory = tiers.memory / "step_1"
    with CheckpointManager(None, memory_dir=tiers.memory, engine=engine) as manager:
        manager.save(1, first).result(timeout=30)
    mark_replacing(directory)
    assert complete(directory), "the copy the mark names is complete"
    save(second, directory, DataStatesWriter(engine=engine, overwrite=True))
    with pytest.raises(CheckpointError, match=r"step_1: a save of this step again .* was not "
                                              r"committed on every rank"):
        check_complete(directory)
    with CheckpointManager(None, memory_dir=tiers.memory, engine=engine) as manager:
        assert manager.latest_step() is None
    assert not directory.exists(), "the next manager on the tier removes it"
