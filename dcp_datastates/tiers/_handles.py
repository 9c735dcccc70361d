"""What a managed save hands back: its handle and its figures."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class SaveFigures:
    """*Figures*: one rank's milestones for one managed save: when each of its stages was
    over (seconds from the ``save`` call), across the tiers.

    Not :class:`~dcp_datastates._stats.SaveStats`, which holds what one storage save did
    (bytes, flush time, I/O backend): a managed save spans a snapshot, the memory tier's
    storage save (with its own ``SaveStats``), a replica and maybe a persist; these are its
    milestones. ``cost_s`` (with ``max_overhead`` only) is what the save cost the training
    thread: its ``save()`` call, the guard's waits for its snapshot and the slowdown of the
    training loop while it was in flight (settled when its memory commit is done). A save
    skipped under
    ``max_overhead`` has figures too, ``skipped`` and nothing else.
    """

    step: int
    bytes: int = 0
    blocked_s: float | None = None
    snapshot_s: float | None = None
    copy_s: float | None = None  # the snapshot's GPU copies, on the GPU (SaveStats.copy_s)
    memory_s: float | None = None
    persist_s: float | None = None
    replicated: bool = False
    cost_s: float | None = None
    skipped: bool = False


@dataclass
class SaveHandle:
    """A managed save in flight: its snapshot (``staged``), its commit into the memory tier
    (``committed``) and, if it is persisted, its copy into the durable tier (``persisted``:
    this rank's part there, and the commit of the step if this rank completed it).

    A save skipped under ``max_overhead`` has a ``reason``: nothing was staged or written, and
    its futures are done (``result()`` returns None: a skip is no failure). ``staging_ordered()``:
    whether the guard no longer waits on the CPU for the snapshot (its copies are over, or
    issued on the GPU, where the training's next work queues behind them; it may still be
    moving from where it waited aside); None: once ``staged`` is done."""

    step: int
    staged: Future
    committed: Future
    persisted: Future | None = None
    reason: str = ""
    staging_ordered: Callable[[], bool] | None = field(default=None, repr=False)
    figures: SaveFigures = field(init=False)
    raised: bool = field(default=False, init=False)  # result() raised the save's error
    #: False for a save that never started (refused at its call): it holds no slot
    started: bool = field(default=True, repr=False)
    #: runs :meth:`result`'s wait (the overhead budget times it: ``Budget.wait``)
    waits: Callable[[Callable[[], None]], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.figures = SaveFigures(self.step, skipped=self.skipped)

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped (``reason`` says why)."""
        return bool(self.reason)

    def result(self, timeout: float | None = None) -> None:
        """Wait for the memory commit (and the persist, if any); raise what failed (then
        ``close()`` does not raise it again). Under ``max_overhead`` the training thread's
        wait is a cost of the saves."""
        def wait() -> None:
            self.committed.result(timeout)
            if self.persisted is not None:
                self.persisted.result(timeout)
        try:
            wait() if self.waits is None else self.waits(wait)
        except BaseException as exc:
            self.raised = self.raised or any(
                f is not None and f.done() and not f.cancelled() and f.exception() is exc
                for f in (self.committed, self.persisted))
            raise


def failed_handle(step: int, error: BaseException) -> SaveHandle:
    """The handle of a save that did not start: both futures carry ``error``."""
    failed: Future = Future()
    failed.set_exception(error)
    return SaveHandle(step, failed, failed)


def skipped_handle(step: int, reason: str) -> SaveHandle:
    """The handle of a save skipped for ``reason``: both futures done, with no result."""
    done: Future = Future()
    done.set_result(None)
    return SaveHandle(step, done, done, reason=reason)
