"""A manager its owner did not close, finished by its engine's ``close()``: at interpreter exit
(the engine's exit hook), or when the engine is closed first.

With one rank it is closed as ``close()`` would close it: its saves finish and the newest step
is persisted. With several, no rank may wait for the others there (one may be exiting on an
error while the others train, or the process group may be gone): its saves in flight finish,
on this rank alone, and a step left in the memory tier only is named in a warning
(:func:`warn_unpersisted`), with the two ways to persist it (the next manager on the same
directories does it at start). The manager hands this module the function that finishes it
(``CheckpointManager._finish_unclosed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ._steps import committed_steps

if TYPE_CHECKING:
    from .._engine import Engine

log = logging.getLogger("dcp_datastates")


class Unclosed:
    """The engine's :class:`~dcp_datastates._engine.Work` for one manager until it is closed:
    ``finish`` finishes the manager at the engine's close."""

    def __init__(self, engine: Engine, finish: Callable[[], None]) -> None:
        self.engine, self._finish = engine, finish

    @classmethod
    def track(cls, engine: Engine, finish: Callable[[], None]) -> Unclosed:
        """Have ``engine`` call ``finish`` at its close, unless :meth:`untrack` first."""
        work = cls(engine, finish)
        engine.track(work)
        return work

    def untrack(self) -> None:
        self.engine.untrack(self)

    def wait(self, deadline: float) -> None:
        """Finish the manager (it is over then; ``deadline`` does not stop a save)."""
        self._finish()

    def end(self) -> None:
        """Nothing is left: :meth:`wait` finished the manager."""


def warn_unpersisted(memory: Path, durable: Path | None) -> None:
    """Warn where the newest step committed in the memory tier ``memory`` is not in the
    durable tier ``durable`` (None: the manager persists nothing)."""
    steps = committed_steps(memory)
    if durable is None or not steps:
        return
    persisted = committed_steps(durable)
    if persisted and persisted[-1] >= steps[-1]:
        return
    log.warning(
        "dcp_datastates: CheckpointManager was not closed: step %d is in the memory tier "
        "%s only, not in %s (close() persists it; without it, at exit, no rank waits for "
        "the others). The next CheckpointManager on %s persists it when made, or run "
        "`python -m dcp_datastates persist <memory tiers> %s`", steps[-1],
        memory, durable, durable, durable)
