"""The settle thread: the staging thread issues a snapshot's copies and goes on to the next
snapshot's at once; the wait for their end and the hand-out of the staged state dict run on
the engine's settle thread, which ``Engine.close()`` waits for. A lease stays out while a copy
still fills it, and a save ended or failed while it settles is failed, not staged.

Faults come through constructors and inputs only: an engine with a held settle thread, and a
source tensor whose copy waits on a gate."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import MARKS, assert_state_equal, clone_state, load_into, rand_tensor
from helpers.fakes import HeldSettles

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates._cuda.cuda_copy import CudaCopier
from dcp_datastates._format.data_file import LARGE_ITEM_BYTES
from dcp_datastates._jobs.save import SaveState

MiB = 1 << 20
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
    assert not writer.staging_done()
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


# -- leases under a copy ---------------------------------------------------------------------------
class GatedCopy(torch.Tensor):
    """A CPU source whose copy into the snapshot (``copy_``) sets ``started`` and then waits
    for ``gate``: a copy that is still filling its lease while the test acts."""

    started: threading.Event
    gate: threading.Event

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, GatedCopy) for a in args[1:]):
            cls.started.set()
            cls.gate.wait(TIMEOUT)
        return super().__torch_function__(func, types, args, kwargs or {})


def _gated(nbytes: int) -> type[GatedCopy]:
    gated = type("Gated", (GatedCopy,), {"started": threading.Event(),
                                         "gate": threading.Event()})
    return rand_tensor((nbytes,), torch.uint8, seed=5).as_subclass(gated)


def test_a_lease_stays_out_while_a_cpu_copy_still_fills_it() -> None:
    """Ended (the engine closed without waiting) while the staging thread still copies a CPU
    source into its lease, a save must keep the lease until that copy is over: given back at
    once, the next save is handed the same address while the copy goes on writing there."""
    engine = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    source = _gated(2 * MiB)
    writer = DataStatesWriter(engine=engine)
    writer.stage({"warm": rand_tensor((2 * MiB,), torch.uint8, seed=4)}).result(TIMEOUT)
    writer.close()  # the host cache is made; the warm-up snapshot is given back
    assert engine.live_leases() == 0
    staged = writer.stage({"big": source})
    try:
        assert type(source).started.wait(TIMEOUT)
        ender = threading.Thread(target=engine.close, args=(0.0,))
        ender.start()
        assert isinstance(staged.exception(timeout=TIMEOUT), Exception)
        assert engine.live_leases() == 1, "the lease went back while a copy still filled it"
    finally:
        type(source).gate.set()
    ender.join(TIMEOUT)
    assert not ender.is_alive()
    writer.close()
    engine.close()
    assert engine.live_leases() == 0


def test_a_save_ended_before_its_settle_reports_failed_not_staged(held: HeldSettles) -> None:
    """A save ended (its writer closed) while its settle is held is over: the settle that runs
    later must not mark it staged again."""
    engine = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2,
                    settle_pool=held)
    writer = DataStatesWriter(engine=engine)
    staged = writer.stage({"w": rand_tensor((MiB,), torch.uint8, seed=1)})
    job = writer._last
    assert held.wait_handed(1, TIMEOUT)
    closer = threading.Thread(target=engine.close, args=(0.0,))
    closer.start()
    assert isinstance(staged.exception(timeout=TIMEOUT), RuntimeError)
    held.gate.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert job.state is SaveState.FAILED and job.snapshot is None
    assert engine.live_leases() == 0


class FailingWaitCopier(CudaCopier):
    """A real copier whose issued copies' ``wait`` waits, then raises (a failed sync); it
    counts the ready events made by ``record_current`` and not destroyed since."""

    def __init__(self) -> None:
        super().__init__()
        self.live_events = 0

    def record_current(self, devices: set[int]) -> dict[int, object]:
        events = super().record_current(devices)
        self.live_events += len(events)
        return events

    def destroy_events(self, events: dict[int, object]) -> None:
        self.live_events -= len(events)
        CudaCopier.destroy_events(events)

    def issue(self, *args: object, **kwargs: object) -> object:
        issued = super().issue(*args, **kwargs)

        class Failing:
            def wait(self) -> float:
                issued.wait()
                raise RuntimeError("cudaEventSynchronize failed (fake)")
        return Failing()


class FailingWaitEngine(Engine):
    """An engine whose GPU copies fail at their wait (see :class:`FailingWaitCopier`)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        if self.cuda is not None:
            self.cuda = FailingWaitCopier()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_wait_fails_the_save_and_leaks_no_lease_or_event() -> None:
    engine = FailingWaitEngine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    if engine.cuda is None:
        engine.close()
        pytest.skip("needs cuda-python")
    writer = DataStatesWriter(engine=engine)
    try:
        for seed in (1, 2):  # the first waits aside for the cache, the second goes into it
            state = {"w": rand_tensor((2 * MiB,), torch.uint8, seed=seed).cuda()}
            with pytest.raises(RuntimeError, match="fake"):
                writer.stage(state).result(timeout=TIMEOUT)
            engine.saves.wait_for_staging()
        assert engine.cuda.live_events == 0
        assert engine.live_leases() == 0
    finally:
        writer.close()
        engine.close()
