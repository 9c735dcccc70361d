"""DCP as the oracle, on several ranks (``mpirun -n 2`` and ``-n 4``): states made from seeds,
saved on the world through every path users have and loaded with DataStatesReader on the
world (in the saved layout and in another one), on each rank alone (``no_dist``, full tensors)
and, with 4 ranks, on each pair of ranks, give what DCP's FileSystemWriter and
FileSystemReader give; so do checkpoints saved by a pair and loaded on the world (2 -> 4), and
a manager restarted on one rank.

Every rank makes the same state from the seed; ``agree`` fails every rank together, naming the
seed, the path, the load and the item. ``DCP_ORACLE_SEEDS``/``DCP_ORACLE_TRIALS`` widen the
seeds (``make fuzz``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import mpi_util, rand_tensor
from helpers.mpi_util import World, agree, collecting
from helpers.oracle import (
    SAVE_PATHS,
    Meshes,
    Saved,
    child_env,
    differences,
    load_reference,
    load_with,
    make_state,
    report,
    save_reference,
    save_with,
    seeds,
)
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_datastates import CheckpointManager, Engine

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
]

SEEDS = seeds(default=(0, 1))
PARTS = ("main", "bits")

world = mpi_util.world
shared = mpi_util.shared
nodes = mpi_util.nodes


def _cases() -> list:
    return [pytest.param(path, part, id=f"{path}-{part}") for path in SAVE_PATHS for part in PARTS]


@pytest.fixture(scope="module")
def meshes(world: World) -> Meshes:
    return Meshes.of(world.size)


@pytest.fixture(scope="module")
def pairs(world: World) -> Meshes | None:
    """This rank's pair's meshes (ranks 2k, 2k+1), with 4 or more ranks."""
    return Meshes.pairs(world.size) if world.size >= 4 and world.size % 2 == 0 else None


@pytest.fixture
def engine(world: World) -> Iterator[Engine]:
    made = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    yield made
    leases = made.live_leases()
    made.close()
    assert leases == 0, f"rank {world.rank}: {leases} lease(s) still held after the test"


def _both(saved: Saved, reference: Path, seed: int, make: dict, engine: Engine,
          **load: object) -> tuple[dict, dict]:
    """``saved`` and ``reference`` loaded into two templates ``make_state(seed, **make)``."""
    ours = load_with(saved, make_state(seed, blank=True, **make), engine, **load)
    theirs = load_reference(reference, make_state(seed, blank=True, **make), **load)
    return ours, theirs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("path", "part"), _cases())
def test_loads_what_dcp_loads_on_any_world(world: World, shared: Path, engine: Engine,
                                           meshes: Meshes, pairs: Meshes | None, seed: int,
                                           path: str, part: str) -> None:
    """Saved on the world; loaded on the world (same and other placements), on each rank
    alone and on each pair."""
    bits = part == "bits"
    state = make_state(seed, meshes, bits=bits)
    reference = save_reference(state, shared / "dcp", path)
    saved = save_with(path, state, shared / "ours", engine)
    n, problems = world.size, []
    loads = [(f"{n}->{n}", {"meshes": meshes}, {})]
    # A rank's memory tier holds its own chunks only: no checkpoint alone or for a pair, and
    # another layout is test_manager_memory_tier_into_another_layout's
    if path != "manager_memory":
        loads.append((f"{n}->{n} resharded", {"meshes": meshes, "layout_seed": seed + 1}, {}))
        loads.append((f"{n}->1", {"meshes": None}, {"no_dist": True}))
        if pairs is not None:
            loads.append((f"{n}->2", {"meshes": pairs}, {"group": pairs.flat.get_group()}))
    for name, make, how in loads:
        make.update(bits=bits, mirror=seed % 2 == 1)
        with collecting(problems, f"{path}, {name}"):
            ours, theirs = _both(saved, reference, seed, make, engine, **how)
            problems += differences(ours, theirs, f"[{path}, {name}] state")
    agree(problems, report([], seed))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("path", ["save", "async", "stager"])
def test_loads_what_dcp_loads_saved_by_a_pair(world: World, shared: Path, engine: Engine,
                                              meshes: Meshes, pairs: Meshes | None, seed: int,
                                              path: str) -> None:
    """2 -> W: each pair of ranks saves on its own group; the world loads pair 0's."""
    if pairs is None:
        pytest.skip("needs an even world of 4 or more ranks (mpirun -n 4)")
    group, pair = pairs.flat.get_group(), world.rank // 2
    state = make_state(seed, pairs)
    save_reference(state, shared / f"dcp{pair}", path, group=group)
    save_with(path, state, shared / f"ours{pair}", engine, group=group)
    dist.barrier()
    problems: list[str] = []
    make = {"meshes": meshes, "mirror": seed % 2 == 1}
    with collecting(problems, f"{path}, 2->{world.size}"):
        ours, theirs = _both(Saved(path, shared / "ours0" / "ckpt"), shared / "dcp0", seed,
                             make, engine)
        problems += differences(ours, theirs, f"[{path}, 2->{world.size}] state")
    agree(problems, report([], seed))


@pytest.mark.parametrize("memory", ["kept", "lost"])
def test_manager_restarted_on_one_rank_loads_what_dcp_loads(
        world: World, shared: Path, nodes: Path, engine: Engine, meshes: Meshes,
        memory: str) -> None:
    """A manager's step saved on the world, restarted as one process: with rank 0's memory
    tier (``kept``) or none (``lost``: from the durable tier)."""
    seed = 0  # whatever the seeds: its DTensors have chunks on every rank of 2 and 4
    state = make_state(seed, meshes)
    reference = save_reference(state, shared / "dcp")
    durable, mine = shared / "durable", nodes / f"node_{world.rank}"
    with CheckpointManager(durable, memory_dir=mine, persist=1, engine=engine) as manager:
        manager.save(1, state)
        manager.wait()
    problems: list[str] = []
    if world.rank == 0:
        with collecting(problems, "restart on one rank"):
            restart_memory = mine if memory == "kept" else nodes / "fresh"
            out = shared / "restarted.pt"
            done = subprocess.run(
                [sys.executable, "-m", "helpers.oracle", "manager-load", str(durable),
                 str(restart_memory), str(seed), str(out)],
                env=child_env(), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-4000:]
            ours = torch.load(out, weights_only=False)
            theirs = load_reference(reference, make_state(seed, blank=True), no_dist=True)
            problems += differences(ours, theirs, f"[manager {world.size}->1, memory {memory}]"
                                                  " state")
    agree(problems, report([], seed))


@pytest.mark.parametrize("target", ["replicate", "shard0"])
def test_manager_memory_tier_into_another_layout(world: World, shared: Path, nodes: Path,
                                                 engine: Engine, meshes: Meshes,
                                                 target: str) -> None:
    """Shard(1) DTensors saved by a manager on the world (memory and durable tiers),
    restarted on the same ranks and loaded into Replicate ones (every rank needs every chunk)
    or the same Shard(1)."""
    full = rand_tensor((5, 4 * world.size + 1), torch.float32, seed=7)
    mine = nodes / f"node_{world.rank}"
    state = {"w": distribute_tensor(full, meshes.flat, [Shard(1)])}
    reference = save_reference(state, shared / "dcp")
    durable = shared / "durable"
    with CheckpointManager(durable, memory_dir=mine, persist=1, engine=engine) as manager:
        manager.save(1, state)
        manager.wait()
    placements = [Replicate()] if target == "replicate" else [Shard(1)]

    def template() -> dict:
        out = {"w": distribute_tensor(torch.zeros_like(full), meshes.flat, placements)}
        out["w"].to_local().view(torch.uint8).fill_(0xA5)
        return out

    problems: list[str] = []
    with collecting(problems, "restart"):
        with CheckpointManager(durable, memory_dir=mine, engine=engine) as manager:
            ours = template()
            manager.load(ours)
        theirs = load_reference(reference, template())
        problems += differences(ours, theirs, f"[manager_memory, Shard(1) -> {target}] state")
    agree(problems, "a memory-tier restore into another layout differs from DCP")
