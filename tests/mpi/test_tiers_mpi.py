"""Checkpoint tiers across ranks: peer replicas, which step every rank can restore, and the
job-wide durable checkpoint that persists assemble from the ranks' parts.

Each rank has its own memory tier under /dev/shm (it stands for a node's); the durable tier is
a directory every rank sees. Run under MPI (plain ``pytest tests`` skips these), with -n 2 and
with -n 4::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
        mpirun -n 2 --oversubscribe python -m pytest -q -p no:cacheprovider --with-mpi \\
        tests/mpi/test_tiers_mpi.py

A rank that finds a problem reports it through ``agree``, so every rank fails together instead
of leaving the others blocked in a collective of the managers.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import assert_state_equal, blank_like, mpi_util, rand_tensor
from helpers.mpi_util import World, agree, broadcast_object, collecting
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_datastates import (
    CheckpointError,
    CheckpointManager,
    DataStatesReader,
    Engine,
    TierFullError,
)
from dcp_datastates._io import make_backend

pytestmark = [
    pytest.mark.mpi,
    # every memory-tier save and load is a one-process DCP call (no_dist=True)
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

world = mpi_util.world
shared = mpi_util.shared
nodes = mpi_util.nodes


@pytest.fixture
def engine(world: World) -> Iterator[Engine]:
    made = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    yield made
    leases = made.live_leases()
    made.close()
    assert leases == 0, f"rank {world.rank}: {leases} lease(s) still held after the test"


def restored_from(caplog: pytest.LogCaptureFixture, step: int) -> list[str]:
    pat = re.compile(rf"restored step {step} from the (\w+) tier")
    return [m.group(1) for r in caplog.records if (m := pat.search(r.getMessage()))]


def committed_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if re.fullmatch(r"step_\d+", p.name) and (p / ".metadata").is_file())


# -- states --------------------------------------------------------------------------------------
def rank_state(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step``: tensors and values under names of its own, a tensor
    every rank holds alike (replicated) and a value every rank holds alike."""
    return {
        f"rank{rank}": {"w": rand_tensor((16 + rank, 8), torch.float32, 1000 * step + rank),
                        "n": torch.tensor(10 * step + rank, dtype=torch.int64),
                        "tag": f"rank {rank} at {step}"},
        "shared": {"emb": rand_tensor((10, 4), torch.bfloat16, step)},
        "extra": {"step": step},
    }


def full_sharded(step: int, world_size: int) -> torch.Tensor:
    """The full value of a tensor sharded over the ranks (rows; uneven over 2 and 4 ranks)."""
    return rand_tensor((4 * world_size + 3, 6), torch.float32, 7000 + step)


def error_of(call: Callable[[], object]) -> Exception | None:
    """What ``call()`` raised (None: nothing); so that ranks go on together either way."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the caller checks it
        return exc
    return None


def check(errors: list[str], what: str, actual: object, expected: object) -> None:
    with collecting(errors, what):
        assert_state_equal(actual, expected)


# -- (a) peer replicas ---------------------------------------------------------------------------
def test_replica_restores_a_lost_node_memory(world: World, nodes: Path, engine: Engine,
                                             logs) -> None:
    """replicate=True: rank 1 loses its whole memory tier (its node died); new managers restore
    the newest step, rank 1's copy sent back from the peer that held its replica."""
    mine = nodes / f"node_{world.rank}"
    holder = (1 + 1) % world.size  # keeps rank 1's replicas
    errors: list[str] = []
    with CheckpointManager(None, memory_dir=mine, replicate=True, keep_memory=2,
                           engine=engine) as manager:
        for step in (1, 2, 3):
            manager.save(step, rank_state(world.rank, step))
            manager.wait()  # each exchange over before the next save: every step replicated
    prev = (world.rank - 1) % world.size
    replicas = mine / "replicas" / f"rank_{prev}"
    if committed_steps(replicas) != [2, 3]:
        errors.append(f"replicas of rank {prev}: {committed_steps(replicas)}, expected [2, 3]")
    if committed_steps(mine) != [2, 3]:
        errors.append(f"own memory tier: {committed_steps(mine)}")
    agree(errors, "replicas after three saves (keep_memory=2)")

    dist.barrier()
    if world.rank == 1:
        shutil.rmtree(mine)
    dist.barrier()

    with CheckpointManager(None, memory_dir=mine, replicate=True, engine=engine) as manager:
        out = blank_like(rank_state(world.rank, 3))
        step = manager.load(out)
        with collecting(errors, "restore"):
            assert step == 3
            assert_state_equal(out, rank_state(world.rank, 3))
            assert restored_from(logs, 3) == ["memory"]
            sent_back = [r.getMessage() for r in logs.records
                         if "replica" in r.getMessage() and "restored into" in r.getMessage()]
            if world.rank == 1:
                assert committed_steps(mine) == [3], "rank 1's memory tier was refilled"
                assert sent_back == [f"dcp_datastates: step 3 of rank 1 restored into {mine} "
                                     f"from rank {holder}'s replica"], sent_back
            else:
                assert sent_back == []
        # an older step that only replicas of rank 1 hold, asked for
        out = blank_like(rank_state(world.rank, 2))
        with collecting(errors, "restore of step 2"):
            assert manager.load(out, step=2) == 2
            assert_state_equal(out, rank_state(world.rank, 2))
    agree(errors, f"restore from a peer's replica on {world.size} ranks")


# -- (b) the newest step every rank can restore --------------------------------------------------
def test_latest_step_is_complete_on_every_rank(world: World, nodes: Path, shared: Path,
                                               engine: Engine, logs) -> None:
    """Step 3 lost on rank 1 (no replicas): every rank takes step 2. Then step 2 lost on rank 1
    too, but persisted: every rank takes step 2, rank 1 from the durable tier."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    errors: list[str] = []
    with CheckpointManager(durable, memory_dir=mine, persist=None, keep_memory=3,
                           engine=engine) as manager:
        for step in (1, 2, 3):
            manager.save(step, rank_state(world.rank, step))
        manager.wait()
        assert manager.latest_step() == 3
        dist.barrier()
        if world.rank == 1:
            shutil.rmtree(mine / "step_3")
        dist.barrier()
        latest = manager.latest_step()
        out = blank_like(rank_state(world.rank, 2))
        loaded = manager.load(out)
        with collecting(errors, "step 3 lost on rank 1"):
            assert (latest, loaded) == (2, 2)
            assert_state_equal(out, rank_state(world.rank, 2))
            assert restored_from(logs, 2) == ["memory"]
    assert committed_steps(durable) == [], "persist=None"
    agree(errors, "latest step with a step missing on one rank")

    # a manager that persists: its first act is to persist step 2 (the newest step every rank
    # holds in memory), as a new process after a crash does
    with CheckpointManager(durable, memory_dir=mine, keep_memory=3, engine=engine) as manager:
        manager.wait()
        dist.barrier()  # the rank that completes the parts commits: all must have waited
        with collecting(errors, "persist of the leftover step"):
            assert committed_steps(durable) == [2]
        dist.barrier()
        if world.rank == 1:
            shutil.rmtree(mine / "step_2")
        dist.barrier()
        latest = manager.latest_step()
        out = blank_like(rank_state(world.rank, 2))
        loaded = manager.load(out)
        with collecting(errors, "step 2 from memory and durable"):
            assert (latest, loaded) == (2, 2)
            assert_state_equal(out, rank_state(world.rank, 2))
            tiers = restored_from(logs, 2)
            assert tiers == ["memory", "durable" if world.rank == 1 else "memory"], tiers
    agree(errors, "latest step with the durable tier")


# -- (c) the job-wide durable checkpoint ---------------------------------------------------------
def sharded_rank_state(rank: int, step: int, mesh) -> dict:
    state = rank_state(rank, step)
    state["sharded"] = {"w": distribute_tensor(full_sharded(step, mesh.size()), mesh, [Shard(0)])}
    return state


def test_persisted_checkpoint_loads_without_the_manager(world: World, nodes: Path,
                                                        shared: Path, engine: Engine,
                                                        logs: pytest.LogCaptureFixture) -> None:
    """Persists on every rank make one DCP checkpoint of the job: a plain multi-rank dcp.load
    with DataStatesReader reads it (a DTensor saved as row shards loads as column shards and
    replicated), and so does one process reading every rank's items."""
    mesh = init_device_mesh("cpu", (world.size,))
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    errors: list[str] = []
    with CheckpointManager(durable, memory_dir=mine, persist=1, engine=engine) as manager:
        for step in (1, 2):
            manager.save(step, sharded_rank_state(world.rank, step, mesh))
            manager.wait()
        # the memory tier restores the DTensor shard too (its step holds this rank's shard)
        out = sharded_rank_state(world.rank, 0, mesh)
        assert manager.load(out) == 2
        with collecting(errors, "memory-tier load with a DTensor"):
            assert restored_from(logs, 2) == ["memory"]
            assert isinstance(out["sharded"]["w"], DTensor)
            full = out["sharded"]["w"].full_tensor()
            expected = rank_state(world.rank, 2)
            out["sharded"] = {"w": full}
            expected["sharded"] = {"w": full_sharded(2, world.size)}
            assert_state_equal(out, expected)
    agree(errors, "manager saves")
    checkpoint = durable / "step_2"
    with collecting(errors, "durable tier"):
        assert committed_steps(durable) == [1, 2]
        names = sorted(p.name for p in checkpoint.iterdir())
        assert not [n for n in names if n.startswith(".part.")], names
        assert len([n for n in names if n.endswith(".safetensors")]) == world.size, names

    # every rank, plain DCP: its own items, the replicated ones, and the DTensor resharded
    full = full_sharded(2, world.size)
    for placement in (Shard(1), Replicate()):
        target = rank_state(world.rank, 0)
        target = blank_like(target)
        target["sharded"] = {"w": distribute_tensor(torch.zeros_like(full), mesh, [placement])}
        dcp.load(target, checkpoint_id=checkpoint, storage_reader=DataStatesReader(engine=engine))
        got = target["sharded"]["w"].full_tensor()
        target["sharded"] = {"w": got}
        expected = rank_state(world.rank, 2)
        expected["sharded"] = {"w": full}
        check(errors, f"multi-rank load ({placement})", target, expected)

    # one process (rank 0), no collectives: every rank's items and the full DTensor
    if world.rank == 0:
        expected = {k: v for r in range(world.size) for k, v in rank_state(r, 2).items()}
        expected["sharded"] = {"w": full}
        target = blank_like(expected)
        dcp.load(target, checkpoint_id=checkpoint, storage_reader=DataStatesReader(engine=engine),
                 no_dist=True)
        check(errors, "one-process load of every rank's items", target, expected)
    agree(errors, f"job-wide durable checkpoint of {world.size} ranks")


# -- memory_limit with replicas ------------------------------------------------------------------
def test_memory_limit_counts_the_replicas_held(world: World, nodes: Path, engine: Engine) -> None:
    """The memory tier holds this rank's checkpoints and a peer's replicas: memory_limit bounds
    both. Two saves of ~1 MiB fill 4.5 MiB with their replicas; the third is refused on every
    rank (nothing written, nothing replicated) and the two before stay restorable."""
    mine = nodes / f"node_{world.rank}"
    replicas = mine / "replicas" / f"rank_{(world.rank - 1) % world.size}"

    def state(step: int) -> dict:
        return {**rank_state(world.rank, step), "big": rand_tensor((1 << 20,), torch.uint8, step)}

    errors: list[str] = []
    with CheckpointManager(None, memory_dir=mine, replicate=True, keep_memory=2,
                           memory_limit=9 << 19, engine=engine) as manager:
        for step in (1, 2):
            manager.save(step, state(step))
            manager.wait()
        refused = manager.save(3, state(3))
        with collecting(errors, "save 3"):
            err = refused.committed.exception(timeout=30)
            assert isinstance(err, TierFullError), err
            assert re.search(rf"memory tier {re.escape(str(mine))} has .+ free; the checkpoint "
                             r"of step 3 needs", str(err)), str(err)
        with collecting(errors, "wait"):
            with pytest.raises(TierFullError):
                manager.wait()
        with collecting(errors, "tiers after the refused save"):
            assert committed_steps(mine) == [1, 2] and not (mine / "step_3").exists()
            assert committed_steps(replicas) == [1, 2]
        out = blank_like(state(2))
        loaded = manager.load(out)
        with collecting(errors, "restore"):
            assert loaded == 2
            assert_state_equal(out, state(2))
    agree(errors, f"memory_limit with replicas on {world.size} ranks")


def big_or_small(rank: int, step: int, big: bool) -> dict:
    """``rank``'s state of ``step``, with 2.5 MiB more where ``big`` (more than a 3 MiB tier
    holds)."""
    extra = {"big": rand_tensor((5 << 19,), torch.uint8, step)} if big else {}
    return {**rank_state(rank, step), **extra}


# -- a save refused on one rank only -------------------------------------------------------------
def test_save_refused_on_one_rank_only(world: World, nodes: Path, shared: Path,
                                       engine: Engine) -> None:
    """Rank 1's memory tier is too small for the big saves: they are no checkpoint of the job
    (never persisted, never restored), the small save after them is; close() raises rank 1's
    error there, after the collective the other ranks are in (no hang)."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    limit = 3 << 20 if world.rank == 1 else None

    errors: list[str] = []
    manager = CheckpointManager(durable, memory_dir=mine, memory_limit=limit, engine=engine)
    try:
        first = manager.save(1, big_or_small(world.rank, 1, big=True))
        with collecting(errors, "save 1"):
            err = first.committed.exception(timeout=30)
            assert isinstance(err, TierFullError) == (world.rank == 1), err
            assert first.persisted is None, "a save failed on rank 1: persisted nowhere"
        latest = manager.latest_step()
        with collecting(errors, "latest after save 1"):
            assert latest is None
        second = manager.save(2, big_or_small(world.rank, 2, big=False))
        with collecting(errors, "save 2"):
            assert second.persisted is not None
            second.result(timeout=30)
        latest = manager.latest_step()  # it waits for the saves; wait() reports their errors
        err = error_of(manager.wait)
        with collecting(errors, "wait"):
            if world.rank == 1:
                assert isinstance(err, TierFullError), err
                assert "checkpoint of step 1 needs" in str(err), str(err)
            else:
                assert err is None, err
            assert error_of(manager.wait) is None, "an error is raised once"
        with collecting(errors, "latest after save 2"):
            assert latest == 2
        latest = manager.latest_step()
        out = blank_like(big_or_small(world.rank, 2, big=False))
        loaded = manager.load(out)
        with collecting(errors, "restore"):
            assert (latest, loaded) == (2, 2)
            assert_state_equal(out, big_or_small(world.rank, 2, big=False))
        manager.save(3, big_or_small(world.rank, 3, big=True))
    finally:
        err = error_of(manager.close)
    with collecting(errors, "close"):
        if world.rank == 1:
            assert isinstance(err, TierFullError), err
            assert "checkpoint of step 3 needs" in str(err), str(err)
        else:
            assert err is None, err
    with collecting(errors, "tiers"):
        assert committed_steps(durable) == [2]
        assert committed_steps(mine) == ([2] if world.rank == 1 else [2, 3])
    agree(errors, f"a save refused on rank 1 of {world.size}")


# -- persist="idle": the chain takes a step every rank holds -------------------------------------
class SlowFsync:
    """An IOBackend over a real one whose fsyncs of files under each prefix take that long."""

    def __init__(self, delays: dict[Path, float]) -> None:
        self.inner, _ = make_backend("threads")
        self.name = f"slowfsync({self.inner.name})"
        self.delays = {str(p).rstrip("/") + "/": d for p, d in delays.items()}
        self.failing: str | None = None  # fsyncs of files under this prefix fail


    def write(self, fd, path, reqs) -> None:
        self.inner.write(fd, path, reqs)

    def read(self, fd, path, reqs) -> None:
        self.inner.read(fd, path, reqs)

    def register(self, addr, nbytes) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr, nbytes) -> None:
        self.inner.unregister(addr, nbytes)

    def fsync(self, fd, path) -> None:
        if self.failing is not None and path.startswith(self.failing):
            raise OSError(5, "injected EIO", path)
        for prefix, delay in self.delays.items():
            if path.startswith(prefix):
                time.sleep(delay)
        self.inner.fsync(fd, path)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("replicate", [False, True])
def test_idle_chain_persists_only_a_step_every_rank_holds(world: World, nodes: Path,
                                                          shared: Path, replicate: bool) -> None:
    """Rank 1 commits into memory slowly, rank 0 fast (keep_memory=1: it keeps only its
    newest). When the first persist ends, the ranks' newest committed steps differ and rank 1's
    is gone from rank 0: the chain must not pick it (no rank fails a persist), and every
    durable step it commits loads."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    delays = {durable: 1.0}
    if world.rank == 1:
        delays[mine] = 0.3
    engine = Engine(host_cache_size="8MiB", io_backend=SlowFsync(delays), io_workers=2)
    errors: list[str] = []
    try:
        manager = CheckpointManager(durable, memory_dir=mine, keep_memory=1, keep_durable=None,
                                    replicate=replicate, engine=engine)
        try:
            for step in range(1, 9):
                manager.save(step, rank_state(world.rank, step))
                time.sleep(0.05)
            err = error_of(manager.wait)
            with collecting(errors, "wait"):
                assert err is None, repr(err)
        finally:
            err = error_of(manager.close)
        with collecting(errors, "close"):
            assert err is None, repr(err)
        done = committed_steps(durable)
        with collecting(errors, "durable steps"):
            assert done and done[0] == 1 and done[-1] == 8, done
        for step in done:
            out = blank_like(rank_state(world.rank, step))
            dcp.load(out, checkpoint_id=durable / f"step_{step}",
                     storage_reader=DataStatesReader(engine=engine))
            check(errors, f"durable step {step}", out, rank_state(world.rank, step))
    finally:
        engine.close()
        engine.io.close()
    agree(errors, f"persist='idle' chain with ranks at different steps ({world.size} ranks)")


def test_idle_persist_failing_on_one_rank_stops_every_rank_chain(world: World, nodes: Path,
                                                                shared: Path) -> None:
    """persist='idle': step 2's persist fails on rank 1 only. Every rank leaves the chain at
    the same point (no rank waits in a collective of the persist group), rank 1 alone reports
    the error, step 2 is no durable checkpoint, and the next save persists as before."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    io = SlowFsync({durable: 0.2})
    engine = Engine(host_cache_size="8MiB", io_backend=io, io_workers=2)
    errors: list[str] = []
    try:
        manager = CheckpointManager(durable, memory_dir=mine, keep_memory=2, engine=engine)
        try:
            manager.save(1, rank_state(world.rank, 1))
            with collecting(errors, "save 1"):
                assert error_of(manager.wait) is None
            dist.barrier()
            if world.rank == 1:
                io.failing = str(durable / "step_2") + "/"
            manager.save(2, rank_state(world.rank, 2))
            err = error_of(manager.wait)
            with collecting(errors, "save 2"):
                if world.rank == 1:
                    assert isinstance(err, OSError) and "injected EIO" in str(err), repr(err)
                else:
                    assert err is None, repr(err)
            io.failing = None
            manager.save(3, rank_state(world.rank, 3))
            with collecting(errors, "save 3"):
                assert error_of(manager.wait) is None
        finally:
            err = error_of(manager.close)
        with collecting(errors, "close"):
            assert err is None, repr(err)
        dist.barrier()
        with collecting(errors, "durable steps"):
            assert committed_steps(durable) == [1, 3], committed_steps(durable)
    finally:
        engine.close()
        io.close()
    agree(errors, f"a persist failing on rank 1 of {world.size}")


def test_going_back_sets_the_newer_steps_aside_on_every_rank(world: World, nodes: Path,
                                                             shared: Path,
                                                             engine: Engine) -> None:
    """load(step=1) with steps 2 and 3 persisted, then saves of 2 and 3 again: every rank
    drops its newer memory steps (and the replicas it holds), rank 0 moves the durable ones
    aside, and the new run's steps 2 and 3 are what the durable tier holds afterwards."""
    durable = shared / "durable"
    errors: list[str] = []
    with CheckpointManager(durable, memory_dir=nodes / f"node_{world.rank}", keep_memory=5,
                           keep_durable=None, persist=1, replicate=True,
                           engine=engine) as manager:
        for step in (1, 2, 3):
            manager.save(step, rank_state(world.rank, step))
            manager.wait()
        out = blank_like(rank_state(world.rank, 1))
        assert manager.load(out, step=1) == 1
        for step in (2, 3):
            manager.save(step, rank_state(world.rank, 10 + step))
            manager.wait()
        with collecting(errors, "latest step and memory after going back"):
            assert manager.latest_step() == 3
            out = blank_like(rank_state(world.rank, 13))
            assert manager.load(out, step=3) == 3
            assert_state_equal(out, rank_state(world.rank, 13))
    agree(errors, "going back")
    with collecting(errors, "durable tier after going back"):
        assert committed_steps(durable) == [1, 2, 3]
        (aside,) = (durable / ".abandoned").iterdir()
        assert committed_steps(aside) == [2, 3]
        got = {f"rank{world.rank}": blank_like(rank_state(world.rank, 13))[f"rank{world.rank}"]}
        dcp.load(got, checkpoint_id=durable / "step_3", storage_reader=DataStatesReader())
        assert_state_equal(got, {k: v for k, v in rank_state(world.rank, 13).items()
                                 if k == f"rank{world.rank}"})
    agree(errors, "durable tier after going back")


def test_a_save_again_failing_on_one_rank_keeps_the_step_on_every_rank(world: World, nodes: Path,
                                                                     shared: Path,
                                                                     engine: Engine) -> None:
    """Step 1 persisted, then saved again with a state rank 1's memory tier has no room for:
    no rank takes the new save (the ranks that committed it drop it, their handles say why),
    and step 1 loads with its first state on every rank, never a mix of the two saves."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "durable"
    limit = 3 << 20 if world.rank == 1 else None

    errors: list[str] = []
    manager = CheckpointManager(durable, memory_dir=mine, memory_limit=limit, keep_memory=1,
                                persist=1, engine=engine)
    try:
        manager.save(1, big_or_small(world.rank, 1, big=False))
        manager.wait()
        again = manager.save(1, big_or_small(world.rank, 2, big=True))
        with collecting(errors, "save again"):
            err = again.committed.exception(timeout=30)
            if world.rank == 1:
                assert isinstance(err, TierFullError), err
            else:
                assert isinstance(err, CheckpointError), err
                assert "committed on this rank but not on every rank" in str(err), str(err)
            assert again.persisted is None
        error_of(manager.wait)
        latest = manager.latest_step()
        out = blank_like(big_or_small(world.rank, 1, big=False))
        loaded = manager.load(out)
        with collecting(errors, "restore"):
            assert (latest, loaded) == (1, 1)
            assert_state_equal(out, big_or_small(world.rank, 1, big=False))
    finally:
        error_of(manager.close)
    with collecting(errors, "tiers"):
        assert committed_steps(durable) == [1]
        assert committed_steps(mine) == ([1] if world.rank == 1 else [])
    agree(errors, f"a save again failing on rank 1 of {world.size}")


# -- one manager per tier directory: the durable tier is the job's -------------------------------
def test_one_job_claims_the_durable_tier_each_rank_its_memory_tier(
        world: World, nodes: Path, shared: Path, engine: Engine) -> None:
    """Every rank of a job shares the durable tier (one claim for the job, through rank 0),
    each has its own memory tier: the job's manager starts on every rank; a second manager of
    the job on the same durable tier fails on every rank, naming the directory and the pid of
    rank 0 (the holder), and the first one goes on persisting."""
    durable = shared / "durable"
    holder = broadcast_object(os.getpid() if world.rank == 0 else None)
    errors: list[str] = []
    with CheckpointManager(durable, memory_dir=nodes / f"node_{world.rank}", persist=1,
                           engine=engine) as manager:
        err = error_of(lambda: CheckpointManager(
            durable, memory_dir=nodes / f"other_{world.rank}", engine=engine))
        with collecting(errors, "second manager"):
            assert isinstance(err, CheckpointError), err
            assert (f"durable tier {durable} is in use by another CheckpointManager "
                    f"(pid {holder}") in str(err), str(err)
        handle = manager.save(1, rank_state(world.rank, 1))
        with collecting(errors, "save"):
            handle.result(timeout=60)
    with collecting(errors, "persisted"):
        assert committed_steps(durable) == [1]
    agree(errors, f"one claim of the durable tier on {world.size} ranks")


def test_a_tier_swapped_on_one_rank_fails_every_rank(world: World, nodes: Path, shared: Path,
                                                     engine: Engine) -> None:
    """The last rank's memory tier is renamed away and another directory put in its place
    between two calls: ``load`` and ``close`` fail on every rank (none is left waiting in a
    collective), naming that rank and its tier."""
    last = world.size - 1
    memory = nodes / f"node_{world.rank}"
    manager = CheckpointManager(shared / "durable", memory_dir=memory, persist=None,
                                engine=engine)
    manager.save(1, rank_state(world.rank, 1)).result(timeout=60)
    manager.wait()
    if world.rank == last:
        memory.rename(nodes / "away")
        memory.mkdir(mode=0o700)
    dist.barrier()
    swap = f"memory tier {nodes / f'node_{last}'} is no longer the directory"
    mine = "" if world.rank == last else f"rank {last}: "
    errors: list[str] = []
    for call in (lambda: manager.load(rank_state(world.rank, 0)), manager.close):
        err = error_of(call)
        with collecting(errors, "swapped tier"):
            assert isinstance(err, CheckpointError) and str(err).startswith(mine + swap), err
    agree(errors, f"a tier swapped on rank {last} of {world.size}")


# -- a manager not closed ------------------------------------------------------------------------
def test_engine_close_finishes_an_unclosed_manager_without_collectives(
        world: World, nodes: Path, shared: Path, logs) -> None:
    """Several ranks, a manager never closed, then its engine closed (as at interpreter exit):
    on each rank alone its saves are committed in memory, and the step the durable tier lacks
    is named in one warning (no rank waits for the others there)."""
    mine = nodes / f"node_{world.rank}"
    durable = shared / "unclosed"
    engine = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    manager = CheckpointManager(durable, memory_dir=mine, persist=3, engine=engine)
    handles = [manager.save(step, rank_state(world.rank, step)) for step in (1, 2)]
    engine.close()  # finishes the manager: no collective, so ranks need not be in step
    errors: list[str] = []
    with collecting(errors, "unclosed manager"):
        assert all(h.committed.done() and h.committed.exception() is None for h in handles)
        assert committed_steps(mine) == [1, 2]
        assert committed_steps(durable) == []
        warned = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING
                  and "CheckpointManager was not closed: step 2" in r.getMessage()]
        assert len(warned) == 1 and str(mine) in warned[0], warned
    agree(errors, "a manager not closed, on several ranks")


def test_replicas_made_under_a_lax_umask_are_private(world: World, nodes: Path,
                                                     engine: Engine) -> None:
    """Under umask 002 the replica directories a manager makes (``replicas/``,
    ``replicas/rank_<r>/``, their steps) are 0700 all the same, so a restart takes them (it
    refuses group-writable ones)."""
    mine = nodes / f"node_{world.rank}"
    old = os.umask(0o002)
    try:
        with CheckpointManager(None, memory_dir=mine, replicate=True, engine=engine) as manager:
            manager.save(1, rank_state(world.rank, 1))
            manager.wait()
    finally:
        os.umask(old)
    errors: list[str] = []
    replicas = mine / "replicas"
    made = [replicas, *replicas.iterdir(), *replicas.glob("rank_*/step_*")]
    modes = {str(p): oct(p.stat().st_mode & 0o777) for p in made}
    if len(made) != 3 or set(modes.values()) != {"0o700"}:
        errors.append(f"replica directories: {modes}")
    restart = error_of(lambda: CheckpointManager(None, memory_dir=mine, replicate=True,
                                                 engine=engine).close())
    if restart is not None:
        errors.append(f"restart: {restart}")
    agree(errors, "replica directories made under umask 002")
