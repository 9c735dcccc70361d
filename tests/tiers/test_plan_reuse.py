"""A manager's saves reuse DCP's plans of the previous save when the state keeps its structure
(``dcp_datastates/tiers/plans.py``). The reuse is read from the planner the manager's memory
saver owns (``planned`` / ``reused`` counts); every checkpoint must still load bit for bit with
plain ``dcp.load`` and hold the metadata a fresh plan gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, Tiers, assert_state_equal, load_into, rand_tensor
from test_tiers import make_state
from test_tiers_lifecycle import FailFsync, save_through
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_datastates import CheckpointManager, DataStatesReader, Engine
from dcp_datastates.io import ThreadPoolBackend
from dcp_datastates.tiers.plans import ReusingPlanner, structure

pytestmark = MARKS


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def stored_metadata(directory: Path):
    reader = DataStatesReader()
    reader.reset(str(directory))
    return reader.read_metadata()


def fresh_metadata(state: dict):
    """The metadata DCP's default planner gives ``state`` (one process)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    _plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    return metadata


def planner_of(manager: CheckpointManager) -> ReusingPlanner:
    return manager._saver.planner


def check_step(root: Path, step: int, state: dict) -> None:
    """Step ``step`` under ``root`` loads ``state`` bit for bit and holds a fresh plan's
    metadata."""
    directory = root / f"step_{step}"
    assert_state_equal(load_into(state, directory), state)
    stored, fresh = stored_metadata(directory), fresh_metadata(state)
    assert stored.state_dict_metadata == fresh.state_dict_metadata
    assert stored.planner_data == fresh.planner_data


def test_same_structure_is_planned_once(tiers: Tiers, engine: Engine) -> None:
    """Six saves of one structure: one plan, five reuses; each checkpoint loads bit for bit,
    with the metadata of a fresh plan, and the planner keeps no state between saves."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=6, persist=None,
                           engine=engine) as manager:
        states = {step: make_state(step) for step in range(1, 7)}
        for step, state in states.items():
            manager.save(step, state).result(timeout=30)
            manager.wait()
        planner = planner_of(manager)
        assert (planner.planned, planner.reused) == (1, 5)
        assert planner.state_dict == {} and planner.metadata is None
        for step, state in states.items():
            check_step(tiers.memory, step, state)


def changed(state: dict, how: str) -> dict:
    """``state`` with one structural change."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    if how == "shape":
        out["model"]["b"] = rand_tensor((41,), torch.bfloat16, 7)
    elif how == "dtype":
        out["model"]["b"] = rand_tensor((40,), torch.float16, 7)
    elif how == "new key":
        out["model"]["c"] = rand_tensor((3,), torch.int32, 7)
    elif how == "removed key":
        del out["optim"]["exp_avg"]
    elif how == "new value key":
        out["extra"]["more"] = 1
    return out


def test_a_changed_structure_is_planned_again(tiers: Tiers, engine: Engine) -> None:
    """A changed shape, dtype, a new or removed key: planned afresh (and the same structure
    saved twice in a row is reused); each checkpoint loads right with a fresh plan's
    metadata; a non-tensor value's change alone keeps the plan."""
    hows = ["shape", "dtype", "new key", "removed key", "new value key"]
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=20,
                           persist=None, engine=engine) as manager:
        base, saved = make_state(1), {}
        for how in [None, *[h for h in hows for _ in range(2)], None]:
            state = base if how is None else changed(base, how)
            state["extra"]["tag"] = f"save {len(saved)}"  # a value's change: no new plan
            step = len(saved) + 1
            manager.save(step, state).result(timeout=30)
            manager.wait()
            saved[step] = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
        planner = planner_of(manager)
        assert (planner.planned, planner.reused) == (7, 5)  # one reuse per change, none at the end
        for step, state in saved.items():
            check_step(tiers.memory, step, state)


def test_requires_grad_is_part_of_the_structure(tmp_path: Path, make_writer) -> None:
    """With plain ``dcp.save`` (no snapshot: the planner sees the live tensors), a tensor's
    ``requires_grad`` flag changing is planned again and stored as a fresh plan stores it."""
    planner = ReusingPlanner()
    for i, flag in enumerate([False, False, True, True, False]):
        state = {"w": rand_tensor((8, 4), torch.float32, i).requires_grad_(flag), "n": i}
        directory = tmp_path / f"s{i}"
        dcp.save(state, storage_writer=make_writer(directory), planner=planner, no_dist=True)
        planner.release()
        assert stored_metadata(directory).state_dict_metadata == \
            fresh_metadata(state).state_dict_metadata
        assert_state_equal(load_into(state, directory), state)
    assert (planner.planned, planner.reused) == (3, 2)


def test_a_failed_save_does_not_break_the_next(tiers: Tiers) -> None:
    """A save whose data file fails (after its plan was made) fails alone: the planner keeps
    no state of it, the next saves of that structure reuse the plan and load right, and a
    save of a new structure that fails leaves the next one planned right."""
    io = FailFsync(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=io, host_cache_size="8MiB", io_workers=4)
    try:
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=10,
                               persist=None, engine=engine) as manager:
            planner, good = planner_of(manager), {}
            for step in range(1, 7):
                state = make_state(step, big=4096 if step >= 4 else 0)
                io.failing = step in (2, 4)
                if save_through(manager, io, step, state):
                    good[step] = state
                assert planner.state_dict == {} and planner.metadata is None
            io.failing = False
            assert (planner.planned, planner.reused) == (2, 4)
            for step, state in good.items():
                check_step(tiers.memory, step, state)
    finally:
        engine.close()
        io.close()


class Wrapped(torch.Tensor):
    """A tensor subclass: DCP's plan of it may depend on more than its shape."""


class Checkpointable:
    """An object planning its own write items."""

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        return []


def test_structure_leaves_unknown_values_to_dcp() -> None:
    """A tensor subclass or an object with ``__create_write_items__``: no structure (planned
    as DCP does every time); a plain value counts by its name only."""
    t = torch.zeros(2)
    assert structure({"a": t.as_subclass(Wrapped)}) is None
    assert structure({"a": Checkpointable()}) is None
    assert structure({"a": 1, "t": t}) == structure({"a": "x", "t": torch.ones(2)})
    assert structure({"a": 1}) != structure({"b": 1})
    assert structure({"t": t}) != structure({"t": t.to(torch.float64)})


def test_no_reuse_without_a_structure(tmp_path: Path, make_writer) -> None:
    """States with a tensor subclass are planned afresh every save, and saved right."""
    planner = ReusingPlanner()
    for i in range(3):
        state = {"w": rand_tensor((4,), torch.float32, i).as_subclass(Wrapped), "n": i}
        directory = tmp_path / f"s{i}"
        dcp.save(state, storage_writer=make_writer(directory), planner=planner, no_dist=True)
        planner.release()
        out = load_into({"w": torch.zeros(4), "n": 0}, directory)
        assert torch.equal(out["w"], state["w"].as_subclass(torch.Tensor)) and out["n"] == i
    assert (planner.planned, planner.reused) == (3, 0)
