"""Checkpoint tiers (``dcp_datastates.tiers``) in one process: memory commits, background
persists, retention, restores from the fastest tier, a full memory tier, and recovery after
``kill -9`` (after a memory commit, and in the middle of a persist).

The memory tier lives under /dev/shm, the durable tier on disk (so persists take the O_DIRECT
path). Multi-rank cases (peer replicas, job-wide durable checkpoints) are in mpi/test_tiers_mpi.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    MARKS,
    TESTS,
    Tiers,
    assert_state_equal,
    blank_like,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    run_script,
)
from helpers.fakes import FaultyBackend
from helpers.tiers import (
    HoldWrites,
    flip_payload_byte,
    make_state,
    manager_logs,
    restored_from,
    run_and_kill,
    steps_in,
    wait_until,
)

from dcp_datastates import CheckpointManager, Engine, TierFullError, guard
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._claims import LOCK_NAME as TIER_LOCK

MiB = 1 << 20

pytestmark = MARKS


# -- files of the tiers ------------------------------------------------------------------------
def dirs_in(root: Path) -> list[str]:
    """Entries of ``root``, less the memory tier's slot directory (``.slots.<pid>``) and the
    tier's lock file."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".slots.") and p.name != TIER_LOCK)


def tier_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path: contents)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def truncate_data_file(directory: Path) -> None:
    (path,) = data_files(directory)
    os.truncate(path, path.stat().st_size // 2)


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


@pytest.fixture
def held_engine(tiers: Tiers) -> Iterator[tuple[Engine, HoldWrites]]:
    """An engine whose writes to the durable tier wait until ``hold.gate`` is set."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.durable)
    made = Engine(io_backend=hold, host_cache_size="8MiB", io_workers=4)
    try:
        yield made, hold
    finally:
        hold.gate.set()
        leases = made.live_leases()
        made.close()
        hold.close()
        assert leases == 0, f"{leases} lease(s) still held after the test"


# -- kill -9 -------------------------------------------------------------------------------------
def test_kill_after_memory_commit_then_restore_and_persist(tiers: Tiers, engine: Engine,
                                                           logs) -> None:
    """A process killed right after a memory commit: a new process restores that checkpoint
    exactly from memory and persists it (a plain DataStatesReader loads the durable copy)."""
    expected = make_state(7, big=MiB + 5)
    run_and_kill("commit", tiers, 7, MiB + 5, "COMMITTED")
    assert steps_in(tiers.memory) == [7]
    assert steps_in(tiers.durable) == [], "persist=None: nothing may reach the durable tier"

    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as manager:
        manager.wait()  # the constructor persisted step 7, in the background
        assert steps_in(tiers.durable) == [7]
        assert dirs_in(tiers.durable / "step_7") == sorted(
            [".dcp_datastates.lock", ".metadata", *(p.name for p in
                                                    data_files(tiers.memory / "step_7"))])
        assert manager.latest_step() == 7
        out = blank_like(expected)
        assert manager.load(out) == 7
        assert_state_equal(out, expected)
    assert any("persisting step 7 (committed in memory by an earlier process)" in m
               for m in manager_logs(logs))
    assert restored_from(logs, 7) == ["memory"]
    assert not list(tiers.memory.glob(".slots.*")), "the dead process's free slots are gone"
    assert_state_equal(load_into(expected, tiers.durable / "step_7"), expected)


@pytest.mark.parametrize("memory", ["kept", "lost"])
def test_kill_during_persist_keeps_older_durable_and_recovers(tiers: Tiers, engine: Engine,
                                                              logs, memory: str) -> None:
    """A process killed while it copies step 9 to the durable tier (which holds step 3): step 3
    still loads exactly; the torn step 9 is refused and ignored. Recovery: a new manager
    persists step 9 from the memory tier; or, the memory tier lost too (the node rebooted),
    the job resumes from step 3 and saves step 9 again, whose persist leaves nothing of the
    torn one."""
    a = make_state(3)
    expected_a = clone_state(a)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                           engine=engine) as manager:
        manager.save(3, a).result(timeout=60)
    assert steps_in(tiers.durable) == [3]
    durable_a = {p.name: p.read_bytes() for p in (tiers.durable / "step_3").iterdir()}

    big = 6 * MiB + 123  # several write requests: the child stalls after two of them
    expected_b = make_state(9, big)
    run_and_kill("persist", tiers, 9, big, "PERSISTING")
    torn = tiers.durable / "step_9"
    assert torn.is_dir() and not (torn / ".metadata").exists()
    assert data_files(torn), "the killed persist should have started the data file"
    assert not list(torn.glob(".part.*")), "the part comes after the copy"
    assert steps_in(tiers.memory) == [3, 9]

    # the older durable checkpoint is untouched and loads exactly
    assert {p.name: p.read_bytes() for p in (tiers.durable / "step_3").iterdir()} == durable_a
    assert_state_equal(load_into(expected_a, tiers.durable / "step_3"), expected_a)
    # the torn one is no checkpoint
    with raises_in_dcp(FileNotFoundError,
                       rf"{re.escape(str(torn))} is not a checkpoint: \.metadata is missing"):
        load_into(expected_b, torn)
    # a manager over the durable tier alone (an empty memory tier) takes step 3
    with CheckpointManager(tiers.durable, memory_dir=tiers.scratch / "empty", persist=None,
                           engine=engine) as durable_only:
        assert durable_only.latest_step() == 3
        out = blank_like(expected_a)
        assert durable_only.load(out) == 3
        assert_state_equal(out, expected_a)
        with pytest.raises(FileNotFoundError, match="no tier holds step 9 complete"):
            durable_only.load(blank_like(expected_b), step=9)
    assert restored_from(logs, 3) == ["durable"]

    torn_files = {p.name for p in data_files(torn)}
    if memory == "lost":
        shutil.rmtree(tiers.memory)
    # recovery: a manager on the memory tier persists step 9 properly
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as manager:
        if memory == "lost":
            out = blank_like(expected_a)
            assert manager.load(out) == 3
            assert_state_equal(out, expected_a)
            manager.save(9, make_state(9, big))
        manager.wait()
        assert steps_in(tiers.durable) == [3, 9]
        assert manager.latest_step() == 9
    assert not list(torn.glob(".part.*"))
    (data,) = data_files(torn)  # the torn file replaced, or (another save's) removed
    assert (data.name in torn_files) == (memory == "kept")
    assert_state_equal(load_into(expected_b, torn), expected_b)
    assert_state_equal(load_into(expected_a, tiers.durable / "step_3"), expected_a)


# -- a memory tier too small ---------------------------------------------------------------------
class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.relu(self.l1(x)))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _size(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_memory_tier_too_small_fails_the_save_and_training_goes_on(tiers: Tiers, engine: Engine,
                                                                   logs) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    limit = 2 * MiB
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, memory_limit="2MiB",
                                persist=None, engine=engine)
    hook = guard(opt, manager)
    expected: dict[int, dict] = {}
    handles = {}
    try:
        for step in range(1, 7):
            train_step(model, opt, step)
            state = {"model": model.state_dict(), "optim": opt.state_dict(),
                     "extra": {"step": step}}
            if step == 3:  # activations kept for a debug dump: far more than the tier holds
                state["debug"] = torch.ones(3 * MiB, dtype=torch.uint8)
            if step == 3:
                handles[2].committed.result(timeout=30)
                wait_until(lambda: [f.step for f in manager.history] == [1, 2], "save 2")
                before = tier_files(tiers.memory)
            if step in (1, 2, 3, 5):
                expected[step] = clone_state(state)
                handles[step] = manager.save(step, state)
            if step == 3:  # refused at once: nothing written, nothing removed
                assert tier_files(tiers.memory) == before
        failed = handles[3]
        err = failed.committed.exception(timeout=10)
        assert isinstance(err, TierFullError), err
        assert failed.staged.exception(timeout=10) is err
        m = re.search(rf"memory tier {re.escape(str(tiers.memory))} has (.+?) free; the "
                      rf"checkpoint of step 3 needs (.+?)\. Nothing was written", str(err))
        assert m, str(err)
        free, need = _size(m.group(1)), _size(m.group(2))
        assert 3 * MiB < need <= 5 * MiB and 0 < free <= limit and free < need, (free, need)
        assert not (tiers.memory / "step_3").exists(), "nothing of a refused save is written"

        assert manager.latest_step() == 5  # waits for the saves, leaves their errors to wait()
        with pytest.raises(TierFullError, match="checkpoint of step 3 needs"):
            manager.wait()  # the error, once
        manager.wait()
        for step in (1, 2, 5):
            assert handles[step].committed.exception() is None
        assert [f.step for f in manager.history] == [1, 2, 5]
        assert steps_in(tiers.memory) == [2, 5]  # keep_memory=2
        # step 2, there before the refused save, is as it was
        assert {k: v for k, v in tier_files(tiers.memory).items() if k.startswith("step_2/")} \
            == {k: v for k, v in before.items() if k.startswith("step_2/")}
        # training went on: what it saved after the refused save, and before, loads exactly
        for step in (5, 2):
            out = blank_like(expected[step])
            assert manager.load(out, step=None if step == 5 else step) == step
            assert_state_equal(out, expected[step])
    finally:
        hook.remove()
        manager.close()
    assert steps_in(tiers.durable) == []
    assert any("checkpoint of step 3 not taken" in m for m in manager_logs(logs))


def test_a_full_memory_tier_makes_room_from_persisted_steps(tiers: Tiers, engine: Engine,
                                                            logs) -> None:
    """A memory tier with room for two steps and a save in flight (keep_memory=2 asks for more):
    each later save drops the oldest step already persisted (its durable copy stays) instead
    of failing with TierFullError while persisted steps fill the tier; every save is taken. A
    save that dropping every persisted step would not fit drops none."""
    states = {s: make_state(s, big=MiB) for s in range(1, 6)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.scratch / "probe", persist=None,
                           engine=engine) as probe:
        probe.save(1, states[1]).result(timeout=30)
    one = sum(p.stat().st_size for p in (tiers.scratch / "probe" / "step_1").iterdir())
    need = MiB + 64 * 1024 + (1 << 20)  # the state, its small tensors, the save's slack
    limit = one + need + one // 4  # step 2 fits beside step 1; step 3 fits beside one step
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2, persist=1,
                           memory_limit=limit, engine=engine) as manager:
        for step, state in states.items():
            manager.save(step, state).result(timeout=30)
            assert steps_in(tiers.durable)[-1] == step
        assert steps_in(tiers.memory) == [4, 5]
        with pytest.raises(TierFullError):  # more than dropping every step would free
            manager.save(6, make_state(6, big=4 * MiB)).result(timeout=30)
        assert steps_in(tiers.memory) == [4, 5], "nothing is dropped in vain"
        out = blank_like(states[5])
        assert manager.load(out) == 5
        assert_state_equal(out, states[5])
    assert steps_in(tiers.durable) == [3, 4, 5]
    assert any("persisted step(s) [1] dropped from it to make room" in m
               for m in manager_logs(logs))


@pytest.mark.parametrize("keep", [1, 3])
def test_a_full_memory_tier_gives_advice_that_fits_the_options(tiers: Tiers, engine: Engine,
                                                               keep: int) -> None:
    """TierFullError says what gives the tier room with the options in use: keep_memory
    fewer only where it is above 1, the memory_limit in use, and that the steps it holds are
    not persisted."""
    with CheckpointManager(memory_dir=tiers.memory, keep_memory=keep, memory_limit="2MiB",
                           engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
        with pytest.raises(TierFullError) as info:
            manager.save(2, make_state(2, big=3 * MiB)).result(timeout=30)
    message = str(info.value)
    assert "a larger memory_limit= (now 2.00 MiB)" in message, message
    if keep == 1:
        assert "keep_memory" not in message, message
    else:
        assert "keep_memory=2 (now 3)" in message, message
    assert "Step(s) 1 in it are not persisted" in message, message


_WRITES_FAIL = """
import json, resource, signal, sys
sys.path.insert(0, {tests!r})
from helpers.tiers import make_state
from dcp_datastates import CheckpointManager, Engine

engine = Engine(io_backend="threads", host_cache_size="8MiB")
manager = CheckpointManager({durable!r}, memory_dir={memory!r}, persist=None, engine=engine)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # a write fails: EFBIG
try:
    manager.save(1, make_state(1)).result(timeout=60)
    error = "none"
except OSError as exc:
    error = str(exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
manager.save(2, make_state(2)).result(timeout=60)
manager.close()
engine.close()
print(json.dumps(error))
"""


def test_a_save_the_tier_cannot_write_fails_naming_the_file(tiers: Tiers) -> None:
    """A save whose first write into the memory tier fails (a file system full since the
    save checked its room fails the same way; here a file size limit of 0 makes every write
    fail): its error names the file it could not write, nothing of it stays in the tier, and
    the next save, writes working again, is taken."""
    done = run_script(_WRITES_FAIL.format(tests=str(TESTS), memory=str(tiers.memory),
                                          durable=str(tiers.durable)))
    assert done.returncode == 0, done.stderr[-3000:]
    error = json.loads(done.stdout.splitlines()[-1])
    record = tiers.memory / "step_1" / ".tier.json.tmp"
    assert error == f"[Errno 27] write failed: File too large: '{record}'", error
    assert steps_in(tiers.memory) == [2] and dirs_in(tiers.memory) == ["step_2"]
    assert_state_equal(load_into(make_state(2), tiers.memory / "step_2"), make_state(2))


# -- retention -----------------------------------------------------------------------------------
def test_retention_keeps_k_also_while_persists_overlap_saves(tiers: Tiers, held_engine) -> None:
    """keep_memory=2, keep_durable=2: a step being persisted stays in memory while newer saves
    commit, and goes once its persist is over; the persist then goes on with the newest step
    committed meanwhile; the durable tier keeps its 2 newest."""
    engine, hold = held_engine
    expected = {s: make_state(s) for s in range(1, 8)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                           keep_durable=2, persist="idle", engine=engine) as manager:
        handles = {1: manager.save(1, make_state(1))}
        assert handles[1].persisted is not None
        assert hold.held.wait(30)
        for step in (2, 3, 4):
            handles[step] = manager.save(step, make_state(step))
            handles[step].committed.result(timeout=30)
            assert handles[step].persisted is None, "a persist is running: no second one"
        # step 1 is being read by its persist: retention leaves it (and drops step 2)
        wait_until(lambda: steps_in(tiers.memory) == [1, 3, 4], "retention of step 2")
        assert not (tiers.durable / "step_1" / ".metadata").exists()

        hold.gate.set()
        manager.wait()
        # the disk free again, the persist went straight on with the newest step, 4 (not 2 or 3)
        assert steps_in(tiers.durable) == [1, 4]
        assert dirs_in(tiers.memory) == ["step_3", "step_4"]
        assert [f.step for f in manager.history if f.persist_s is not None] == [1, 4]

        for step in (5, 6, 7):
            handles[step] = manager.save(step, make_state(step))
            manager.wait()
            assert handles[step].persisted is not None
            assert dirs_in(tiers.memory) == [f"step_{step - 1}", f"step_{step}"]
        assert steps_in(tiers.durable) == [6, 7]
        assert dirs_in(tiers.durable) == ["step_6", "step_7"]
        for step in (7, 6):
            out = blank_like(expected[step])
            assert manager.load(out, step=step) == step
            assert_state_equal(out, expected[step])
    for step in (6, 7):
        assert_state_equal(load_into(expected[step], tiers.durable / f"step_{step}"),
                           expected[step])


def test_snapshots_go_into_reused_slots_that_become_the_data_files(tiers: Tiers,
                                                                   engine: Engine) -> None:
    """On tmpfs a save snapshots straight into a slot file that becomes the step's data file;
    retention hands the file back for a later save. Six saves one after the other with
    keep_memory=2 use three files (two kept, one written), the engine's snapshot cache is never
    made, and every kept step loads exactly (no bytes of an earlier step left in a reused
    slot)."""
    expected = {s: make_state(s, big=MiB + 3 * s) for s in range(1, 7)}
    inodes: dict[int, int] = {}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2, persist=None,
                           engine=engine) as manager:
        for step, state in expected.items():
            manager.save(step, state).committed.result(timeout=30)
            (data,) = data_files(tiers.memory / f"step_{step}")
            inodes[step] = data.stat().st_ino
            manager.wait()
            assert steps_in(tiers.memory) == [s for s in (step - 1, step) if s >= 1]
        assert engine.live_leases() == 0
        assert len(set(inodes.values())) == 3, inodes
        for step in (5, 6):
            out = blank_like(expected[step])
            assert manager.load(out, step=step) == step
            assert_state_equal(out, expected[step])
    # the engine (host_cache_size 8 MiB) made its 2 MiB of bounce buffers, no snapshot cache
    assert engine.cache_bytes() == 2 * MiB, "the snapshots never went through the host cache"
    assert dirs_in(tiers.memory) == ["step_5", "step_6"]
    assert not list(tiers.memory.glob(".slots.*")), "close() removes the free slots"
    for step in (5, 6):  # plain DCP loads of the memory tier's checkpoints, after the manager
        assert_state_equal(load_into(expected[step], tiers.memory / f"step_{step}"),
                           expected[step])


# -- which step a restore takes ------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "bad checksum"])
def test_latest_step_and_fallback_to_durable(tiers: Tiers, engine: Engine, logs,
                                             damage: str) -> None:
    """The newest step complete somewhere; a damaged memory copy of a step the durable tier
    holds loads from the durable tier; a damaged memory-only step is passed over."""
    expected = {s: make_state(s) for s in range(1, 5)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                           engine=engine) as manager:
        for step in (1, 2, 3):
            manager.save(step, make_state(step))
            manager.wait()
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        manager.save(4, make_state(4)).result(timeout=30)
        manager.wait()
        assert steps_in(tiers.memory) == [3, 4] and steps_in(tiers.durable) == [1, 2, 3]
        assert manager.latest_step() == 4

        # step 4 is in memory only: damaged, it is passed over for step 3 (memory, intact)
        truncate_data_file(tiers.memory / "step_4")
        assert manager.latest_step() == 3
        with pytest.raises(FileNotFoundError, match="no tier holds step 4 complete"):
            manager.load(blank_like(expected[4]), step=4)
        out = blank_like(expected[3])
        assert manager.load(out) == 3
        assert_state_equal(out, expected[3])
        assert restored_from(logs, 3) == ["memory"]

        # step 3 damaged in memory: the durable copy of the same step
        if damage == "truncated":
            truncate_data_file(tiers.memory / "step_3")
        else:
            flip_payload_byte(tiers.memory / "step_3", "model.w")
        assert manager.latest_step() == 3
        out = blank_like(expected[3])
        assert manager.load(out) == 3
        assert_state_equal(out, expected[3])
        assert restored_from(logs, 3) == ["memory", "durable"]
        if damage == "bad checksum":
            assert any("memory tier copy of step 3 unusable" in m and "checksum mismatch" in m
                       for m in manager_logs(logs))
        # an older step, asked for, from the durable tier (memory dropped it)
        out = blank_like(expected[1])
        assert manager.load(out, step=1) == 1
        assert_state_equal(out, expected[1])
        assert restored_from(logs, 1) == ["durable"]


def test_a_new_durable_step_is_fsynced_into_its_tier_before_older_steps_go(
        tiers: Tiers) -> None:
    """keep_durable=1: each persist commits a new step_N, then retention removes the older
    one. The durable tier's directory is fsynced in between (through the engine's I/O path),
    so a crash cannot lose the new step's name after the old step is gone."""
    listings: list[list[int]] = []

    def fsynced(path: str) -> None:
        if path == str(tiers.durable):
            listings.append(steps_in(tiers.durable))

    io = FaultyBackend(ThreadPoolBackend(), on_fsync=fsynced)
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_durable=1,
                               persist=1, engine=engine) as manager:
            for step in (1, 2, 3):
                manager.save(step, make_state(step)).result(timeout=30)
        assert steps_in(tiers.durable) == [3]
        assert listings == [[1], [1, 2], [2, 3]], listings
    finally:
        engine.close()
        io.close()


# -- persist every N-th save ---------------------------------------------------------------------
def test_persist_every_nth_save(tiers: Tiers, engine: Engine, logs) -> None:
    expected = {s: make_state(s) for s in range(1, 8)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=3, keep_durable=None,
                           engine=engine) as manager:
        persisted = []
        for step in range(1, 8):
            handle = manager.save(step, make_state(step))
            manager.wait()
            if handle.persisted is not None:
                persisted.append(step)
        assert persisted == [3, 6]
        assert steps_in(tiers.durable) == [3, 6]
    # close() persisted the newest, which the durable tier lacked
    assert steps_in(tiers.durable) == [3, 6, 7]
    assert any("persisting step 7 (the newest checkpoint)" in m for m in manager_logs(logs))
    for step in (3, 6, 7):
        assert_state_equal(load_into(expected[step], tiers.durable / f"step_{step}"),
                           expected[step])


def test_persist_due_while_one_runs_is_deferred_not_queued(tiers: Tiers, held_engine,
                                                           logs) -> None:
    """persist=2 with the persist of step 2 stuck: the persists due at saves 4 and 6 are
    deferred (one log line), none queues; the next save that finds the persist over takes it."""
    engine, hold = held_engine
    expected = {s: make_state(s) for s in range(1, 9)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=2, keep_memory=3,
                           engine=engine) as manager:
        handles = {}
        for step in range(1, 7):
            handles[step] = manager.save(step, make_state(step))
            handles[step].committed.result(timeout=30)
            if step == 2:
                assert hold.held.wait(30)
        assert [s for s, h in handles.items() if h.persisted is not None] == [2]
        deferred = [m for m in manager_logs(logs) if "deferred: the previous persist" in m]
        assert deferred == ["dcp_datastates: persist of step 4 deferred: the previous persist "
                            "is still running"]
        assert not handles[2].persisted.done()
        # keep_memory=3, and step 2 is being read
        wait_until(lambda: steps_in(tiers.memory) == [2, 4, 5, 6], "retention after save 6")

        hold.gate.set()
        handles[2].persisted.result(timeout=30)
        handles[7] = manager.save(7, make_state(7))  # the owed persist, though 7 is odd
        assert handles[7].persisted is not None
        handles[7].persisted.result(timeout=30)
        handles[8] = manager.save(8, make_state(8))  # due again
        assert handles[8].persisted is not None
        manager.wait()
        assert [s for s, h in handles.items() if h.persisted is not None] == [2, 7, 8]
        assert any("persisting step 7 (a persist was deferred)" in m
                   for m in manager_logs(logs))
        assert steps_in(tiers.durable) == [2, 7, 8]
        assert steps_in(tiers.memory) == [6, 7, 8]
    assert steps_in(tiers.durable) == [2, 7, 8]  # close(): the newest is there already
    for step in (2, 7, 8):
        assert_state_equal(load_into(expected[step], tiers.durable / f"step_{step}"),
                           expected[step])
