"""Tier integrity: a persist verifies every checksum of what it copies and refuses a
damaged step (the manager's and the CLI's), retention never loses the last good durable step,
``load()`` falls back past a damaged step; a step saved again replaces it in every tier; one
manager per tier directory (threads, processes, a SIGKILLed holder); each error raised once, and
a closed manager says so.

Damage is injected by editing files (a byte of an item flipped in its data file); faults come in
through ``Engine(io_backend=...)`` or the state saved, never by patching.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    MARKS,
    ROOT,
    Tiers,
    assert_state_equal,
    blank_like,
    load_into,
    rand_tensor,
)
from helpers.tiers import (
    HoldWrites,
    flip_payload_byte,
    make_state,
    manager_logs,
    persist,
    restored_from,
    run_cli,
    steps_in,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from dcp_datastates import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    Engine,
    TierFullError,
)
from dcp_datastates._format.metadata_file import read_metadata, write_metadata
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates._jobs.copy import copy_checkpoint

MiB = 1 << 20
#: What a refused persist names: the memory-tier file and the item whose checksum fails.
DAMAGED = (r"step_3 is damaged.*file __\d+_[0-9a-f]+\.safetensors, item 'model\.w'"
           r".*checksum mismatch")

pytestmark = MARKS


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def damaged_memory_step(tiers: Tiers, engine: Engine, keep_durable: int,
                        damage=flip_payload_byte) -> dict[int, dict]:
    """Steps 1 and 2 persisted, step 3 committed in memory only, then ``damage`` done to it
    (default: a byte of its item ``model.w`` flipped; sizes stay right: only checksums tell).
    Returns the states."""
    states = {s: make_state(s, big=MiB) for s in (1, 2, 3)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           keep_durable=keep_durable, persist=1, engine=engine) as manager:
        for step in (1, 2):
            manager.save(step, states[step])
            manager.wait()
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           persist=None, engine=engine) as manager:
        manager.save(3, states[3]).result(timeout=30)
    damage(tiers.memory / "step_3", "model.w")
    return states


def retype_header_entry(directory: Path, fqn: str) -> None:
    """Make the data file's header say I32 where ``.metadata`` says F32 for item ``fqn``
    (same length: the item's bytes and their checksums stay right; a load refuses it)."""
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == fqn)
    path = directory / loc.file
    head = path.read_bytes()[:loc.offset]
    at = head.index(b'"dtype":"F32"', head.index(f'"{fqn}"'.encode()))
    with open(path, "r+b") as f:
        f.seek(at + len(b'"dtype":"'))
        f.write(b"I32")


# -- 1. a persist verifies what it copies --------------------------------------------------------
@pytest.mark.parametrize("keep_durable", [1, 3])
def test_damaged_memory_step_is_refused_and_the_good_durable_step_stays(
        tiers: Tiers, engine: Engine, logs, keep_durable: int) -> None:
    """The issue's reproduction: a new manager persists the step left in memory (a leftover);
    its checksums fail, so it is refused (the error names the file and the item), dropped from
    memory, and never committed in the durable tier: with keep_durable=1 the only good durable
    step stays; latest_step()/load() give the newest good step."""
    states = damaged_memory_step(tiers, engine, keep_durable)
    good = [2] if keep_durable == 1 else [1, 2]
    assert steps_in(tiers.durable) == good and steps_in(tiers.memory) == [1, 2, 3]
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           keep_durable=keep_durable, engine=engine) as manager:
        with pytest.raises(CheckpointCorruptError, match=DAMAGED):
            manager.wait()
        assert steps_in(tiers.durable) == good, "nothing damaged is committed"
        assert not (tiers.durable / "step_3" / ".metadata").exists()
        assert steps_in(tiers.memory) == [1, 2], "the damaged step left the memory tier"
        assert manager.latest_step() == 2
        out = blank_like(states[2])
        assert manager.load(out) == 2
        assert_state_equal(out, states[2])
    assert steps_in(tiers.durable) == good  # close() found nothing newer to persist
    assert_state_equal(load_into(states[2], tiers.durable / "step_2"), states[2])
    assert any("step 3 is dropped from the memory tier" in m for m in manager_logs(logs))


def test_a_step_whose_header_contradicts_its_metadata_is_refused(tiers: Tiers,
                                                                 engine: Engine) -> None:
    """A data file whose header says another dtype than ``.metadata`` (its checksums all pass)
    does not load: its persist is refused too, by the manager and by the CLI, so retention
    (keep_durable=1) keeps the only good durable step."""
    damaged_memory_step(tiers, engine, keep_durable=1, damage=retype_header_entry)
    done = run_cli(tiers.memory, tiers.durable)
    assert done.returncode == 1 and re.search(r"step_3 is damaged.*header", done.stderr), (
        done.stdout, done.stderr)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           keep_durable=1, engine=engine) as manager:
        with pytest.raises(CheckpointCorruptError, match=r"step_3 is damaged.*item 'model\.w'"
                                                         r".*header does not match"):
            manager.wait()
        assert steps_in(tiers.durable) == [2]


def test_cli_persist_refuses_a_damaged_step(tiers: Tiers, engine: Engine,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m dcp_datastates persist MEM DUR`` checks every checksum as it copies: a
    damaged step exits 1 naming the file and the item, and the durable tier commits nothing."""
    damaged_memory_step(tiers, engine, keep_durable=3)
    done = run_cli(tiers.memory, tiers.durable)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert re.search(DAMAGED, done.stderr), done.stderr
    assert steps_in(tiers.durable) == [1, 2]
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable, "--step", 2)
    assert code == 0 and "already persisted" in out, (out, err)


def test_copy_job_removes_what_it_copied_of_a_damaged_file(tiers: Tiers, engine: Engine) -> None:
    """The copy job (what a persist runs) checks each block as it streams: a damaged item
    fails the copy before its commit, and the target keeps no data file and no metadata."""
    damaged_memory_step(tiers, engine, keep_durable=3)
    target = tiers.scratch / "copy"
    with pytest.raises(CheckpointCorruptError, match=r"item 'model\.w'.*checksum mismatch"):
        copy_checkpoint(engine, tiers.memory / "step_3", target)
    assert sorted(p.name for p in target.iterdir()) == []
    copy_checkpoint(engine, tiers.memory / "step_2", target)  # an intact one copies
    assert_state_equal(load_into(make_state(2, big=MiB), target), make_state(2, big=MiB))


def test_load_falls_back_past_a_damaged_durable_step(tiers: Tiers, engine: Engine, logs) -> None:
    """The newest step damaged in the only tier holding it: load() takes the next older step
    that loads (logged as an error); load(step=) of the damaged one raises."""
    states = {s: make_state(s) for s in (1, 2, 3)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           keep_durable=None, persist=1, engine=engine) as manager:
        for step, state in states.items():
            manager.save(step, state)
            manager.wait()
    for s in range(1, 4):  # the memory tier is gone (a new node)
        (tiers.memory / f"step_{s}" / ".metadata").unlink(missing_ok=True)
    flip_payload_byte(tiers.durable / "step_3", "model.w")
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        assert manager.latest_step() == 3
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            manager.load(blank_like(states[3]), step=3)
        out = blank_like(states[2])
        assert manager.load(out) == 2
        assert_state_equal(out, states[2])
    assert any("step 3 does not load" in m and "falling back" in m for m in manager_logs(logs))


def rewrite_metadata(directory: Path, edit: Callable[[Metadata], None]) -> None:
    """Replace ``directory``'s ``.metadata`` by one ``edit`` changed (written as a save writes
    it: only its numbers are hostile)."""
    metadata = read_metadata(directory)
    edit(metadata)
    (directory / ".metadata").unlink()
    write_metadata(directory, metadata, "edited")


def huge_chunk(metadata: Metadata) -> None:
    """Item ``model.w``'s one chunk made 10**4400 rows long (a number of more digits than
    Python turns into a string)."""
    md = metadata.state_dict_metadata["model.w"]
    metadata.state_dict_metadata["model.w"] = TensorStorageMetadata(
        md.properties, md.size, [ChunkStorageMetadata(torch.Size([0, 0]),
                                                      torch.Size([10 ** 4400, 40]))])


def huge_length(metadata: Metadata) -> None:
    """Item ``model.w``'s stored length made a 4400-digit number."""
    index = next(k for k in metadata.storage_data if k.fqn == "model.w")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index],
                                                       length=10 ** 4400)


@pytest.mark.parametrize("damage", [huge_chunk, huge_length])
def test_a_memory_step_with_hostile_numbers_falls_back_to_the_durable_copy(
        tiers: Tiers, engine: Engine, logs, damage: Callable[[Metadata], None]) -> None:
    """A memory-tier step whose ``.metadata`` holds numbers too large to print (a ValueError,
    not a CheckpointError, where they are formatted): a new manager starts, and load() takes
    the intact durable copy of the same step, logging which step and why."""
    state = make_state(1)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                           engine=engine) as manager:
        manager.save(1, state).result(timeout=30)
    rewrite_metadata(tiers.memory / "step_1", damage)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        assert manager.latest_step() == 1
        out = blank_like(state)
        assert manager.load(out) == 1
        assert_state_equal(out, state)
    assert restored_from(logs, 1) == ["durable"]


# -- 2. a step saved again -----------------------------------------------------------------------
def test_a_step_saved_again_replaces_it_in_every_tier(tiers: Tiers, engine: Engine) -> None:
    """Step 3 persisted, then saved again with another state (its persist not due): no tier
    holds the first state under step 3 any more (the durable copy moved to .abandoned/); the
    next persist (close()'s) commits the second state."""
    first, second = make_state(3), make_state(30)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=3,
                           persist=3, engine=engine) as manager:
        for step, state in ((1, make_state(1)), (2, make_state(2)), (3, first)):
            manager.save(step, state)
            manager.wait()
        assert steps_in(tiers.durable) == [3]
        manager.save(3, second)
        manager.wait()
        assert steps_in(tiers.durable) == [], "the old durable copy of step 3 is set aside"
        assert_state_equal(load_into(second, tiers.memory / "step_3"), second)
        out = blank_like(second)
        assert manager.load(out) == 3
        assert_state_equal(out, second)
    assert steps_in(tiers.durable) == [3]
    assert_state_equal(load_into(second, tiers.durable / "step_3"), second)
    (aside,) = (tiers.durable / ".abandoned").iterdir()
    assert_state_equal(load_into(first, aside / "step_3"), first)


def test_a_step_saved_again_while_persisted_replaces_the_durable_copy(
        tiers: Tiers, engine: Engine) -> None:
    """persist=1: both saves of step 1 are persisted; the durable step holds the second."""
    second = make_state(11)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                           engine=engine) as manager:
        manager.save(1, make_state(1))
        manager.wait()
        manager.save(1, second)
        manager.wait()
        assert manager.latest_step() == 1
    assert steps_in(tiers.durable) == [1]
    assert_state_equal(load_into(second, tiers.durable / "step_1"), second)
    assert_state_equal(load_into(second, tiers.memory / "step_1"), second)


# -- 3. one manager per tier directory -----------------------------------------------------------
def test_two_managers_as_threads_one_is_refused(tiers: Tiers, engine: Engine) -> None:
    """Two threads make a manager on the same directories at once: one gets them, the other
    fails at construction naming the directory and the holder's pid."""
    made: list[CheckpointManager] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def make() -> None:
        start.wait()
        try:
            made.append(CheckpointManager(tiers.durable, memory_dir=tiers.memory,
                                          engine=engine))
        except CheckpointError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert len(made) == 1 and len(errors) == 1, (made, errors)
        assert re.search(rf"tier {tiers.memory} is in use by another CheckpointManager "
                         rf"\(pid {os.getpid()}", str(errors[0])), str(errors[0])
    finally:
        for m in made:
            m.close()
    CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine).close()


def test_a_second_manager_on_the_durable_tier_is_refused(tiers: Tiers, engine: Engine) -> None:
    """The durable tier is claimed too (by the job: its rank 0), whatever the memory tier."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine):
        refused = rf"durable tier {tiers.durable} is in use by another CheckpointManager "
        with pytest.raises(CheckpointError, match=refused + rf"\(pid {os.getpid()}"):
            CheckpointManager(tiers.durable, memory_dir=tiers.scratch / "other", engine=engine)
        with CheckpointManager(tiers.scratch / "durable2", memory_dir=tiers.scratch / "m2",
                               engine=engine):
            pass  # other directories: no conflict


def test_cli_persist_is_refused_while_a_manager_holds_the_memory_tier(tiers: Tiers,
                                                                       engine: Engine) -> None:
    """``persist`` on the memory tier of a manager still running (its retention and its own
    persists write the same directories) exits 1 naming the tier and the holder's pid; once
    the manager is closed it runs."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
        done = run_cli(tiers.memory, tiers.durable)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert re.search(rf"memory tier {tiers.memory} is in use by .*\(pid {os.getpid()}",
                         done.stderr), done.stderr
        assert steps_in(tiers.durable) == []
    done = run_cli(tiers.memory, tiers.durable)
    assert done.returncode == 0 and "persisted step 1" in done.stdout, (done.stdout, done.stderr)


def test_a_refused_manager_removes_nothing_from_the_tier_it_is_refused(tiers: Tiers,
                                                                        engine: Engine) -> None:
    """A manager whose memory_dir is another manager's durable tier is refused, and removes
    nothing there before: that manager's persist in flight (a step not committed yet) commits."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.durable)
    slow = Engine(io_backend=hold, host_cache_size="8MiB", io_workers=4)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                               engine=slow) as manager:
            manager.save(1, make_state(1))
            assert hold.held.wait(30), "the persist never wrote"
            with pytest.raises(CheckpointError, match=r"in use by another CheckpointManager"):
                CheckpointManager(memory_dir=tiers.durable, engine=engine)
            hold.gate.set()
            manager.wait()
        assert steps_in(tiers.durable) == [1]
    finally:
        hold.gate.set()
        slow.close()


def test_a_forked_child_alive_does_not_keep_the_claims_after_close(tiers: Tiers,
                                                                    engine: Engine) -> None:
    """A process forked while the manager is open (a DataLoader worker) shares the lock files'
    descriptors: close() still gives the tiers up while that child lives on."""
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: waits until the test is done, touches nothing
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        manager.close()
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine).close()
    finally:
        os.close(w)
        os.waitpid(pid, 0)


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from dcp_datastates import CheckpointManager, Engine
    engine = Engine(io_backend="threads", host_cache_size="8MiB")
    manager = CheckpointManager(sys.argv[2], memory_dir=sys.argv[1], engine=engine)
    print("READY", flush=True)
    time.sleep(600)  # the test kills us
    """
)


def test_a_manager_in_another_process_is_refused_until_it_dies(tiers: Tiers,
                                                                engine: Engine) -> None:
    """A manager in another process holds the tiers: this one fails naming the directory and
    that process's pid; once it is killed (SIGKILL: nothing released by hand) a new manager
    starts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tiers.memory),
                              str(tiers.durable)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline().strip() == "READY", child.poll()
        with pytest.raises(CheckpointError, match=rf"memory tier {tiers.memory} is in use by "
                                                  rf"another CheckpointManager \(pid {child.pid}"):
            CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine).close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()


# -- 4. each error raised once; a closed manager says so -----------------------------------------
def test_close_does_not_raise_again_what_result_raised(tiers: Tiers, engine: Engine) -> None:
    """A full tier's TierFullError and a save's pickling error, raised by handle.result():
    close() does not raise them again."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, memory_limit=2 * MiB,
                           persist=None, engine=engine) as manager:
        full = manager.save(1, {"x": rand_tensor((4 * MiB,), torch.uint8, 1)})
        with pytest.raises(TierFullError):
            full.result(timeout=30)
        bad = manager.save(2, {"x": torch.zeros(4), "f": threading.Lock()})
        with pytest.raises(TypeError, match="pickle"):
            bad.result(timeout=30)
        manager.save(3, {"x": torch.ones(4)}).result(timeout=30)
    assert steps_in(tiers.memory) == [3]


def test_close_raises_what_nothing_raised_and_wait_raises_once(tiers: Tiers,
                                                                engine: Engine) -> None:
    """An error no handle.result() or wait() raised is close()'s; one wait() raised is not."""
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, memory_limit=2 * MiB,
                                persist=None, engine=engine)
    manager.save(1, {"x": rand_tensor((4 * MiB,), torch.uint8, 1)})
    with pytest.raises(TierFullError):
        manager.wait()
    manager.wait()  # raised once
    manager.save(2, {"x": rand_tensor((4 * MiB,), torch.uint8, 2)})
    with pytest.raises(TierFullError, match="step 2"):
        manager.close()


def test_every_method_of_a_closed_manager_says_it_is_closed(tiers: Tiers,
                                                            engine: Engine) -> None:
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=1,
                                engine=engine)
    state = make_state(1)
    manager.save(1, state).result(timeout=30)
    manager.close()
    manager.close()  # closing again does nothing
    calls = {"save": lambda: manager.save(2, state), "load": lambda: manager.load(state),
             "latest_step": manager.latest_step, "wait": manager.wait,
             "prepare": lambda: manager.prepare(state)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"CheckpointManager of {tiers.memory} is "
                                               rf"closed") as info:
            call()
        assert "cannot schedule new futures" not in str(info.value), name
