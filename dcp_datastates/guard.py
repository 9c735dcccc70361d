"""The optimizer pre-step guard: training waits for a snapshot only where it would change it."""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from .writer import DataStatesWriter


def guard(optimizer: torch.optim.Optimizer, writer: DataStatesWriter) -> RemovableHandle:
    """Make ``optimizer.step()`` wait until ``writer``'s latest snapshot has been copied.

    Forward and backward do not change parameters or optimizer state, so a snapshot started by
    ``dcp.async_save`` can copy them while they run; the step is the first place that changes
    them. The hook returns at once when no snapshot is pending. Call ``.remove()`` on the
    returned handle to take the guard off.
    """
    return optimizer.register_step_pre_hook(lambda opt, args, kwargs: writer.wait_for_snapshot())
