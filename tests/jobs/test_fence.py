"""StagingFence: when training may change a snapshot's sources. The guard's wait goes to the GPU
once a snapshot's copies are issued, and stays on the CPU otherwise (no events, events taken
back, no CUDA); a fence is free once the copier has waited for its copies (``publish(None)``),
before the save sets it (by success or failure).

CPU: the fence's own sequences and locking. GPU: the copier publishes None only once the
copies are over, never on a failed issue, and a snapshot's move from aside issued before the
staging thread sets the fence makes no training stream wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from helpers import MARKS, rand_tensor
from helpers.fakes import HeldSettles

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates._cuda import cuda_copy
from dcp_datastates._cuda.cuda_copy import CudaCopier
from dcp_datastates._jobs.fence import StagingFence

pytestmark = MARKS
MiB = 1 << 20
TIMEOUT = 60


# -- CPU: the fence ---------------------------------------------------------------------------
class RecordingWaiter:
    """Stands in for the CUDA copier: records the events streams were made to wait for."""

    def __init__(self) -> None:
        self.waited: list[dict[int, object]] = []

    def wait_current(self, events: dict[int, object]) -> None:
        self.waited.append(dict(events))


def ordered_in_thread(fence: StagingFence, waiter: RecordingWaiter | None) -> threading.Thread:
    thread = threading.Thread(target=fence.order, args=(waiter,), daemon=True)
    thread.start()
    return thread


def test_published_events_make_the_streams_wait_and_return_at_once() -> None:
    fence, waiter = StagingFence(), RecordingWaiter()
    fence.publish({0: "event0", 1: "event1"})
    fence.order(waiter)  # returns although the copies are not over
    assert not fence.is_set()
    assert waiter.waited == [{0: "event0", 1: "event1"}]


def test_order_waits_until_the_copies_are_issued() -> None:
    fence, waiter = StagingFence(), RecordingWaiter()
    thread = ordered_in_thread(fence, waiter)
    thread.join(0.2)
    assert thread.is_alive() and waiter.waited == []
    fence.publish({0: "event0"})
    thread.join(5)
    assert not thread.is_alive()
    assert waiter.waited == [{0: "event0"}]


def test_without_a_waiter_order_waits_for_the_copies() -> None:
    fence = StagingFence()
    fence.publish({0: "event0"})
    thread = ordered_in_thread(fence, None)
    thread.join(0.2)
    assert thread.is_alive()
    fence.set()
    thread.join(5)
    assert not thread.is_alive() and fence.wait(0)


def test_a_set_fence_passes_at_once() -> None:
    fence, waiter = StagingFence(), RecordingWaiter()
    fence.set()
    fence.order(waiter)
    assert waiter.waited == [] and fence.wait(0)


def test_copies_issued_after_the_fence_is_set_make_no_stream_wait() -> None:
    """A snapshot copied aside sets its fence; its later move (which reads no source)
    publishes events too: the training's streams must not wait for them."""
    fence, waiter = StagingFence(), RecordingWaiter()
    fence.set()
    fence.publish({0: "move0"})
    fence.order(waiter)
    assert waiter.waited == []
    fence.publish(None)  # the move's copies done: taken back as usual
    fence.order(waiter)
    assert waiter.waited == []


def test_passable_once_issued_and_free_once_the_copier_has_waited() -> None:
    """The copier takes the events back (``publish(None)``) once it has waited for the copies:
    the sources are free from then on, before the save sets its fence (the budget must not
    skip a save as "still copying" while the staged dict is handed out)."""
    fence, waiter = StagingFence(), RecordingWaiter()
    assert not fence.ordered()
    fence.publish({0: "event0"})
    assert fence.ordered()  # the guard would return at once
    fence.publish(None)
    assert fence.ordered()
    fence.order(waiter)  # returns: nothing is left to wait for, on the GPU or the CPU
    fence.order(None)
    assert waiter.waited == [] and not fence.wait(0)  # set once the snapshot is handed out
    fence.set()
    assert fence.ordered() and fence.wait(0)


def test_a_guard_waiting_on_the_cpu_passes_once_the_copies_end() -> None:
    """A guard without a stream waiter waits on the CPU while the copies run, and passes once
    the copier has waited for them (events taken back), before the save sets its fence (by
    success or failure)."""
    fence = StagingFence()
    fence.publish({0: "event"})
    waiter = threading.Thread(target=fence.order, args=(None,), daemon=True)
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()
    fence.publish(None)
    waiter.join(5)
    assert not waiter.is_alive() and not fence.wait(0)


def test_a_move_issued_before_the_fence_is_set_makes_no_stream_wait() -> None:
    """A snapshot copied aside on the GPU: the copy aside publishes its events and takes
    them back (the sources are free); the arena thread may issue the move into the cache
    (which reads the aside buffers, no source) before the staging thread sets the fence. The
    training's streams must not wait for the move's copies."""
    fence, waiter = StagingFence(), RecordingWaiter()
    fence.publish({0: "aside0"})
    fence.publish(None)  # the copy aside is over: the sources may change
    fence.publish({0: "move0"})  # the move, on the arena thread, before set()
    fence.order(waiter)
    assert fence.ordered() and waiter.waited == []
    fence.set()
    fence.order(waiter)
    fence.publish(None)  # the move's copies over
    assert waiter.waited == []


class SlowWaiter:
    """A stream waiter that looks for ``destroyed`` during ``wait_current`` (0.5 s): the
    events it was given must live until it returns."""

    def __init__(self, destroyed: threading.Event) -> None:
        self.destroyed = destroyed
        self.entered = threading.Event()
        self.saw_destroyed: list[bool] = []

    def wait_current(self, events: dict[int, object]) -> None:
        self.entered.set()
        self.saw_destroyed.append(self.destroyed.wait(0.5))


def test_events_are_not_taken_back_while_a_guard_makes_a_stream_wait_for_them() -> None:
    """``IssuedCopies.wait`` publishes None, then destroys the events: that publish must wait
    for a guard that is making its streams wait for them (else cudaStreamWaitEvent gets a
    destroyed event)."""
    fence, destroyed = StagingFence(), threading.Event()
    waiter = SlowWaiter(destroyed)
    fence.publish({0: "event0"})
    guard = threading.Thread(target=fence.order, args=(waiter,), daemon=True)
    guard.start()
    assert waiter.entered.wait(TIMEOUT)

    def copier_done() -> None:
        fence.publish(None)
        destroyed.set()  # what IssuedCopies.wait does next
    copier = threading.Thread(target=copier_done, daemon=True)
    copier.start()
    guard.join(TIMEOUT)
    copier.join(TIMEOUT)
    assert not guard.is_alive() and not copier.is_alive()
    assert waiter.saw_destroyed == [False]
    assert fence.ordered() and not fence.is_set()


# -- GPU: the copier --------------------------------------------------------------------------
def _delayed_copy(copier: CudaCopier, nbytes: int, device: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, object]]:
    """A GPU source, its bytes, a pinned destination and a ready event behind ~0.5 s of GPU
    work (the copy waits for it)."""
    want = rand_tensor((nbytes,), torch.uint8, seed=7)
    src = want.cuda(device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda._sleep(500_000_000)
    return src, want, dst, copier.record_current({device})


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_copy.available(), reason="needs a CUDA GPU and cuda-python")
def test_the_copier_takes_the_events_back_only_once_the_copies_are_over() -> None:
    copier = CudaCopier()
    try:
        src, want, dst, ready = _delayed_copy(copier, 64 * MiB)
        fence, over_at_publish = StagingFence(), []

        def issued(events: dict[int, object] | None) -> None:
            if events is None:  # the sources are free from here: the copies must be over
                over_at_publish.append(torch.equal(dst, want))
            fence.publish(events)
        copies = copier.issue([(0, dst.data_ptr(), src.data_ptr(), src.numel())], "d2h",
                              after=ready, issued=issued)
        copier.destroy_events(ready)
        assert fence.ordered() and not over_at_publish
        copies.wait()
        assert over_at_publish == [True]
    finally:
        torch.cuda.synchronize()
        copier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_copy.available(), reason="needs a CUDA GPU and cuda-python")
def test_a_failed_issue_waits_for_what_it_issued_and_leaves_the_fence_closed() -> None:
    """The second device's issue fails (no such device) after the first device's copy was
    issued: the copy is over when ``issue`` raises, and the fence was never published to (the
    guard keeps waiting until the save's end sets it)."""
    copier = CudaCopier()
    try:
        src, want, dst, ready = _delayed_copy(copier, 16 * MiB)
        other = torch.zeros(1, dtype=torch.uint8, pin_memory=True)
        fence = StagingFence()
        missing = torch.cuda.device_count()
        with pytest.raises(RuntimeError, match="cudaSetDevice"):
            copier.issue([(0, dst.data_ptr(), src.data_ptr(), src.numel()),
                          (missing, other.data_ptr(), src.data_ptr(), 1)], "d2h",
                         after=ready, issued=fence.publish)
        cuda_copy.cudart.cudaGetLastError()  # clear the failed cudaSetDevice's error
        assert torch.equal(dst, want)  # waited for before the raise
        assert not fence.ordered()
        copier.destroy_events(ready)
    finally:
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        copier.close()


# -- GPU: a snapshot's move from aside --------------------------------------------------------
class RecordingCopier(CudaCopier):
    """A real copier that records the events the training's streams were made to wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[set[int]] = []

    def wait_current(self, events: dict[int, object]) -> None:
        self.waited.append(set(events))
        CudaCopier.wait_current(events)


class EagerMoveEngine(Engine):
    """An engine whose arena thread wins the race against the staging thread: the move of a
    snapshot copied aside issues its copies before ``arenas.move_aside`` returns (before the save
    sets its fence). Its copier records the guard's stream waits."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.cuda = RecordingCopier()
        move_aside = self.arenas.move_aside

        def eager(aside: object, fn: Callable, *args: object, when: Callable | None = None,
                  failed: Callable | None = None) -> None:
            moved = threading.Event()

            def move(*margs: object) -> None:
                try:
                    fn(*margs)
                finally:
                    moved.set()
            move_aside(aside, move, *args, when=when, failed=failed)
            assert moved.wait(TIMEOUT), "the move never ran"

        self.arenas.move_aside = eager  # type: ignore[method-assign,assignment]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_copy.available(), reason="needs a CUDA GPU and cuda-python")
def test_a_move_from_aside_issued_before_the_fence_is_set_holds_no_training_stream(
        held: HeldSettles) -> None:
    """The first save of an engine is copied aside on the GPU while the cache is made; its
    move into the cache is issued (and its settle held) before the staging thread sets the
    fence: the guard then returns without making the streams wait for the move, and the
    checkpoint holds the values from before the step."""
    engine = EagerMoveEngine(host_cache_size="64MiB", io_backend="threads", io_workers=2,
                             settle_pool=held)
    writer = DataStatesWriter(engine=engine)
    try:
        want = rand_tensor((8 * MiB,), torch.uint8, seed=3)
        source = want.cuda()
        staged = writer.stage({"w": source})
        engine.saves.wait_for_staging()  # the fence is set: the copy aside is over
        assert held.wait_handed(1, TIMEOUT)  # the move's copies are issued, their settle held
        engine.order_after_staging()
        assert engine.cuda.waited == [], "the guard waits for the move, which reads no source"
        source.zero_()
        held.gate.set()
        assert torch.equal(staged.result(TIMEOUT)["w"], want)
    finally:
        held.gate.set()
        writer.close()
        engine.close()
