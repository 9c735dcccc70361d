"""A manager restarted on what an earlier run left: on another number of ranks (the durable tier
reshards; the memory tier, one rank's shards each, is not used), with a new durable directory
beside an old memory tier, and with hostile ``.tier.json`` records.

The job on several ranks is real: ``tests/tiers/reshard_job.py`` under torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import MARKS, ROOT, Tiers, assert_state_equal, blank_like
from helpers.tiers import make_state, steps_in

from dcp_datastates import (
    CheckpointManager,
    DataStatesWriter,
    Engine,
    WorldSizeChangedError,
)
from dcp_datastates import (
    _cli as cli,
)
from dcp_datastates.tiers._manager import _default_memory_dir
from dcp_datastates.tiers._steps import TierRecord

pytestmark = MARKS

JOB = Path(__file__).with_name("reshard_job.py")


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)


def saved(tiers: Tiers, engine: Engine, *steps: int, persist: int | None = None) -> None:
    """Save ``steps`` into the tiers (with ``persist``) and close."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=persist,
                           engine=engine) as manager:
        for step in steps:
            manager.save(step, make_state(step)).result(timeout=60)


def as_if_saved_by(directory: Path, world: int) -> None:
    """Make the memory-tier step ``directory`` look like rank 0's of a job of ``world`` ranks."""
    record = TierRecord.read(directory)
    TierRecord(record.step, 0, world, record.pid).write(directory)


def job(ranks: int, mode: str, tiers: Tiers) -> tuple[str, str]:
    """``reshard_job.py MODE`` on ``ranks`` ranks (started as torchrun would, without its
    agent); every rank must exit cleanly. Rank 0's stdout, and every rank's stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(ranks))
    procs = [subprocess.Popen([sys.executable, str(JOB), mode, str(tiers.memory),
                               str(tiers.durable)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(ranks)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = "".join(err for _, err in outs)
    assert all(p.returncode == 0 for p in procs), errors[-4000:]
    return outs[0][0], errors


def test_a_restart_on_another_number_of_ranks_loads_the_durable_tier(
        tiers: Tiers, capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks save step 20 (persisted) and step 30 (memory only). A restart on one rank and
    on four loads step 20 from the durable tier, resharded, bit for bit, and warns why the
    memory tier was not used; steps 20 and 30 stay in the memory tiers. ``verify`` passes a
    memory-tier step (one rank's shards: not every element), saying it is one rank's part."""
    job(2, "save", tiers)
    step = tiers.memory / "rank_0" / "step_30"
    assert cli.main(["verify", "-q", str(step)]) == 0, capsys.readouterr().err
    assert "one rank's part" in capsys.readouterr().out
    for ranks in (1, 4):
        out, err = job(ranks, "load", tiers)
        assert out == "LOADED 20 True\n", (ranks, out, err[-4000:])
        tier = tiers.memory / "rank_0"
        assert (f"memory tier {tier}: step(s) 20, 30 not restored from it: saved by 2 "
                f"rank(s), this job has {ranks}") in err, err[-4000:]
    assert [steps_in(tiers.memory / f"rank_{r}") for r in (0, 1)] == [[20, 30], [20, 30]]


def test_a_restart_on_fewer_ranks_refuses_a_step_only_memory_holds(
        tiers: Tiers, engine: Engine) -> None:
    """Steps 5 and 6 that two ranks left in memory only (never persisted): a restart on one
    rank refuses them (they hold one rank's shards), naming its memory tier, both world sizes
    and how to go on; nothing is loaded. ``latest_step()`` raises the same error rather than
    say None: the README's restart line would start over and retention delete them."""
    saved(tiers, engine, 5, 6)
    for step in (5, 6):
        as_if_saved_by(tiers.memory / f"step_{step}", 2)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        with pytest.raises(WorldSizeChangedError) as latest:
            manager.latest_step()
        blank = blank_like(make_state(6))
        with pytest.raises(WorldSizeChangedError) as info:
            manager.load(blank)
    said = str(info.value)
    assert str(latest.value) == said
    assert (f"no tier holds a checkpoint that this job of 1 rank(s) can load: the memory tiers "
            f"(this rank's: {tiers.memory}) hold step(s) 5, 6 saved by 2 rank(s)") in said, said
    assert (f"python -m dcp_datastates persist <the memory tiers of every rank that saved "
            f"them, e.g. {tiers.memory.parent}> {tiers.durable}") in said, said
    assert_state_equal(blank, blank_like(make_state(6)))
    assert steps_in(tiers.memory) == [5, 6]


def test_a_step_whose_record_is_hostile_loads_from_the_durable_tier(
        tiers: Tiers, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A committed memory step whose ``.tier.json`` says pid Infinity: the restart loads the
    step from the durable tier and warns, naming the file and the field; an unfinished step
    whose record says pid 1e400 (or beyond a C long) is removed as one whose writer is gone."""
    saved(tiers, engine, 5, persist=1)
    record = tiers.memory / "step_5" / ".tier.json"
    record.write_text(record.read_text().replace('"pid": ', '"pid": Infinity, "was": '))
    for step, pid in ((6, "1e400"), (7, str(1 << 70))):
        (tiers.memory / f"step_{step}").mkdir()
        (tiers.memory / f"step_{step}" / ".tier.json").write_text(json.dumps(
            {"step": step, "rank": 0, "world_size": 1}).replace("}", f', "pid": {pid}}}'))
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                               engine=engine) as manager:
            blank = blank_like(make_state(5))
            assert manager.load(blank) == 5
    assert_state_equal(blank, make_state(5))
    assert (f"memory tier {tiers.memory}: step(s) 5 not restored from it: {record}: pid "
            f"Infinity is not an integer from 0 to 2147483647; step 5 is loaded from the other "
            f"tiers") in caplog.text, caplog.text
    assert not (tiers.memory / "step_6").exists() and not (tiers.memory / "step_7").exists()


@pytest.fixture
def run1(tmp_path: Path) -> Iterator[Path]:
    """A durable dir ``ckpt_run1`` whose default memory tiers are removed at the end."""
    durable = tmp_path / "ckpt_run1"
    yield durable
    shutil.rmtree(_default_memory_dir(durable, 0).parent, ignore_errors=True)


def test_a_new_durable_dir_beside_an_old_memory_tier_resumes_with_a_warning(
        run1: Path, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """``rm -rf ckpt_run1`` to start over: the default memory tier (named after it) still
    holds step 41, and the next run resumes from it, warning that the durable tier is new,
    naming the memory tier, the step and how to start over; the steps are never deleted. A
    restart after a crash before the first persist (the durable dir kept) gives no such
    warning, and doing as the warning says starts over."""
    root = _default_memory_dir(run1, 0).parent
    with CheckpointManager(run1, engine=engine) as first:
        first.save(41, make_state(41)).result(timeout=60)
    shutil.rmtree(run1 / "step_41")  # as if no persist had run: no warning
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        with CheckpointManager(run1, engine=engine) as again:
            assert again.load(blank_like(make_state(41))) == 41
    assert "is new" not in caplog.text, caplog.text
    shutil.rmtree(run1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        with CheckpointManager(run1, engine=engine) as fresh:
            blank = blank_like(make_state(41))
            assert fresh.load(blank) == 41
    assert_state_equal(blank, make_state(41))
    assert (f"resuming from step 41 of the memory tier {root / 'rank_0'}, though the durable "
            f"tier {run1} is new (no manager used it before: made anew, or removed to start "
            f"over) and holds no checkpoint. To start over instead, remove the memory tiers "
            f"too (rm -rf {root} on every node: the default ones, named after durable_dir), "
            f"and start again") in caplog.text, caplog.text
    shutil.rmtree(run1)
    shutil.rmtree(root)
    with CheckpointManager(run1, engine=engine) as over:
        assert over.latest_step() is None


def test_the_directories_a_manager_makes_are_private_whatever_the_umask(
        tiers: Tiers, engine: Engine) -> None:
    """Under umask 002 the memory tier, its parents, its step directories and its slot
    directory are made 0700; a manager restarted on them takes them."""
    old = os.umask(0o002)
    try:
        saved(tiers, engine, 5)
        saved(tiers, engine, 6)
    finally:
        os.umask(old)
    made = [tiers.memory.parent, tiers.memory, *tiers.memory.glob("step_*"),
            *tiers.memory.glob(".slots.*")]
    assert len(made) >= 4, made
    assert {p: oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {p: "0o700" for p in made}


def test_no_checkpoint_file_is_writable_by_others_whatever_the_umask(
        tiers: Tiers, engine: Engine) -> None:
    """Under umask 000, a plain ``dcp.save`` through ``DataStatesWriter`` and a manager's
    persisted and set-aside steps make no file or directory that group or others may write
    (one they could replace holds pickles that run at load)."""
    old = os.umask(0)
    try:
        plain = tiers.durable.parent / "plain"
        dcp.save(make_state(1), checkpoint_id=plain, storage_writer=DataStatesWriter(
            engine=engine))
        saved(tiers, engine, 5, persist=1)
        saved(tiers, engine, 5, persist=1)  # saved again: the replaced copy is set aside
    finally:
        os.umask(old)
    made = [p for root in (plain, tiers.durable) for p in (root, *root.rglob("*"))]
    assert len(made) >= 8 and any(p.name == ".metadata" for p in made), made
    writable = {p: oct(stat.S_IMODE(p.lstat().st_mode)) for p in made
                if p.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)}
    assert not writable, writable


def test_a_persist_none_run_restarts_without_the_new_durable_tier_warning(
        run1: Path, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A ``persist=None`` run never makes ``durable_dir``: its restart resumes from its memory
    tier without warning that the durable tier is new (it would on every restart)."""
    with CheckpointManager(run1, persist=None, engine=engine) as first:
        first.save(7, make_state(7)).result(timeout=60)
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        with CheckpointManager(run1, persist=None, engine=engine) as again:
            assert again.load(blank_like(make_state(7))) == 7
    assert not run1.exists()
    assert "is new" not in caplog.text, caplog.text
