"""The overhead budget across ranks: every rank takes the same decision for every step, though
each measures its own costs on its own clock. Run under MPI (see test_tiers_mpi.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_state_equal, blank_like, mpi_util, rand_tensor
from helpers.fakes import Costly, FakeClock, HeldPinRoomEngine
from helpers.mpi_util import World, agree, collecting

from dcp_datastates import CheckpointManager, Engine

pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

world = mpi_util.world
shared = mpi_util.shared
nodes = mpi_util.nodes

BUDGET, STEP_S = 1 / 16, 0.5
#: Rank 0's saves cost 1/16 s (a save every 2 steps alone), the others' 1/8 s (every 4 steps):
#: all take the steps the costliest affords.
TAKEN = [0, 8, 12, 16, 20, 24]


def cost_of(rank: int) -> float:
    return 1 / 16 if rank == 0 else 1 / 8


def rank_state(rank: int, step: int) -> dict:
    return {f"rank{rank}": {"w": rand_tensor((8 + rank, 4), torch.float32, 100 * step + rank)},
            "extra": {"step": step}}


def test_every_rank_takes_the_same_decisions(world: World, nodes: Path, shared: Path) -> None:
    clock = FakeClock(start=1000.0 * world.rank)  # clocks that disagree, costs that differ
    engine = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    errors: list[str] = []
    decisions: list[bool] = []
    try:
        with CheckpointManager(shared, memory_dir=nodes / f"node_{world.rank}", engine=engine,
                               max_overhead=BUDGET, clock=clock) as manager:
            reasons = []
            for step in range(25):
                clock.now += STEP_S
                manager.order_after_staging()  # what the guard calls
                state = {"app": Costly(rank_state(world.rank, step), clock, cost_of(world.rank))}
                handle = manager.save(step, state)
                decisions.append(handle.skipped)
                reasons.append(handle.reason)
                if not handle.skipped:
                    manager.wait()
            with collecting(errors, "decisions"):
                assert [s for s, skip in enumerate(decisions) if not skip] == TAKEN
                others = {r for r in reasons if r.startswith("rank ")}
                if world.rank == 0:  # rank 0 alone would save at step 4: the others said no
                    assert reasons[4] == f"rank {world.size - 1}: over its budget", reasons[4]
                else:
                    assert not others, others
                assert manager.latest_step() == TAKEN[-1]
            template = {"app": Costly(blank_like(rank_state(world.rank, 24)), clock, 0.0)}
            with collecting(errors, "load"):
                assert manager.load(template) == 24
                assert_state_equal(template["app"].state, rank_state(world.rank, 24))
    finally:
        engine.close()
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, decisions)
    if any(d != gathered[0] for d in gathered):
        errors.append(f"ranks decided differently: {gathered}")
    agree(errors, "budget decisions")
    durable = sorted(int(m.group(1)) for p in shared.iterdir()
                     if (m := re.fullmatch(r"step_(\d+)", p.name)))
    assert set(durable) <= set(TAKEN), durable


class Collective:
    """A ``Stateful`` whose ``state_dict()`` is collective (an all-reduce on the default group,
    as an FSDP optimizer's state dict gathers); ``calls`` counts them."""

    def __init__(self, state: dict) -> None:
        self.state, self.calls = state, 0

    def state_dict(self) -> dict:
        dist.all_reduce(torch.ones(1))
        self.calls += 1
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_a_collective_state_dict_while_one_rank_waits_for_its_slot(world: World,
                                                                  nodes: Path) -> None:
    """Under ``max_overhead``, rank 0's first slot is still being pinned (held) when the first
    save comes; the other ranks' slots are pinned. Rank 0's save waits aside for its slot, the
    others' go into theirs: every rank takes the save, takes its state dict (a collective one)
    once the ranks have decided, and the step loads exactly. Taken on rank 0 alone before the
    budget's all-reduce, such a state dict hung every rank."""
    engine = HeldPinRoomEngine(True, io_backend="threads", host_cache_size="8MiB",
                               io_workers=2)
    if world.rank != 0:
        engine.gate.set()
    clock = FakeClock()
    state = rank_state(world.rank, 1)
    errors: list[str] = []
    try:
        with CheckpointManager(memory_dir=nodes / f"node_{world.rank}", keep_memory=1,
                               persist=None, engine=engine, max_overhead=0.5,
                               clock=clock) as manager:
            manager.prepare(state, wait=world.rank != 0)
            with collecting(errors, "pinning held"):
                assert world.rank != 0 or engine.pinning.wait(10)
            clock.now += 1.0
            app = Collective(state)
            handle = manager.save(1, {"app": app})
            with collecting(errors, "save"):
                assert not handle.skipped, handle.reason
                assert app.calls == 1
            agree(errors, "the save taken")
            engine.gate.set()
            with collecting(errors, "commit"):
                handle.result(timeout=30)
            out = {"app": Collective(blank_like(state))}
            with collecting(errors, "load"):
                assert manager.load(out) == 1
                assert_state_equal(out["app"].state, state)
    finally:
        engine.gate.set()
        engine.close()
    agree(errors, "collective state dict")
