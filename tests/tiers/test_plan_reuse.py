"""A manager's saves reuse DCP's plans of the previous save when the state keeps its structure
(``dcp_datastates/tiers/_plans.py``). The reuse is read from the planner the manager's memory
saver owns (``planned`` / ``reused`` counts); every checkpoint must still load bit for bit with
plain ``dcp.load`` and hold the metadata a fresh plan gives. States whose structure changes
subtly (the same names nested differently, a DTensor made trainable) are planned again."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import MARKS, ROOT, Tiers, assert_state_equal, load_into, rand_tensor
from helpers.tiers import FailFsync, make_state, save_through
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorProperties

from dcp_datastates import CheckpointManager, DataStatesReader, Engine
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._plans import ReusingPlanner, structure

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


def renested(t: torch.Tensor, u: torch.Tensor) -> list[dict]:
    """States of the same flattened names and tensors, nested differently."""
    return [{"a": {"b": t}, "x": [t, u]},
            {"a.b": t, "x": [t, u]},
            {"a.b": t, "x": {"0": t, "1": u}}]


def test_a_changed_nesting_with_the_same_names_is_planned_again(tmp_path: Path,
                                                                  make_writer) -> None:
    """``{"a": {"b": t}}`` and ``{"a.b": t}`` (or a list and a dict keyed "0", "1") flatten to
    the same names but not the same paths: each save stores the ``planner_data`` of a fresh
    plan (which rebuilds the nesting, e.g. ``dcp_to_torch_save``), not the last save's."""
    planner = ReusingPlanner()
    t, u = rand_tensor((6,), torch.float32, 1), rand_tensor((3,), torch.int64, 2)
    for i, state in enumerate(renested(t, u)):
        directory = tmp_path / f"s{i}"
        dcp.save(state, storage_writer=make_writer(directory), planner=planner, no_dist=True)
        planner.release()
        assert stored_metadata(directory).planner_data == fresh_metadata(state).planner_data
    assert (planner.planned, planner.reused) == (3, 0)


def test_a_changed_nesting_through_the_manager(tiers: Tiers, engine: Engine) -> None:
    """The same through a manager's memory tier: every step loads and holds a fresh plan's
    metadata; the same nesting saved again reuses the plan."""
    t, u = rand_tensor((6,), torch.float32, 1), rand_tensor((3,), torch.int64, 2)
    states = [s for s in renested(t, u) for _ in range(2)]
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=10,
                           persist=None, engine=engine) as manager:
        for step, state in enumerate(states, 1):
            manager.save(step, state).result(timeout=30)
            manager.wait()
        assert (planner_of(manager).planned, planner_of(manager).reused) == (3, 3)
        for step, state in enumerate(states, 1):
            check_step(tiers.memory, step, state)


_DTENSOR_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from dcp_datastates import DataStatesReader, DataStatesWriter, Engine
    from dcp_datastates.tiers._plans import ReusingPlanner

    def fresh(state):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        return planner.create_global_plan([planner.create_local_plan()])[1]

    root = sys.argv[1]
    store = dist.FileStore(os.path.join(root, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        engine = Engine(host_cache_size="8MiB", io_backend="threads")
        mesh, planner = init_device_mesh("cpu", (1,)), ReusingPlanner()
        for i, flag in enumerate([False, False, True, True]):
            w = distribute_tensor(torch.arange(8.0) + i, mesh, [Shard(0)]).requires_grad_(flag)
            state, directory = {"w": w}, os.path.join(root, f"s{i}")
            dcp.save(state, storage_writer=DataStatesWriter(directory, engine=engine),
                     planner=planner, no_dist=True)
            planner.release()
            reader = DataStatesReader(engine=engine)
            reader.reset(directory)
            got = reader.read_metadata().state_dict_metadata["w"].properties
            want = fresh(state).state_dict_metadata["w"].properties
            assert got == want, (i, got, want)
        assert (planner.planned, planner.reused) == (2, 2), (planner.planned, planner.reused)
        engine.close()
        print("DTENSOR-OK")
    finally:
        dist.destroy_process_group()
    """
)


def test_a_dtensor_whose_requires_grad_changes_is_planned_again(tmp_path: Path) -> None:
    """A DTensor's write item holds ``to_local()``'s properties: its ``requires_grad`` is the
    DTensor's (with grad enabled), not its local tensor's, so a DTensor made trainable (or
    frozen) between saves is planned afresh and stored as a fresh plan stores it."""
    script = tmp_path / "dtensor_save.py"
    script.write_text(_DTENSOR_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "DTENSOR-OK" in done.stdout, done.stdout + done.stderr


def test_empty_and_strided_tensors_are_stored_as_a_fresh_plan_stores_them(
        tmp_path: Path, make_writer) -> None:
    """Empty tensors and a non-contiguous tensor of the same shape, its strides changing from
    save to save: every save loads bit for bit and holds a fresh plan's metadata (on a torch
    whose ``TensorProperties`` hold strides, a save whose strides changed is planned afresh,
    not stored with the previous save's strides; on one without, the plan is reused)."""
    planner = ReusingPlanner()
    base = rand_tensor((4, 6), torch.float32, 3)
    last, planned = None, 0
    for i, w in enumerate([base, base.t().contiguous().t(), base.clone()]):
        state = {"w": w, "e": torch.empty(0), "z": torch.zeros(0, 3), "n": i}
        directory = tmp_path / f"s{i}"
        dcp.save(state, storage_writer=make_writer(directory), planner=planner, no_dist=True)
        planner.release()
        assert_state_equal(load_into(state, directory), state)
        fresh = fresh_metadata(state).state_dict_metadata
        assert stored_metadata(directory).state_dict_metadata == fresh
        planned += fresh != last
        last = fresh
    assert (planner.planned, planner.reused) == (planned, 3 - planned)


@dataclasses.dataclass
class StridedProperties:
    """A tensor's properties as a torch that records strides has them (2.15's
    ``TensorProperties``)."""

    dtype: torch.dtype
    strides: tuple[int, ...]


def strided(tensor: torch.Tensor) -> StridedProperties:
    return StridedProperties(tensor.dtype, tuple(tensor.stride()))


def test_structure_holds_every_field_of_a_tensors_properties() -> None:
    """The structure holds every field of what DCP records of a tensor, whichever fields this
    torch's ``TensorProperties`` has: with strides among them, a tensor whose strides changed
    is another structure (its plan would store the old strides); on this torch, two tensors
    are one structure exactly where DCP records the same properties."""
    base = rand_tensor((4, 6), torch.float32, 3)
    other = base.t().contiguous().t()
    assert structure({"w": base}, properties=strided) != structure({"w": other},
                                                                   properties=strided)
    assert structure({"w": base}, properties=strided) == structure({"w": base.clone()},
                                                                   properties=strided)
    same = TensorProperties.create_from_tensor(base) == TensorProperties.create_from_tensor(other)
    assert (structure({"w": base}) == structure({"w": other})) == same


def test_two_hundred_saves_keep_one_plan(tmp_path: Path, make_writer) -> None:
    """200 saves of one structure: the planner holds the plans of one save and no tensor."""
    planner = ReusingPlanner()
    state = {"w": rand_tensor((16,), torch.float32, 0), "n": 0}
    for i in range(200):
        state["n"] = i
        dcp.save(state, storage_writer=make_writer(tmp_path / f"s{i % 2}", overwrite=True),
                 planner=planner,
                 no_dist=True)
        planner.release()
        assert planner.state_dict == {} and planner.metadata is None and planner.mappings == {}
    assert (planner.planned, planner.reused) == (1, 199)
    local, global_plans, _metadata = planner._kept
    assert len(local.items) == 2 and len(global_plans) == 1
