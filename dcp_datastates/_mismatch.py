"""A state dict that does not fit the checkpoint it is loaded from, said plainly.

DCP's default planner stops at the first key it cannot load ("Missing key in checkpoint
state_dict: x."); loading a checkpoint of another model deserves the whole picture: the first
items that differ, what the checkpoint holds and what the state dict expects, and where.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import StateDictMismatchError

__all__ = ["SHOWN", "check_state_matches", "planner_of"]

#: Items named in the error; the rest are counted.
SHOWN = 5


def check_state_matches(state: Mapping[str, object], metadata: Metadata,
                        directory: Path | None, strict: bool = True) -> None:
    """Raise :class:`StateDictMismatchError` where DCP's default planner would refuse to load
    the flat ``state`` (fqn -> value) from a checkpoint described by ``metadata``: an item
    missing (``strict``, no partial load) or a tensor of another shape. Dtypes may differ
    (the load converts), as in DCP."""
    stored = metadata.state_dict_metadata
    differ = []
    for fqn, value in state.items():
        held = stored.get(fqn)
        if held is None:
            if strict:
                differ.append(f"{fqn!r}: not in the checkpoint (the state dict expects "
                              f"{_expected(value)})")
        elif (isinstance(held, TensorStorageMetadata)
              and (size := getattr(value, "size", None)) is not None and held.size != size()):
            differ.append(f"{fqn!r}: the checkpoint holds {_held(held)}, the state dict expects "
                          f"{_expected(value)}")
    if not differ:
        return
    unasked = [fqn for fqn in stored if fqn not in state]
    lines = [f"the state dict does not match checkpoint {directory}: {len(differ)} of its "
             f"{len(state)} items differ", *_first(differ)]
    if unasked:
        lines.append(f"the checkpoint holds {len(unasked)} items the state dict does not ask "
                     f"for: {', '.join(map(repr, unasked[:SHOWN]))}"
                     f"{_more(len(unasked))} (a checkpoint of another model?)")
    raise StateDictMismatchError("\n  ".join(lines))


def planner_of(planner: object) -> DefaultLoadPlanner | None:
    """``planner`` (DCP's load step's, read by the reader's ``set_up_storage_reader``) where
    it is DCP's default one and holds the state dict; None where the step plans with a planner
    of its own (which may map keys otherwise) or looks different."""
    if (isinstance(planner, DefaultLoadPlanner)
            and type(planner).create_local_plan is DefaultLoadPlanner.create_local_plan
            and isinstance(getattr(planner, "state_dict", None), Mapping)):
        return planner
    return None


def _held(held: TensorStorageMetadata) -> str:
    return f"shape {tuple(held.size)} {held.properties.dtype}"


def _expected(value: object) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return f"a value of type {type(value).__name__}"
    return f"shape {tuple(shape)} {dtype}"


def _first(items: list[str]) -> list[str]:
    return items[:SHOWN] + ([f"... and {len(items) - SHOWN} more"] if len(items) > SHOWN else [])


def _more(count: int) -> str:
    return f" and {count - SHOWN} more" if count > SHOWN else ""
