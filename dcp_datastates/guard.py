"""The optimizer pre-step guard: training waits for a snapshot only where it would change it."""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from .engine import Engine, current_default
from .writer import DataStatesWriter


def guard(optimizer: torch.optim.Optimizer,
          source: DataStatesWriter | Engine | None = None) -> RemovableHandle:
    """Make ``optimizer.step()`` wait until the snapshots staged so far have been copied.

    Forward and backward do not change parameters or optimizer state, so a snapshot started by
    ``dcp.async_save`` can copy them while they run; the step is the first place that changes
    them. ``source`` is a writer (its latest snapshot), an engine, or None for the process's
    engine of the moment (every snapshot staged through it: right with a fresh writer per
    save). The hook returns at once when nothing is copying. While the engine's host cache is
    still being made (the first save of a process), it waits only for the snapshot's copy
    aside, not for the cache. Call ``.remove()`` on the handle to take it off.
    """
    if isinstance(source, DataStatesWriter):
        wait = source.wait_for_snapshot
    elif source is not None:
        wait = source.wait_for_snapshots
    else:
        wait = _wait_default
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: wait())


def _wait_default() -> None:
    """Wait for the process's engine of the moment (none made yet: nothing to wait for)."""
    engine = current_default()
    if engine is not None:
        engine.wait_for_snapshots()
