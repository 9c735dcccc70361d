"""``python -m dcp_datastates persist``: a step that a killed job left committed in its memory
tiers, persisted from outside the job, on one rank and on two (all tiers, one node's tiers with
a peer's replica, one node at a time with ``--partial``); bad input refused before anything is
written; a step already persisted left alone.

The jobs are real: CheckpointManager(persist=None) in child processes (two gloo ranks for the
multi-rank cases) that commit into the memory tier and are then killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    MARKS,
    ROOT,
    TESTS,
    Tiers,
    assert_state_equal,
    data_files,
    load_into,
    raises_in_dcp,
)
from helpers.tiers import make_state, persist, run_and_kill, run_cli, steps_in

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates.tiers._steps import name_steps

MiB = 1 << 20

pytestmark = MARKS


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def same_files(a: Path, b: Path) -> None:
    """The data files of ``a`` and ``b`` have the same names and bytes."""
    fa, fb = data_files(a), data_files(b)
    assert [p.name for p in fa] == [p.name for p in fb]
    for x, y in zip(fa, fb, strict=True):
        assert x.read_bytes() == y.read_bytes(), f"{y} differs from {x}"


# -- one rank ------------------------------------------------------------------------------------
def test_persist_after_kill_9(tiers: Tiers) -> None:
    """A process killed after a memory commit (persist=None): ``python -m dcp_datastates
    persist`` copies the step to the durable tier, where DataStatesReader loads it exactly;
    a second run finds nothing to do."""
    expected = make_state(7, big=MiB + 5)
    run_and_kill("commit", tiers, 7, MiB + 5, "COMMITTED")
    assert steps_in(tiers.memory) == [7] and not tiers.durable.exists()

    done = run_cli(tiers.memory, tiers.durable)
    assert done.returncode == 0, done.stderr
    target = tiers.durable / "step_7"
    assert done.stdout.startswith("persisted step 7 (1 of 1 rank(s), ")
    assert f"to {target}; it is committed" in done.stdout
    assert steps_in(tiers.durable) == [7]
    assert not list(target.glob(".part.*"))
    same_files(tiers.memory / "step_7", target)
    assert_state_equal(load_into(expected, target), expected)
    assert steps_in(tiers.memory) == [7], "the memory tier is left as it was"

    again = run_cli(tiers.memory, tiers.durable)
    assert again.returncode == 0, again.stderr
    assert again.stdout == (f"nothing to persist: the newest complete step in memory, 7, is "
                            f"not newer than step 7 in {tiers.durable}\n")
    again = run_cli(tiers.memory, tiers.durable, "--step", 7)
    assert (again.returncode, again.stdout) == (
        0, f"nothing to persist: step 7 is already persisted in {target}\n")
    assert_state_equal(load_into(expected, target), expected)


def test_persist_an_older_step_and_home_paths(tiers: Tiers, engine: Engine,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--step`` picks an older step; ``~`` is expanded in both directories."""
    states = {s: make_state(s) for s in (2, 4)}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        for s, state in states.items():
            manager.save(s, state).result(timeout=60)
    monkeypatch.setenv("HOME", str(tiers.memory.parent))
    code, out, err = persist(capsys, engine, "~/memory", "~/durable", "--step", 2)
    assert code == 0, err
    assert f"to {tiers.memory.parent / 'durable' / 'step_2'}; it is committed" in out
    assert_state_equal(load_into(states[2], tiers.memory.parent / "durable" / "step_2"),
                       states[2])


# -- bad input -----------------------------------------------------------------------------------
@pytest.fixture
def one_step(tiers: Tiers, engine: Engine) -> dict:
    """A memory tier holding step 5 (persist=None: the durable tier holds nothing)."""
    state = make_state(5)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        manager.save(5, state).result(timeout=60)
    return state


def test_bad_input_is_refused_before_writing(tiers: Tiers, engine: Engine, one_step: dict,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    missing = tiers.scratch / "nope"
    step5 = tiers.memory / "step_5"
    tiers.scratch.mkdir(parents=True)
    (tiers.scratch / "file").write_text("x")
    (tiers.scratch / "empty").mkdir()
    cases = [
        ((missing, tiers.durable), f"error: memory tier {missing} does not exist"),
        ((tiers.scratch / "file", tiers.durable),
         f"error: memory tier {tiers.scratch / 'file'} is not a directory"),
        ((tiers.scratch / "empty", tiers.durable),
         f"error: {tiers.scratch / 'empty'} is not a memory tier: it holds no step_<N> "
         f"directories"),
        ((step5, tiers.durable), f"error: {step5} is one checkpoint of a memory tier; give the "
                                 f"tier {tiers.memory} (and --step to pick the step)"),
        ((tiers.memory, tiers.durable, "--step", 6),
         f"error: no memory tier in {tiers.memory} holds a committed checkpoint of step 6 "
         f"(committed there: 5)"),
        ((tiers.memory, tiers.scratch / "file"),
         f"error: durable tier {tiers.scratch / 'file'} is not a directory"),
        ((tiers.memory, missing / "durable"),
         f"error: durable tier {missing / 'durable'}: its parent directory {missing} does not "
         f"exist"),
        ((tiers.memory, tiers.memory / "durable"),
         f"error: durable tier {tiers.memory / 'durable'} is the memory tier {tiers.memory} or "
         f"inside it"),
        ((tiers.memory, tiers.durable, "--partial"),
         "error: --partial needs --step: every node must persist the same step"),
    ]
    for args, message in cases:
        code, out, err = persist(capsys, engine, *args)
        assert (code, out) == (1, ""), (args, out, err)
        assert err.startswith(message), (args, err)
    with pytest.raises(SystemExit) as exc:  # argparse: a usage error
        persist(capsys, engine, tiers.memory, tiers.durable, "--step", -1)
    assert exc.value.code == 2
    assert "error: argument --step: not a non-negative integer: '-1'" in capsys.readouterr().err
    assert not tiers.durable.exists(), "nothing may be written for bad input"
    assert not (tiers.memory / "durable").exists()


def test_uncommitted_and_damaged_steps_are_refused(tiers: Tiers, engine: Engine, one_step: dict,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A step whose save never committed (no .metadata) is not persisted; a damaged one (a
    truncated data file) is refused before anything is written; repaired, it persists."""
    step5 = tiers.memory / "step_5"
    (data,) = data_files(step5)
    good = data.read_bytes()
    os.truncate(data, len(good) // 2)
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert (code, out) == (1, "")
    assert err.startswith(
        f"error: no step is complete in {tiers.memory}: step 5 lacks rank(s) 0 of 1 ({step5} is "
        f"unusable ({step5}/{data.name}: {len(good) // 2} bytes where .metadata needs ")
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable, "--step", 5)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: step 5 lacks rank(s) 0 of 1 ({step5} is unusable (")
    assert not tiers.durable.exists()

    data.write_bytes(good)
    (tiers.memory / "step_6").mkdir()  # a save killed before it committed
    (tiers.memory / "step_6" / "junk").write_bytes(b"x")
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable, "--step", 6)
    assert (code, out) == (1, "")
    assert err == (f"error: no memory tier in {tiers.memory} holds a committed checkpoint of "
                   f"step 6 (committed there: 5; {tiers.memory / 'step_6'}: never committed (the "
                   f"save did not finish))\n")
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert code == 0 and out.startswith("persisted step 5 "), err
    assert f"note: {tiers.memory / 'step_6'} was never committed" in err
    assert_state_equal(load_into(one_step, tiers.durable / "step_5"), one_step)


def test_quiet_persist_prints_no_notes_but_its_errors(
        tiers: Tiers, engine: Engine, one_step: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """``-q``: the note on a step passed over (never committed) is not printed; an error is."""
    (tiers.memory / "step_6").mkdir()  # a save killed before it committed
    code, out, err = persist(capsys, engine, "-q", tiers.memory, tiers.durable, "--step", 6)
    assert (code, out) == (1, "")
    assert err.startswith(f"error: no memory tier in {tiers.memory} holds a committed "
                          f"checkpoint of step 6"), err
    code, out, err = persist(capsys, engine, "-q", tiers.memory, tiers.durable)
    assert (code, err) == (0, "")
    assert out.startswith("persisted step 5 ")
    assert_state_equal(load_into(one_step, tiers.durable / "step_5"), one_step)


def test_a_persist_resumed_after_a_kill_in_its_commit_leaves_no_temporary(
        tiers: Tiers, engine: Engine, one_step: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """A persist killed while it wrote the step's ``.metadata`` leaves a
    ``.metadata.tmp.<token>``: the persist that resumes it removes it once it has committed."""
    target = tiers.durable / "step_5"
    target.mkdir(parents=True)
    (target / ".metadata.tmp.0123456789abcdef").write_bytes(b"a commit that was killed")
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert code == 0 and out.startswith("persisted step 5 "), err
    (data,) = data_files(target)
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [".dcp_datastates.lock", ".metadata", data.name])
    assert_state_equal(load_into(one_step, target), one_step)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("world_size", "1000000000000", "world_size 1000000000000 is not an integer from 1 to 1048576"),
    ("world_size", "0", "world_size 0 is not an integer from 1 to 1048576"),
    ("world_size", '"2"', "world_size '2' is not an integer from 1 to 1048576"),
    ("pid", "1e400", "pid 1e400 is not an integer from 0 to 2147483647"),
    ("pid", "Infinity", "pid Infinity is not an integer from 0 to 2147483647"),
    ("pid", "NaN", "pid NaN is not an integer from 0 to 2147483647"),
    ("pid", str(1 << 70), f"pid {1 << 70} is not an integer from 0 to 2147483647"),
    ("step", "-Infinity", "step -Infinity is not an integer from 0 to 9223372036854775807"),
    ("step", str(1 << 64), f"step {1 << 64} is not an integer from 0 to 9223372036854775807"),
    ("step", "5.0", "step 5.0 is not an integer from 0 to 9223372036854775807"),
    ("rank", "true", "rank True is not an integer from 0 to 0"),
    ("rank", "-1", "rank -1 is not an integer from 0 to 0"),
])
def test_a_hostile_tier_record_fails_at_once(
        tiers: Tiers, engine: Engine, one_step: dict, capsys: pytest.CaptureFixture[str],
        field: str, value: str, named: str) -> None:
    """A ``.tier.json`` whose number is no integer (a fraction, ``1e400``, ``Infinity``, a
    string, a bool) or out of bounds (10**12 ranks, whose listing would never end; a pid or
    step beyond a C long): refused within a second, naming the file, the field and its bounds;
    nothing written."""
    record = tiers.memory / "step_5" / ".tier.json"
    fields = {k: json.dumps(v) for k, v in json.loads(record.read_text()).items()}
    fields[field] = value
    record.write_text("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    start = time.monotonic()
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert time.monotonic() - start < 1.0
    assert (code, out, err) == (1, "", f"error: {record}: {named}\n")
    assert not tiers.durable.exists()


def test_persist_into_a_torchtitan_folder(tiers: Tiers, engine: Engine, one_step: dict,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A durable tier that names its steps as torchtitan does (set up by the torchtitan
    adapter) gets step-<N>."""
    name_steps(tiers.durable, "step-")
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert code == 0, err
    assert f"to {tiers.durable / 'step-5'}; it is committed" in out
    assert sorted(p.name for p in tiers.durable.iterdir() if p.name.startswith("step")) == [
        "step-5"]
    assert_state_equal(load_into(one_step, tiers.durable / "step-5"), one_step)


# -- two ranks -----------------------------------------------------------------------------------
_RANK_CHILD = textwrap.dedent(
    """
    import sys
    import time
    sys.path[:0] = [{tests!r}, {tests!r} + "/tiers"]
    import torch.distributed as dist
    from test_tiers_cli import rank_state
    from dcp_datastates import CheckpointManager, Engine

    rank, root, durable, init = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    engine = Engine(io_backend="threads", host_cache_size="8MiB")
    manager = CheckpointManager(durable, memory_dir=f"{{root}}/rank_{{rank}}", persist=None,
                                replicate=True, engine=engine)
    for step in (3, 5):
        manager.save(step, rank_state(rank, step))
        manager.wait()  # committed in memory, and replicated to the peer
    print("COMMITTED", flush=True)
    time.sleep(600)  # the test kills us
    """
)


def rank_state(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step``: its own items (named by rank) and one both share."""
    own = make_state(100 * rank + step, big=MiB // 2 + rank)
    return {f"rank{rank}": own, "shared": {"step": torch.tensor(step)}}


def job_state(step: int) -> dict:
    """What the durable checkpoint of ``step`` holds: both ranks' items."""
    return {**rank_state(0, step), **rank_state(1, step)}


def run_job_and_kill(tiers: Tiers) -> Path:
    """Two gloo ranks save steps 3 and 5 into their memory tiers (``<root>/rank_<r>``, each
    with the peer's replicas), then both are killed with SIGKILL. Returns the root."""
    root = tiers.memory
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    tiers.scratch.mkdir(parents=True, exist_ok=True)
    init = f"file://{tiers.scratch / 'rendezvous'}"
    children, errs = [], []
    try:
        for rank in range(2):
            errs.append(tiers.scratch / f"rank{rank}.err")
            with open(errs[-1], "w") as errfile:
                children.append(subprocess.Popen(
                    [sys.executable, "-c", _RANK_CHILD.format(tests=str(TESTS)), str(rank),
                     str(root), str(tiers.durable), init],
                    stdout=subprocess.PIPE, stderr=errfile, env=env, text=True))
        for child, err in zip(children, errs, strict=True):
            ready, _, _ = select.select([child.stdout], [], [], 120)
            line = child.stdout.readline() if ready else ""
            assert line.strip() == "COMMITTED", (line, child.poll(), err.read_text()[-3000:])
        for child in children:
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(30) == -signal.SIGKILL
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
    for rank in range(2):
        assert steps_in(root / f"rank_{rank}") == [3, 5]
        assert steps_in(root / f"rank_{rank}" / "replicas" / f"rank_{1 - rank}") == [3, 5]
    assert not tiers.durable.exists()
    return root


@pytest.fixture
def killed_job(tiers: Tiers) -> Path:
    return run_job_and_kill(tiers)


def test_persist_a_killed_two_rank_job(tiers: Tiers, engine: Engine, killed_job: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The job's memory root (both ranks' tiers): the newest step, 5, is persisted as one
    checkpoint of the job (one .metadata merged from both ranks'), loaded exactly; then step
    3 with --step."""
    code, out, err = persist(capsys, engine, killed_job, tiers.durable)
    assert code == 0, err
    target = tiers.durable / "step_5"
    assert out.startswith("persisted step 5 (2 of 2 rank(s), ")
    assert f"to {target}; it is committed" in out
    assert steps_in(tiers.durable) == [5] and not list(target.glob(".part.*"))
    assert len(data_files(target)) == 2
    files = {loc.file for loc in read_metadata(target).storage_data.values()}
    assert files == {p.name for p in data_files(target)}
    expected = job_state(5)
    assert_state_equal(load_into(expected, target), expected)

    code, out, err = persist(capsys, engine, killed_job / "rank_1", killed_job / "rank_0",
                             tiers.durable, "--step", 3)
    assert code == 0 and out.startswith("persisted step 3 (2 of 2 rank(s), "), err
    assert_state_equal(load_into(job_state(3), tiers.durable / "step_3"), job_state(3))


def test_one_node_lost_persists_from_the_peer_replica(tiers: Tiers, engine: Engine,
                                                      killed_job: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's memory is gone (its node rebooted): rank 0's tier holds a replica of rank 1's
    checkpoint, so rank 0's tier alone persists the whole step."""
    shutil.rmtree(killed_job / "rank_1")
    code, out, err = persist(capsys, engine, killed_job, tiers.durable)
    assert code == 0 and out.startswith("persisted step 5 (2 of 2 rank(s), "), err
    replica = killed_job / "rank_0" / "replicas" / "rank_1" / "step_5"
    assert f"note: rank 1's checkpoint of step 5 comes from the replica {replica}" in err
    expected = job_state(5)
    assert_state_equal(load_into(expected, tiers.durable / "step_5"), expected)


def test_one_node_at_a_time_with_partial(tiers: Tiers, engine: Engine, killed_job: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """No replicas: one rank's tier is an incomplete step (refused); with --partial each node
    writes its part and the second commits the step."""
    for rank in range(2):
        shutil.rmtree(killed_job / f"rank_{rank}" / "replicas")
    rank0, rank1 = killed_job / "rank_0", killed_job / "rank_1"
    target = tiers.durable / "step_5"
    code, out, err = persist(capsys, engine, rank0, tiers.durable)
    assert (code, out) == (1, "")
    assert (f"error: no step is complete in {rank0}: step 5 lacks rank(s) 1 of 2; step 3 "
            f"lacks rank(s) 1 of 2" in err)
    code, out, err = persist(capsys, engine, rank0, tiers.durable, "--step", 5)
    assert (code, out) == (1, "")
    assert err.startswith("error: step 5 lacks rank(s) 1 of 2: give every rank's memory tier "
                          "(or a peer's replica), or --partial")
    assert not target.exists(), "an incomplete step is refused before anything is written"

    code, out, err = persist(capsys, engine, rank0, tiers.durable, "--step", 5, "--partial")
    assert code == 0, err
    assert out.startswith("wrote the part(s) of rank(s) 0 of step 5 (1 of 2 rank(s), ")
    assert "it is committed once rank(s) 1 add theirs" in out
    assert steps_in(tiers.durable) == [] and (target / ".part.0").is_dir()
    with raises_in_dcp(FileNotFoundError, r"\.metadata is missing"):
        load_into(job_state(5), target)

    code, out, err = persist(capsys, engine, rank1, tiers.durable, "--step", 5, "--partial")
    assert code == 0 and out.startswith("persisted step 5 (1 of 2 rank(s), "), err
    assert steps_in(tiers.durable) == [5] and not list(target.glob(".part.*"))
    assert_state_equal(load_into(job_state(5), target), job_state(5))
    # rank 1 alone, without --partial: rank 0's part was in the durable step already; now it
    # is committed, so there is nothing to do
    code, out, err = persist(capsys, engine, rank1, tiers.durable, "--step", 5)
    assert (code, out) == (0, f"nothing to persist: step 5 is already persisted in {target}\n")
