"""CopyFence: the guard's wait goes to the GPU once a snapshot's copies are issued, and stays on
the CPU otherwise (no events, events taken back, no CUDA)."""

from __future__ import annotations

import threading

from dcp_datastates.jobs.fence import CopyFence


class RecordingWaiter:
    """Stands in for the CUDA copier: records the events streams were made to wait for."""

    def __init__(self) -> None:
        self.waited: list[dict[int, object]] = []

    def wait_current(self, events: dict[int, object]) -> None:
        self.waited.append(dict(events))


def ordered_in_thread(fence: CopyFence, waiter: RecordingWaiter | None) -> threading.Thread:
    thread = threading.Thread(target=fence.order, args=(waiter,), daemon=True)
    thread.start()
    return thread


def test_published_events_make_the_streams_wait_and_return_at_once() -> None:
    fence, waiter = CopyFence(), RecordingWaiter()
    fence.publish({0: "event0", 1: "event1"})
    fence.order(waiter)  # returns although the copies are not over
    assert not fence.is_set()
    assert waiter.waited == [{0: "event0", 1: "event1"}]


def test_order_waits_until_the_copies_are_issued() -> None:
    fence, waiter = CopyFence(), RecordingWaiter()
    thread = ordered_in_thread(fence, waiter)
    thread.join(0.2)
    assert thread.is_alive() and waiter.waited == []
    fence.publish({0: "event0"})
    thread.join(5)
    assert not thread.is_alive()
    assert waiter.waited == [{0: "event0"}]


def test_without_a_waiter_order_waits_for_the_copies() -> None:
    fence = CopyFence()
    fence.publish({0: "event0"})
    thread = ordered_in_thread(fence, None)
    thread.join(0.2)
    assert thread.is_alive()
    fence.set()
    thread.join(5)
    assert not thread.is_alive() and fence.wait(0)


def test_a_set_fence_passes_at_once() -> None:
    fence, waiter = CopyFence(), RecordingWaiter()
    fence.set()
    fence.order(waiter)
    assert waiter.waited == [] and fence.wait(0)


def test_copies_issued_after_the_fence_is_set_make_no_stream_wait() -> None:
    """A snapshot copied aside sets its fence; its later move (which reads no source)
    publishes events too: the training's streams must not wait for them."""
    fence, waiter = CopyFence(), RecordingWaiter()
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
    fence, waiter = CopyFence(), RecordingWaiter()
    assert not fence.passable()
    fence.publish({0: "event0"})
    assert fence.passable()  # the guard would return at once
    fence.publish(None)
    assert fence.passable()
    fence.order(waiter)  # returns: nothing is left to wait for, on the GPU or the CPU
    fence.order(None)
    assert waiter.waited == [] and not fence.wait(0)  # set once the snapshot is handed out
    fence.set()
    assert fence.passable() and fence.wait(0)
