"""Attacks on the first save, the memory tier's slots and the errors, one test each. Fakes
come in through constructors; no test is timed against the wall clock."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import MARKS, Tiers, assert_state_equal, blank_like, rand_tensor

from dcp_datastates import CheckpointManager, DataStatesReader, DataStatesWriter, Engine

pytestmark = MARKS
MiB = 1 << 20
TIMEOUT = 60


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


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = Engine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    try:
        yield made
    finally:
        made.close()


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


@pytest.mark.parametrize("cls", [DataStatesWriter, DataStatesReader, CheckpointManager])
def test_an_engine_passed_positionally_says_engine_equals(cls: type, engine: Engine) -> None:
    """``DataStatesWriter(engine)``: the engine went where the path goes; the error says to
    pass it as ``engine=`` (not "expected str, bytes or os.PathLike object")."""
    with pytest.raises(TypeError, match=r"engine=engine"):
        cls(engine)
