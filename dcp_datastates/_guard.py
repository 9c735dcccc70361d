"""The optimizer pre-step guard: the step runs after the snapshot copies it would change."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ._engine import current_default
from ._writer import DataStatesWriter

__all__ = ["SnapshotSource", "guard"]


class SnapshotSource(Protocol):
    """What orders work after the snapshots staged so far: an :class:`Engine` or a
    ``CheckpointManager``."""

    def order_after_staging(self) -> None: ...


def guard(optimizer: torch.optim.Optimizer,
          source: DataStatesWriter | SnapshotSource | None = None) -> RemovableHandle:
    """Make ``optimizer.step()`` run after the snapshots staged so far have been copied.

    Forward and backward do not change parameters or optimizer state, so a snapshot started by
    ``dcp.async_save`` can copy them while they run; the step is the first place that changes
    them. The copies of GPU tensors run on a side stream: once they are issued, the step's
    kernels are queued behind them on the GPU and the hook returns (the training thread goes
    on); other copies (CPU tensors, no cuda-python) are waited for here. ``source`` is a writer
    (its latest snapshot), an engine or a ``CheckpointManager``, or None for the process's
    engine of the moment (every snapshot staged through it: right with a fresh writer per
    save). While the engine's host cache is still being made (the first save of a process),
    only the snapshot's copy aside is waited for, not the cache. Call ``.remove()`` on the
    handle to take it off.
    """
    order = source.order_after_staging if source is not None else _order_default
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: order())


def _order_default() -> None:
    """Order after the process's engine of the moment (none made yet: nothing to wait for)."""
    engine = current_default()
    if engine is not None:
        engine.order_after_staging()
