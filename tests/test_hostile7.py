"""Hostile review of eb39cca (a fence is free once the copier has waited for its copies,
``publish(None)``, before the save sets it): may training change a source while a copy still
reads it, or wait for copies that read none?

The fence's own sequences and locking (the GPU tests of the same review, not yet run on a GPU,
wait on branch hostile7).
"""

from __future__ import annotations

import threading

from conftest import MARKS
from test_fence import RecordingWaiter

from dcp_datastates.jobs.fence import CopyFence

pytestmark = MARKS
TIMEOUT = 60


# -- CPU: the fence ---------------------------------------------------------------------------
def test_a_move_issued_before_the_fence_is_set_makes_no_stream_wait() -> None:
    """A snapshot copied aside on the GPU: the copy aside publishes its events and takes
    them back (the sources are free); the arena thread may issue the move into the cache
    (which reads the aside buffers, no source) before the staging thread sets the fence. The
    training's streams must not wait for the move's copies."""
    fence, waiter = CopyFence(), RecordingWaiter()
    fence.publish({0: "aside0"})
    fence.publish(None)  # the copy aside is over: the sources may change
    fence.publish({0: "move0"})  # the move, on the arena thread, before set()
    fence.order(waiter)
    assert fence.passable() and waiter.waited == []
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
    fence, destroyed = CopyFence(), threading.Event()
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
    assert fence.passable() and not fence.is_set()
