"""A manager its owner did not close, finished by its engine's ``close()``: at interpreter exit
(the engine's exit hook), or when the engine is closed first.

With one rank it is closed as ``close()`` would close it: its saves finish and the newest step
is persisted. With several, no rank may wait for the others there (one may be exiting on an
error while the others train, or the process group may be gone): its saves in flight finish,
on this rank alone, and a step left in the memory tier only is named in a warning, with the
two ways to persist it (the next manager on the same directories does it at start).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .steps import committed_steps

if TYPE_CHECKING:
    from ..engine import Engine
    from .manager import CheckpointManager

log = logging.getLogger("dcp_datastates")


class Unclosed:
    """The engine's :class:`~dcp_datastates.engine.Work` for one manager until it is closed."""

    def __init__(self, manager: CheckpointManager, engine: Engine) -> None:
        self.manager, self.engine = manager, engine

    @classmethod
    def track(cls, manager: CheckpointManager) -> Unclosed:
        """Have ``manager``'s engine finish it at its close, unless :meth:`untrack` first."""
        work = cls(manager, manager.engine)
        work.engine.track(work)
        return work

    def untrack(self) -> None:
        self.engine.untrack(self)

    def wait(self, deadline: float) -> None:
        """Finish the manager (it is over then; ``deadline`` does not stop a save)."""
        manager = self.manager
        if manager._closed:
            return
        if manager.world == 1:
            try:
                manager.close()
            except Exception as exc:  # noqa: BLE001 - no caller to raise it to
                log.warning("dcp_datastates: CheckpointManager of %s was not closed; closing "
                            "it at exit failed: %s", manager.memory, exc)
            return
        manager._closed = True
        try:
            manager._drain()
        finally:
            manager._stop()
        for error in manager._reports.take():
            log.warning("dcp_datastates: a save of the unclosed CheckpointManager of %s "
                        "failed: %s", manager.memory, error)
        self._warn_unpersisted()

    def end(self) -> None:
        """Nothing is left: :meth:`wait` finished the manager."""

    def _warn_unpersisted(self) -> None:
        manager = self.manager
        memory = committed_steps(manager.memory)
        if manager.persist_policy is None or manager.durable is None or not memory:
            return  # (persist_policy is None where durable is)
        durable = committed_steps(manager.durable)
        if durable and durable[-1] >= memory[-1]:
            return
        log.warning(
            "dcp_datastates: CheckpointManager was not closed: step %d is in the memory tier "
            "%s only, not in %s (close() persists it; without it, at exit, no rank waits for "
            "the others). The next CheckpointManager on %s persists it when made, or run "
            "`python -m dcp_datastates persist <memory tiers> %s`", memory[-1],
            manager.memory, manager.durable, manager.durable, manager.durable)
