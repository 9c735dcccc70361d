"""DCP's one-process load, of a rank's memory-tier checkpoints (and of a whole checkpoint, for
the command line's ``export --format torch``).

A memory-tier checkpoint is one rank's own (ranks commit at their own pace, with no collective;
it is saved by an explicit save job, ``_jobs/explicit.py``), so DCP loads it with
``no_dist=True``. DCP's public ``load`` then warns at every call ("torch.distributed is
disabled, unavailable or uninitialized, assuming the intent is to ... in a single process"): it
cannot tell a one-process call made on purpose from a forgotten ``init_process_group``. The
functions here run the steps that call runs after that warning (DCP's one-process
``_load_state_dict``, with the storage pointed at the checkpoint and ``Stateful`` values given
as their state dicts), so the manager neither emits that warning nor touches the process's
warning filters.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .._reader import DataStatesReader
from ..errors import CheckpointError


def plain(state: dict) -> dict:
    """``state`` with its ``Stateful`` values replaced by their state dicts (as DCP does);
    TypeError where ``state`` is no dict (a model passed as it is)."""
    if not isinstance(state, dict):
        raise TypeError(f"the state must be a dict of state dicts and Stateful values, as "
                        f"dcp.save takes ({{'model': model.state_dict(), ...}}), got a "
                        f"{type(state).__name__}")
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def load(state: dict, directory: Path, reader: DataStatesReader) -> None:
    """Load the checkpoint in ``directory`` into ``state`` in place, as
    ``dcp.load(..., no_dist=True)`` does: ``Stateful`` values load their state dicts, others
    are replaced. A checkpoint that is one rank's part (``reader.rank_part``) must hold every
    element of this rank's tensors (:class:`_CoveringPlanner`)."""
    with _storage_errors():  # a checksum mismatch, a short file
        reader.reset(str(directory))
        loaded = plain(state)
        _load_state_dict(state_dict=loaded, storage_reader=reader, no_dist=True,
                         planner=_CoveringPlanner(directory) if reader.rank_part else None)
    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]


def load_whole(directory: Path, reader: DataStatesReader) -> tuple[dict, dict[str, str]]:
    """The whole state dict of the checkpoint in ``directory``, made from its metadata and
    nested as it was saved (DCP's ``_EmptyStateDictLoadPlanner``, as DCP's
    ``dcp_to_torch_save`` loads), in CPU memory, running no pickled code: bytes items are
    unpickled by ``torch.load(weights_only=True)``; one it refuses stays its pickle's bytes.
    Also returns those items: fqn -> why it was refused."""
    state: dict = {}
    planner = _WeightsOnlyPlanner()
    with _storage_errors():
        reader.reset(str(directory))
        _load_state_dict(state_dict=state, storage_reader=reader, no_dist=True,
                         planner=planner)
    return state, planner.refused


class _CoveringPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing a plan that leaves an element of a tensor unread. One
    rank's part of a checkpoint (a memory-tier step) holds the chunks that rank saved: a state
    sharded otherwise (another layout, another number of ranks) needs chunks of other ranks,
    which DCP's planner would leave as they are, silently. (Its local plan is DCP's own, so
    :func:`~..mismatch.planner_of` still tells of a state dict of another model.)"""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        read: Counter[str] = Counter()
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                read[item.dest_index.fqn] += math.prod(item.lengths)
        for fqn, value in self.state_dict.items():
            if not isinstance(value, torch.Tensor):
                continue
            needed = (value.to_local() if isinstance(value, DTensor) else value).numel()
            if read[fqn] != needed:
                raise CheckpointError(
                    f"{self.directory}: item {fqn!r}: this rank's part of the checkpoint holds "
                    f"{read[fqn]} of the {needed} elements this rank's state needs (saved "
                    f"sharded otherwise: another layout or number of ranks)")
        return plan


class _WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's whole-state planner whose bytes items are unpickled with ``weights_only=True``
    (DCP's own runs any pickle); an item it refuses is kept as its bytes, in ``refused``."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: dict[str, str] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            item: object = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refused[fqn] = _first_line(exc)
            item = value.getvalue()
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def _first_line(exc: Exception) -> str:
    """The sentence of ``torch.load``'s refusal that says what it refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = next((ln for ln in lines if "WeightsUnpickler error" in ln),
                lines[0] if lines else type(exc).__name__)
    return line.split(". ")[0].rstrip(".")


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """Raise what a storage step raised (an OSError, a CheckpointError) rather than DCP's
    ``CheckpointException`` that wraps it, which ``except Exception`` does not catch."""
    try:
        yield
    except CheckpointException as exc:
        inner = [e for e, _trace in exc.failures.values() if isinstance(e, Exception)]
        if inner:
            raise inner[0] from exc
        raise
