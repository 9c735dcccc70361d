"""A save planner that reuses DCP's plans of its previous save when the state keeps its shape.

DCP plans every save afresh: a write item per tensor, the global plan, the metadata (about 15
objects per tensor, alive while the save runs). A training job's memory-tier saves have the
same structure every time, so a :class:`ReusingPlanner` (one per manager, used by one save at
a time) keeps the local plan, the global plans and the metadata of the last state it planned
and hands them out again for a state of the same *structure*: everything DCP's plan depends
on, per flattened value in order (see :func:`structure`). Fewer objects per save means fewer
promoted to the GC's oldest generation, so fewer stop-the-world full collections in training.
The cache is the planner's own (DCP's ``enable_plan_caching`` keeps class-level dicts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

#: A state's structure: one entry per flattened value (``None``: a value DCP must plan).
Structure = tuple[object, ...]
#: What DCP's planner records of a tensor: its write item's properties (a dataclass).
Properties = Callable[[torch.Tensor], object]


def structure(flat: dict[str, Any], paths: dict[str, tuple] | None = None,
              properties: Properties = TensorProperties.create_from_tensor) -> Structure | None:
    """What DCP's default plan of the flattened state ``flat`` depends on, or None if a value
    is one whose plan may depend on more (a tensor subclass other than a DTensor over a plain
    tensor, an object with ``__create_write_items__``). ``paths``: the flattening's mappings
    (each name's path in the nested state, which the metadata's ``planner_data`` holds:
    ``{"a": {"b": t}}`` and ``{"a.b": t}`` flatten to the same name, not the same path).
    ``properties``: what DCP's planner records of a tensor (its ``TensorProperties``).

    A plain tensor's write item holds its shape (its chunk: zero offsets, its sizes) and its
    properties, every field of them (dtype, layout, requires_grad, pinned; strides where torch
    records them: whatever fields this torch has); a DTensor's its global shape, the
    properties of ``to_local()`` (whose requires_grad is the DTensor's with grad enabled, its
    local tensor's without) and the offsets its placements and device mesh give this rank;
    any other value is a bytes item, which holds only its name."""
    out: list[object] = []
    for fqn, value in flat.items():
        name = fqn if paths is None else paths.get(fqn, fqn)
        kind = type(value)
        if kind is torch.Tensor:
            out.append((name, value.shape, _fields(properties(value))))
        elif kind is DTensor and type(local := value._local_tensor) is torch.Tensor:
            out.append((name, value.shape, value.requires_grad, local.shape,
                        _fields(properties(local)), value.placements, value.device_mesh))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            out.append(name)
    return tuple(out)


def _fields(record: object) -> tuple[object, ...]:
    """Every field of the dataclass ``record``, in order (what DCP pickles of it)."""
    return tuple(getattr(record, f.name) for f in dataclasses.fields(record))  # type: ignore[arg-type]


class ReusingPlanner(DefaultSavePlanner):
    """DCP's default save planner, reusing its last plans for a state of the same structure.

    ``planned`` counts the saves planned afresh, ``reused`` those given the last plans. Plans
    are kept only once the global plan is made (a save failing before leaves the last ones);
    :meth:`release` drops the state of the save that ended (the planner keeps no tensor).
    """

    def __init__(self) -> None:
        super().__init__()
        self.planned = self.reused = 0
        self._key: Structure | None = None  # the structure the kept plans are for
        self._kept: tuple[SavePlan, list[SavePlan], Metadata] | None = None
        self._new_key: Structure | None = None  # the structure of the save being planned
        self._hit = False

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        key = structure(self.state_dict, self.mappings if self.flatten_state_dict else None)
        key = None if key is None else (is_coordinator, *key)
        self._hit = key is not None and key == self._key
        if self._hit:  # this save's key and flattening: garbage now, not at the save's end
            key, self.mappings = None, self._kept_plans()[0].planner_data
        self._new_key = key

    def create_local_plan(self) -> SavePlan:
        if not self._hit:
            return super().create_local_plan()
        self.plan = self._kept_plans()[0]
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._hit:
            _local, self.global_plan, metadata = self._kept_plans()
            self.reused += 1
        else:
            self.global_plan, metadata = super().create_global_plan(all_plans)
            self.planned += 1
            self._key, self._kept = None, None
            if self._new_key is not None:
                self._key, self._kept = self._new_key, (self.plan, self.global_plan, metadata)
        # a copy for this save: its commit sets the copy's storage data and storage meta
        self.metadata = dataclasses.replace(metadata)
        return self.global_plan, self.metadata

    def _kept_plans(self) -> tuple[SavePlan, list[SavePlan], Metadata]:
        """The plans kept for the structure of the save being planned (where it is a hit)."""
        assert self._kept is not None  # a hit means a key, kept with its plans
        return self._kept

    def release(self) -> None:
        """Forget the state of the save that ended (its tensors and their flattening)."""
        # DefaultSavePlanner's metadata is unset until a plan; None marks it released
        self.state_dict, self.mappings, self.metadata = {}, {}, None  # type: ignore[assignment]
        self._new_key, self._hit = None, False
