"""Plan reuse with states whose structure changes subtly, and the copy fence when a save
fails or ends while a guard waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MARKS, Tiers, assert_state_equal, load_into, rand_tensor
from test_plan_reuse import check_step, fresh_metadata, planner_of, stored_metadata

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates.jobs.fence import CopyFence
from dcp_datastates.tiers.plans import ReusingPlanner

pytestmark = MARKS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


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
    from dcp_datastates.tiers.plans import ReusingPlanner

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


def test_empty_and_strided_tensors_keep_their_plan_and_load(tmp_path: Path,
                                                           make_writer) -> None:
    """Empty tensors and a non-contiguous tensor of the same shape: the plan is reused
    (DCP's plan does not hold strides on this torch) and every save loads bit for bit."""
    planner = ReusingPlanner()
    base = rand_tensor((4, 6), torch.float32, 3)
    for i, w in enumerate([base, base.t().contiguous().t(), base.clone()]):
        state = {"w": w, "e": torch.empty(0), "z": torch.zeros(0, 3), "n": i}
        directory = tmp_path / f"s{i}"
        dcp.save(state, storage_writer=make_writer(directory), planner=planner, no_dist=True)
        planner.release()
        assert_state_equal(load_into(state, directory), state)
        assert stored_metadata(directory).state_dict_metadata == \
            fresh_metadata(state).state_dict_metadata
    assert (planner.planned, planner.reused) == (1, 2)


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


def test_a_guard_waiting_on_the_cpu_passes_once_the_copies_end() -> None:
    """A guard without a stream waiter waits on the CPU while the copies run, and passes once
    the copier has waited for them (events taken back), before the save sets its fence (by
    success or failure)."""
    fence = CopyFence()
    fence.publish({0: "event"})
    waiter = threading.Thread(target=fence.order, args=(None,), daemon=True)
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()
    fence.publish(None)
    waiter.join(5)
    assert not waiter.is_alive() and not fence.wait(0)
