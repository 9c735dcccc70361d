"""The first save of a process never waits for the host cache to be made.

The engine's ``make_arena`` is a :class:`~helpers.fakes.SlowArena`: the snapshot cache is made only
once the test sets its gate. Every wait here is on an event, none on a wall clock.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    clone_state,
    load_into,
    raises_in_dcp,
    rand_tensor,
    save,
)
from helpers.fakes import SlowArena

from dcp_datastates import CheckpointError, DataStatesWriter, Engine, guard
from dcp_datastates._memory.arenas import Memory
from dcp_datastates._memory.aside import HOST, stash

pytestmark = MARKS
TIMEOUT = 60
ENGINE = {"host_cache_size": "8MiB", "io_backend": "threads", "io_workers": 2}


def _state(seed: int = 0) -> dict:
    base = rand_tensor((40, 33), torch.float32, seed=seed)
    return {
        "big": rand_tensor((300_001,), torch.uint8, seed=seed + 1),
        "bf16": rand_tensor((128, 130), torch.bfloat16, seed=seed + 2),
        "view": base.t()[1:30:2],
        "empty": torch.empty(0, 3),
        "nested": {"step": seed, "bias": rand_tensor((33,), torch.float16, seed=seed + 3)},
    }


def _wait_until(done, timeout: float = TIMEOUT) -> None:
    """Wait for ``done()`` (an event the engine does not signal); fail after ``timeout``."""
    stop = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if done():
            return
        stop.wait(0.01)
    raise AssertionError("never happened")


def _async_save(state: dict, path: Path, engine: Engine, **writer_kw: object):
    return dcp.async_save(state, checkpoint_id=path, no_dist=True,
                          storage_writer=DataStatesWriter(engine=engine, **writer_kw))


def test_first_save_and_guard_do_not_wait_for_the_cache(tmp_path: Path, make_engine) -> None:
    slow = SlowArena()
    engine = make_engine(make_arena=slow, **ENGINE)
    model = torch.nn.Linear(64, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard(opt, engine)
    state = {"model": model.state_dict(), **_state()}
    expected = clone_state(state)
    resp = _async_save(state, tmp_path / "ck", engine)
    assert slow.started.wait(TIMEOUT)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()  # the guard waits for the copy aside only
    state["big"].add_(1)
    state["nested"]["bias"].zero_()
    assert not slow.gate.is_set() and not slow.timed_out
    assert engine.arenas.aside_bytes() > 0 and engine.cache_bytes() == 0
    assert not resp.upload_completion.done()
    slow.gate.set()
    resp.upload_completion.result(TIMEOUT)
    assert engine.arenas.aside_bytes() == 0 and not slow.timed_out
    assert_state_equal(load_into(expected, tmp_path / "ck", engine=engine), expected)
    assert engine.arenas.snapshot_memory(1) is Memory.ARENA  # later saves take the cache at once


def test_saves_while_the_cache_is_made_queue_behind_the_first(tmp_path: Path,
                                                                make_engine) -> None:
    """Only the first snapshot goes aside; the next ones are copied, in order, once the cache
    is ready. Each holds its state as it was at its call: CPU tensors are copied in the call,
    so a write before the cache is ready reaches none of them."""
    slow = SlowArena()
    engine = make_engine(make_arena=slow, **ENGINE)
    states = [_state(seed) for seed in (1, 2, 3)]
    at_call = [clone_state(s) for s in states]
    resps = [_async_save(s, tmp_path / f"ck{k}", engine) for k, s in enumerate(states)]
    assert slow.started.wait(TIMEOUT)
    _wait_until(lambda: engine.arenas.aside_bytes() > 0)  # the first snapshot is copied aside
    for s in states:
        s["big"].zero_()
    slow.gate.set()
    for resp in resps:
        resp.upload_completion.result(TIMEOUT)
    assert engine.arenas.aside_bytes() == 0
    for k, want in enumerate(at_call):
        assert_state_equal(load_into(want, tmp_path / f"ck{k}", engine=engine), want)


def test_a_cache_that_cannot_be_made_fails_the_first_save_cleanly(
        tmp_path: Path, make_engine, make_writer) -> None:
    path = tmp_path / "ck"
    old = _state(seed=5)
    save(old, path, make_writer())
    slow = SlowArena(fail=MemoryError("cannot map the snapshot cache (injected)"))
    engine = make_engine(make_arena=slow, **ENGINE)
    resp = _async_save(_state(seed=6), path, engine, overwrite=True)
    assert slow.started.wait(TIMEOUT)
    engine.saves.wait_for_staging()
    assert engine.arenas.aside_bytes() > 0
    slow.gate.set()
    with raises_in_dcp(CheckpointError, "host cache could not be made"):
        resp.upload_completion.result(TIMEOUT)
    assert engine.arenas.aside_bytes() == 0 and engine.live_leases() == 0
    assert_state_equal(load_into(old, path, engine=engine), old)  # the old one is intact
    slow.fail = None  # the next save makes the cache again
    new = _state(seed=7)
    _async_save(new, path, engine, overwrite=True).upload_completion.result(TIMEOUT)
    assert_state_equal(load_into(new, path, engine=engine), new)


def test_close_while_the_cache_is_being_made(tmp_path: Path) -> None:
    slow = SlowArena()
    engine = Engine(make_arena=slow, **ENGINE)
    resp = _async_save(_state(), tmp_path / "ck", engine)
    assert slow.started.wait(TIMEOUT)
    engine.saves.wait_for_staging()
    closer = threading.Thread(target=engine.close, kwargs={"timeout": 0})
    closer.start()
    with raises_in_dcp(RuntimeError, "engine was closed"):
        resp.upload_completion.result(TIMEOUT)  # the save ends with the cache still blocked
    assert not slow.gate.is_set()
    slow.gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive() and engine.closed
    assert engine.arenas.aside_bytes() == 0 and slow.made and slow.all_freed()
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_stash_copies_cpu_sources_into_pageable_memory() -> None:
    sources = [rand_tensor((1000,), torch.float32, seed=1), torch.empty(0, 4),
               rand_tensor((3 << 20,), torch.uint8, seed=2), rand_tensor((7,), torch.int8)]
    expected = [s.clone() for s in sources]
    aside = stash(sources, None, None)
    for s in sources:
        s.zero_()
    assert list(aside.buffers) == [HOST] and aside.gpu_bytes == 0
    assert aside.host_bytes >= sum(s.numel() * s.element_size() for s in sources)
    for view, want in zip(aside.views, expected, strict=True):
        assert view.is_contiguous()
        assert_state_equal(view, want)
    aside.free()
    assert aside.views == [] and aside.host_bytes == 0


@pytest.mark.parametrize("fixed", [None, "8MiB"], ids=["auto", "fixed"])
def test_no_save_no_cache(fixed: str | None, make_engine) -> None:
    slow = SlowArena()
    engine = make_engine(make_arena=slow, io_backend="threads",
                         **({"host_cache_size": fixed} if fixed else {}))
    assert engine.arenas.snapshot_memory(0) is Memory.ARENA  # an empty state needs no cache
    assert not slow.started.is_set()


def test_saves_queued_behind_a_failed_cache_fail_without_trying_again(
        tmp_path: Path, make_engine) -> None:
    """Every save queued behind a cache that could not be made fails saying so, without
    making it again (one slow failure, not one per save); the next save tries afresh."""
    slow = SlowArena(fail=MemoryError("cannot map the snapshot cache (injected)"))
    engine = make_engine(make_arena=slow, **ENGINE)
    resps = [_async_save(_state(seed), tmp_path / f"ck{seed}", engine) for seed in (1, 2, 3)]
    assert slow.started.wait(TIMEOUT)
    slow.gate.set()
    for resp in resps:
        with raises_in_dcp(CheckpointError, "host cache could not be made"):
            resp.upload_completion.result(TIMEOUT)
    assert slow.tries == 1
    # the arena thread lets a failed move's aside go once the move returns, just after the
    # save's futures fail
    _wait_until(lambda: engine.arenas.aside_bytes() == 0)
    assert engine.live_leases() == 0
    slow.fail = None
    new = _state(seed=9)
    _async_save(new, tmp_path / "ck9", engine).upload_completion.result(TIMEOUT)
    assert slow.tries == 2
    assert_state_equal(load_into(new, tmp_path / "ck9", engine=engine), new)
