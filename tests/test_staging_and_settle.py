"""Copies issued on the staging thread and waited for on the settle thread, and a
memory-tier save that would go aside to pageable memory waiting for its slot: leases going
back under a copy, staged state delivered early, a fence that is not passable once its
copies are over, and saves ended or closed while they wait.

Faults come through constructors and inputs only: an engine with a held settle thread, an
engine that finds no GPU room, and a source tensor whose copy waits on a gate.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import MARKS, Tiers, rand_tensor
from fakes import HeldSettles, NoGpuRoomEngine
from test_tiers import HoldWrites, make_state

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine
from dcp_datastates.cuda_copy import CudaCopier
from dcp_datastates.io import ThreadPoolBackend
from dcp_datastates.jobs.save import SaveState

pytestmark = MARKS
MiB = 1 << 20
TIMEOUT = 60


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


# -- leases under a copy ---------------------------------------------------------------------------
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
            engine.wait_for_snapshots()
        assert engine.cuda.live_events == 0
        assert engine.live_leases() == 0
    finally:
        writer.close()
        engine.close()


# -- a save waiting for its slot -------------------------------------------------------------------
def test_a_save_waiting_for_its_slot_holds_up_another_managers_saves_and_says_so(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """Two managers on one engine share its staging thread: while manager A's save waits
    there for a slot (A's commits held), manager B's save cannot even start its snapshot,
    for as long as A's wait lasts (unbounded: until A's slot comes). The wait's log line
    says so; once A's slot comes both go on and nothing stays leased."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    engine = NoGpuRoomEngine(io_backend=hold, host_cache_size="8MiB", io_workers=2)
    a = CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None, engine=engine)
    b = CheckpointManager(memory_dir=tiers.scratch, keep_memory=1, persist=None, engine=engine)
    try:
        try:
            handles = [a.save(s, make_state(s, big=MiB + 3)) for s in range(1, 6)]
            waiting = _wait_for_log(caplog, "the snapshot waits for it")
            assert "saves staged after it wait too" in waiting
            other = b.save(1, make_state(7))
            with pytest.raises(TimeoutError):  # held behind A's wait, not failed
                other.staged.result(timeout=0.5)
        finally:
            hold.gate.set()
        other.result(timeout=TIMEOUT)
        for handle in handles:
            handle.result(timeout=TIMEOUT)
    finally:
        hold.gate.set()
        a.close()
        b.close()
        leases = engine.live_leases()
        engine.close()
    assert leases == 0


def _wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> str:
    stop = threading.Event()
    for _ in range(TIMEOUT * 100):
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        stop.wait(0.01)
    raise AssertionError(f"never logged: {text}")
