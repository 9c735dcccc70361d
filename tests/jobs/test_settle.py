"""The settle thread: the staging thread issues a snapshot's copies and goes on to the next
snapshot's at once; the wait for their end and the hand-out of the staged state dict run on
the engine's settle thread, which ``Engine.close()`` waits for."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, assert_state_equal, clone_state, load_into, rand_tensor
from fakes import HeldSettles

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates.file_format import LARGE_ITEM_BYTES

TIMEOUT = 60

pytestmark = MARKS


def _state(seed: int) -> dict:
    return {
        "large": rand_tensor((LARGE_ITEM_BYTES + 123,), torch.uint8, seed=seed),
        "weights": rand_tensor((64, 33), torch.bfloat16, seed=seed + 1),
        "nested": {"bias": rand_tensor((33,), torch.float32, seed=seed + 2), "step": seed},
    }


def _engine(held: HeldSettles) -> Engine:
    return Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2, settle_pool=held)


def _closing(engine: Engine, timeout: float) -> threading.Thread:
    closer = threading.Thread(target=engine.close, args=(timeout,), name="closer")
    closer.start()
    closer.join(0.2)
    return closer


def test_the_next_snapshot_is_issued_while_the_previous_one_settles(
        tmp_path: Path, held: HeldSettles) -> None:
    engine = _engine(held)
    writer = DataStatesWriter(engine=engine)
    states = [_state(seed) for seed in (10, 20)]
    expected = [clone_state(s) for s in states]
    responses = [dcp.async_save(s, checkpoint_id=tmp_path / f"c{i}", storage_writer=writer,
                                no_dist=True) for i, s in enumerate(states)]
    # both snapshots' copies are issued while the first one's settle is held
    assert held.wait_handed(2, TIMEOUT)
    assert not any(r.staging_completion.done() for r in responses)
    assert not writer.snapshot_copied()
    closer = _closing(engine, TIMEOUT)
    assert closer.is_alive(), "close() returned with snapshots still settling"
    held.gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    for i, response in enumerate(responses):
        response.upload_completion.result(timeout=TIMEOUT)
        assert_state_equal(load_into(expected[i], tmp_path / f"c{i}"), expected[i])
    assert engine.live_leases() == 0


def test_close_waits_for_the_settles_of_saves_it_ends(held: HeldSettles) -> None:
    """A close that cannot wait for the saves ends them, but frees nothing (the cache, the
    streams) until the copies handed to the settle thread are over."""
    engine = _engine(held)
    writer = DataStatesWriter(engine=engine)
    staged = [writer.stage(_state(seed)) for seed in (1, 2)]
    assert held.wait_handed(2, TIMEOUT)
    closer = _closing(engine, 0.0)
    assert closer.is_alive(), "close() did not wait for the settle thread"
    held.gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    for future in staged:
        with pytest.raises(RuntimeError, match="engine was closed"):
            future.result(timeout=TIMEOUT)
    assert engine.live_leases() == 0


def test_a_save_ended_while_its_copies_run_gives_its_lease_back_after_them(
        held: HeldSettles) -> None:
    """Ended while its copies are in flight (the engine closing, DCP abandoning the save), a
    save keeps its lease until they are waited for: the next snapshot must not be laid over
    memory that a copy still fills."""
    engine = _engine(held)
    writer = DataStatesWriter(engine=engine)
    staged = [writer.stage(_state(seed)) for seed in (3, 4)]
    assert held.wait_handed(2, TIMEOUT)
    closer = _closing(engine, 0.0)
    for future in staged:  # ended by the close
        assert isinstance(future.exception(timeout=TIMEOUT), RuntimeError)
    assert engine.live_leases() == 2, "a lease went back while copies into it were in flight"
    held.gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive() and engine.live_leases() == 0


def test_values_other_than_tensors_are_saved_as_they_were_at_the_call(
        tmp_path: Path, held: HeldSettles) -> None:
    """A value DCP saves as a bytes item (not a dict or list, so kept whole) changed in place by
    the loop once ``async_save`` returned, while the snapshot still settles: the checkpoint
    holds it as it was at the call."""
    engine = _engine(held)
    writer = DataStatesWriter(engine=engine)
    seen, raw = {1, 2, 3}, bytearray(b"step 7")
    state = {**_state(30), "seen": seen, "raw": raw, "both": [seen, raw]}
    expected = {**clone_state(_state(30)), "seen": {1, 2, 3}, "raw": bytearray(b"step 7"),
                "both": [{1, 2, 3}, bytearray(b"step 7")]}
    response = dcp.async_save(state, checkpoint_id=tmp_path / "ck", storage_writer=writer,
                              no_dist=True)
    assert held.wait_handed(1, TIMEOUT)
    seen.add(4)  # the training loop goes on while the snapshot settles
    raw[:] = b"step 8"
    held.gate.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert_state_equal(load_into(expected, tmp_path / "ck"), expected)
    engine.close()
