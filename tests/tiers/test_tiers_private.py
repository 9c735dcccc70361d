"""Tier directories belong to the user (``dcp_datastates.tiers._private``, ``.claims``): a tier
another user owns or may write is refused (it could hold planted steps), so is one under a
directory another user could rename it out of, a tier swapped after its check is refused at the
next call (nothing planted runs), a memory tier's files are out of other users' reach whatever
mode its directory had, the default memory root is per user and private, a tier is claimed by
a lock inside it (so a durable tier whose parent the user may not write is claimed too, and
nothing is left beside the tiers), an unwritable durable tier is refused when the manager is
made, and a refused claim names what holds it.

Permissions are set with ``os.chmod`` / ``os.chown``. Where the tests run as root (who writes
anywhere), what a user without write permission sees is run in a child process without the
capabilities that let root ignore permissions (``setpriv``).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import MARKS, ROOT, Tiers
from helpers.tiers import HoldWrites, make_state, persist, steps_in

from dcp_datastates import CheckpointError, CheckpointManager, Engine
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._claims import claimed, claimed_durable
from dcp_datastates.tiers._private import user_root

pytestmark = MARKS

#: A user id that is not this process's (``nobody`` on Debian).
OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def give_away(path: Path) -> None:
    """Make ``path`` and everything under it another user's."""
    for p in [path, *path.rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)


# -- another user's directories ------------------------------------------------------------------
@as_root
def test_a_memory_tier_another_user_made_is_refused_with_its_planted_step(
        tiers: Tiers, engine: Engine) -> None:
    """Another local user made the memory tier first and planted a committed step 99 there:
    the manager refuses the tier when it is made, saying whose it is and what to do; nothing
    of it is loaded, persisted or pruned."""
    with CheckpointManager(memory_dir=tiers.scratch / "planter", persist=None,
                           engine=engine) as planter:
        planter.save(99, make_state(99)).result(timeout=30)
    shutil.copytree(tiers.scratch / "planter", tiers.memory, symlinks=True)
    give_away(tiers.memory)
    with pytest.raises(CheckpointError, match=(
            rf"memory tier {tiers.memory} is owned by uid {OTHER_UID}\b.*not by this user "
            rf"\(uid {os.geteuid()}\b.*Use a directory of your own")):
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    assert steps_in(tiers.memory) == [99] and steps_in(tiers.durable) == []


@as_root
def test_a_durable_tier_or_replica_directory_of_another_user_is_refused(
        tiers: Tiers, engine: Engine) -> None:
    tiers.durable.mkdir(parents=True)
    give_away(tiers.durable)
    with pytest.raises(CheckpointError, match=rf"durable tier {tiers.durable} is owned by uid "
                                              rf"{OTHER_UID}\b"):
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    replicas = tiers.memory / "replicas" / "rank_1"
    replicas.mkdir(parents=True)
    give_away(replicas)
    with pytest.raises(CheckpointError, match=rf"replica directory of memory tier "
                                              rf"{replicas} is owned by uid {OTHER_UID}\b"):
        CheckpointManager(memory_dir=tiers.memory, engine=engine)


def test_a_tier_others_may_write_is_refused(tiers: Tiers, engine: Engine) -> None:
    """A memory tier writable by everyone (as a /dev/shm directory made 0777), a durable tier
    writable by its group, a replica directory writable by others: each is refused, naming
    who may write it and the chmod that makes it private; once private, it is used."""
    tiers.memory.mkdir(parents=True)
    os.chmod(tiers.memory, 0o777)
    with pytest.raises(CheckpointError, match=(
            rf"memory tier {tiers.memory} is writable by its group and others \(mode 0777\).*"
            rf"chmod go-w {tiers.memory}")):
        CheckpointManager(memory_dir=tiers.memory, engine=engine)
    os.chmod(tiers.memory, 0o755)
    tiers.durable.mkdir(parents=True)
    os.chmod(tiers.durable, 0o775)
    with pytest.raises(CheckpointError, match=rf"durable tier {tiers.durable} is writable by "
                                              rf"its group \(mode 0775\)"):
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    os.chmod(tiers.durable, 0o755)
    (tiers.memory / "replicas" / "rank_1").mkdir(parents=True)
    os.chmod(tiers.memory / "replicas" / "rank_1", 0o757)
    with pytest.raises(CheckpointError, match=r"replicas/rank_1 is writable by others"):
        CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    os.chmod(tiers.memory / "replicas" / "rank_1", 0o700)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
    assert steps_in(tiers.durable) == [1]


def test_the_default_memory_tier_is_under_a_private_root_of_the_user(
        tiers: Tiers, engine: Engine) -> None:
    """No memory_dir: the tier is ``/dev/shm/dcp_datastates-<uid>/<run>-<hash>/rank_0``, and
    the directories made for it are 0700 (no other user can list, plant or remove steps)."""
    manager = CheckpointManager(tiers.durable, engine=engine)
    try:
        run = manager.memory.parent
        assert run.parent == user_root() == Path(f"/dev/shm/dcp_datastates-{os.geteuid()}")
        assert manager.memory.name == "rank_0"
        for directory in (user_root(), run, manager.memory):
            st = directory.stat()
            assert st.st_uid == os.geteuid(), directory
            assert st.st_mode & 0o077 == 0, f"{directory}: {st.st_mode:o}"
        manager.save(1, make_state(1)).result(timeout=30)
        manager.close()
        assert steps_in(manager.memory) == [1] and steps_in(tiers.durable) == [1]
    finally:
        manager.close()
        shutil.rmtree(manager.memory.parent, ignore_errors=True)


# -- every directory above a tier, and a tier swapped ---------------------------------------------
@as_root
def test_a_tier_under_a_directory_another_user_owns_is_refused(tiers: Tiers,
                                                               engine: Engine) -> None:
    """The durable tier is ours, but a directory above it is another user's: he could rename
    the tier away and put his own (a planted step) in its place. Refused when the manager is
    made, naming that directory, its owner and its mode; so is a memory tier reached through
    a symbolic link in such a directory, or through another user's link in a sticky one."""
    theirs = tiers.durable.parent / "bob"
    durable = theirs / "alice"
    durable.mkdir(parents=True)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(CheckpointError, match=(
            rf"durable tier {durable}: the directory {theirs} above it is owned by uid "
            rf"{OTHER_UID}\b.*\(mode 0755\), who could rename the tier away and put another "
            rf"in its place")):
        CheckpointManager(durable, memory_dir=tiers.memory, engine=engine)
    link = tiers.scratch / "bob" / "link"
    link.parent.mkdir(parents=True)
    link.symlink_to(tiers.memory.parent)
    os.chown(link.parent, OTHER_UID, OTHER_UID)
    with pytest.raises(CheckpointError, match=(
            rf"memory tier {link / 'memory'}: the directory {link.parent} above it is owned "
            rf"by uid {OTHER_UID}\b")):
        CheckpointManager(memory_dir=link / "memory", engine=engine)
    sticky = tiers.scratch / "tmp"
    sticky.mkdir(mode=0o1777)
    os.chmod(sticky, 0o1777)
    (sticky / "theirs").symlink_to(tiers.memory.parent)  # another's entry in a sticky /tmp
    os.chown(sticky / "theirs", OTHER_UID, OTHER_UID, follow_symlinks=False)
    with pytest.raises(CheckpointError, match=(
            rf"memory tier {sticky / 'theirs' / 'memory'}: {sticky / 'theirs'} is owned by uid "
            rf"{OTHER_UID}\b.*, in {sticky} that others may write")):
        CheckpointManager(memory_dir=sticky / "theirs" / "memory", engine=engine)


def test_a_tier_under_a_directory_others_may_write_is_refused_unless_sticky(
        tiers: Tiers, engine: Engine) -> None:
    """A directory above the tier that others may write and that is not sticky lets them
    rename the tier: refused, naming it and its mode; sticky (as /tmp), it is used."""
    shared = tiers.durable.parent / "shared"
    durable = shared / "alice"
    durable.mkdir(parents=True)
    os.chmod(shared, 0o777)
    with pytest.raises(CheckpointError, match=(
            rf"durable tier {durable}: the directory {shared} above it is writable by its "
            rf"group and others \(mode 0777\) and not sticky")):
        CheckpointManager(durable, memory_dir=tiers.memory, engine=engine)
    os.chmod(shared, 0o1777)
    with CheckpointManager(durable, memory_dir=tiers.memory, engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
    assert steps_in(durable) == [1]


class Planted:
    """A bytes item whose pickle, run, makes the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("swapped", ["durable", "memory"])
def test_a_tier_swapped_after_its_check_is_refused_and_nothing_planted_runs(
        tiers: Tiers, engine: Engine, swapped: str) -> None:
    """Between two calls of the manager, its tier is renamed away and another is put in its
    place, holding a newer step whose bytes item would run code: ``load``, ``latest_step``,
    ``save`` and ``close`` refuse, naming the tier; the planted pickle never runs and nothing
    is written into the planted directory."""
    tier = tiers.durable if swapped == "durable" else tiers.memory
    marker, planted = tiers.scratch / "pwned", tier.parent / "planted"
    bad = make_state(9)
    bad["extra"]["tag"] = Planted(marker)
    planter_dirs = ((planted, tiers.scratch / "bob") if swapped == "durable" else
                    (tiers.scratch / "bob", planted))
    with CheckpointManager(planter_dirs[0], memory_dir=planter_dirs[1], engine=engine) as bob:
        bob.save(9, bad).result(timeout=30)
    marker.unlink()  # the planter's own save copies the state, running it
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
    try:
        manager.save(1, make_state(1)).result(timeout=30)
        manager.wait()
        tier.rename(tier.parent / "away")
        planted.rename(tier)
        swap = rf"{swapped} tier {tier} is no longer the directory this manager checked"
        with pytest.raises(CheckpointError, match=swap):
            manager.load(make_state(0))
        with pytest.raises(CheckpointError, match=swap):
            manager.latest_step()
        with pytest.raises(CheckpointError, match=swap):
            manager.save(2, make_state(2))
    finally:
        with pytest.raises(CheckpointError, match=swap):
            manager.close()
    assert not marker.exists(), "a planted step's pickle ran"
    assert steps_in(tier) == [9] and steps_in(tier.parent / "away") == [1]


def test_a_durable_tier_swapped_while_a_persist_waits_is_not_written(tiers: Tiers) -> None:
    """The durable tier is swapped while a persist waits for its step's memory commit (held
    by the I/O backend): the persist fails saying so, and writes nothing into the directory
    now there."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=hold, host_cache_size="8MiB", io_workers=4)
    try:
        manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine)
        handle = manager.save(1, make_state(1))
        assert hold.held.wait(30)
        tiers.durable.rename(tiers.durable.parent / "away")
        tiers.durable.mkdir()
        hold.gate.set()
        assert handle.persisted is not None
        with pytest.raises(CheckpointError, match=(
                rf"durable tier {tiers.durable} is no longer the directory this manager")):
            handle.persisted.result(timeout=30)
        with pytest.raises(CheckpointError, match="no longer the directory"):
            manager.close()
    finally:
        hold.gate.set()
        engine.close()
    assert os.listdir(tiers.durable) == [] and steps_in(tiers.memory) == [1]


def test_a_memory_tier_made_readable_holds_nothing_others_can_read(tiers: Tiers,
                                                                    engine: Engine) -> None:
    """``memory_dir`` made with ``mkdir`` under umask 022 (mode 0755): the manager makes it
    0700, so nothing it writes there is within other users' reach; as root, a process of
    another user reads none of the tier's files."""
    old = os.umask(0o022)
    try:
        tiers.memory.mkdir(parents=True)
        assert stat.S_IMODE(tiers.memory.stat().st_mode) == 0o755
        with CheckpointManager(memory_dir=tiers.memory, engine=engine) as manager:
            manager.save(1, make_state(1)).result(timeout=30)
    finally:
        os.umask(old)
    assert stat.S_IMODE(tiers.memory.stat().st_mode) == 0o700
    files = [str(p) for p in tiers.memory.rglob("*") if p.is_file()]
    assert len(files) >= 3 and steps_in(tiers.memory) == [1], files
    if os.geteuid() == 0:
        os.chmod(tiers.memory.parent, 0o755)  # what lies above the tier lets others through
        read = subprocess.run(
            ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
             "sh", "-c", 'for f; do cat "$f" >/dev/null 2>&1 && echo "$f"; done; exit 0', "sh",
             *files], capture_output=True, text=True, timeout=60)
        assert read.returncode == 0 and read.stdout == "", (read.stdout, read.stderr)


# -- claims inside the tier ----------------------------------------------------------------------
def test_no_lock_file_is_left_beside_the_tiers(tiers: Tiers, engine: Engine) -> None:
    """The claims live inside the tiers: once the manager is closed, the directories holding
    the tiers hold nothing but them."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
    assert sorted(os.listdir(tiers.memory.parent)) == ["memory"]
    assert sorted(os.listdir(tiers.durable.parent)) == ["durable"]


def test_cli_persist_refused_by_another_persist_names_it(tiers: Tiers, engine: Engine,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """While a ``persist`` command holds a memory tier, another one is refused naming the
    command that holds it (not "another CheckpointManager") and its pid."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                           engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
    with claimed([tiers.memory], "memory tier"):  # what the persist command holds
        code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert code == 1, (out, err)
    assert (f"memory tier {tiers.memory} is in use by a `python -m dcp_datastates persist` "
            f"command (pid {os.getpid()}") in err, err
    assert steps_in(tiers.durable) == []


def test_cli_persist_into_a_durable_tier_a_manager_holds_is_refused(
        tiers: Tiers, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``persist`` command into a durable tier that a running manager holds is refused,
    naming the manager and its pid, and writes nothing there: a dead job's step (of a higher
    number) would otherwise land among the running job's steps, and retention would prune
    the running job's own steps for it."""
    dead = tiers.scratch / "dead_job"
    with CheckpointManager(None, memory_dir=dead, persist=None, engine=engine) as manager:
        manager.save(9, make_state(9)).result(timeout=30)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as manager:
        manager.save(1, make_state(1)).result(timeout=30)
        manager.wait()
        code, out, err = persist(capsys, engine, dead, tiers.durable)
    assert code == 1, (out, err)
    assert (f"durable tier {tiers.durable} is in use by another CheckpointManager (pid "
            f"{os.getpid()}") in err, err
    assert steps_in(tiers.durable) == [1]


def test_cli_persists_into_one_durable_tier_take_turns(
        tiers: Tiers, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """Another ``persist`` command holding the durable tier (a ``--partial`` run of another
    node) is waited for, not refused."""
    with CheckpointManager(None, memory_dir=tiers.memory, persist=None, engine=engine) as manager:
        manager.save(4, make_state(4)).result(timeout=30)
    tiers.durable.mkdir(parents=True)
    held, let_go = threading.Event(), threading.Event()

    def other_command() -> None:
        with claimed_durable(tiers.durable):
            held.set()
            let_go.wait(30)

    other = threading.Thread(target=other_command)
    other.start()
    try:
        assert held.wait(30)
        threading.Timer(0.5, let_go.set).start()
        code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    finally:
        let_go.set()
        other.join(30)
    assert code == 0, (out, err)
    assert steps_in(tiers.durable) == [4]


def test_cli_persist_into_a_durable_tier_others_may_write_is_refused(
        tiers: Tiers, engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """The ``persist`` command checks the durable tier as a manager does: one its group may
    write is refused, saying so, and nothing is written there."""
    with CheckpointManager(None, memory_dir=tiers.memory, persist=None, engine=engine) as manager:
        manager.save(3, make_state(3)).result(timeout=30)
    tiers.durable.mkdir(parents=True)
    os.chmod(tiers.durable, 0o775)
    code, out, err = persist(capsys, engine, tiers.memory, tiers.durable)
    assert code == 1, (out, err)
    assert f"durable tier {tiers.durable} is writable by its group (mode 0775)" in err, err
    assert steps_in(tiers.durable) == []


# -- what a user without write permission sees ---------------------------------------------------
_UNPRIVILEGED = textwrap.dedent(
    """
    import os, sys
    from dcp_datastates import CheckpointError, CheckpointManager, Engine
    sys.path.insert(0, {tests!r})
    from helpers.tiers import make_state

    case, durable, memory = sys.argv[1], sys.argv[2], sys.argv[3]
    engine = Engine(io_backend="threads", host_cache_size="8MiB")

    def make(memory_dir, **kw):
        try:
            return CheckpointManager(durable, memory_dir=memory_dir, engine=engine, **kw)
        except CheckpointError as exc:
            print("REFUSED", exc, flush=True)
            return None

    if case == "parent":  # two managers on a durable tier whose parent is not writable
        first = make(memory + "/1", persist=1)
        second = make(memory + "/2", persist=1)
        print("FIRST", first is not None, "SECOND", second is not None, flush=True)
        first.save(1, make_state(1)).result(timeout=60)
        first.close()
        print("PERSISTED", os.listdir(durable + "/step_1") != [], flush=True)
    else:  # "unwritable": a durable tier this user may not write
        print("PERSISTING", make(memory + "/1") is not None, flush=True)
        loader = make(memory + "/2", persist=None)
        print("LOADING", loader is not None, flush=True)
        loader.close()
    engine.close()
    """
)


def run_unprivileged(case: str, durable: Path, memory: Path) -> list[str]:
    """Run ``case`` of the script above as a process subject to file permissions (as root:
    without the capabilities that override them); its output lines."""
    argv = [sys.executable, "-c", _UNPRIVILEGED.format(tests=str(Path(__file__).parents[1])),
            case, str(durable), str(memory)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: no process is subject to permissions")
        argv = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", *argv]
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    return done.stdout.splitlines()


def test_a_durable_tier_whose_parent_is_not_writable_is_claimed(tiers: Tiers) -> None:
    """``durable_dir`` made by an admin in a directory the user may not write: the job's claim
    is inside the tier, so a second manager on it is refused (naming the first one's pid)
    instead of both running, pruning each other's steps; the first persists, and nothing is
    left beside the tier."""
    parent = tiers.durable.parent / "admin"
    durable = parent / "alice"
    durable.mkdir(parents=True, mode=0o755)
    os.chmod(parent, 0o555)
    try:
        lines = run_unprivileged("parent", durable, tiers.memory)
    finally:
        os.chmod(parent, 0o755)
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 1 and f"durable tier {durable} is in use by another " \
        "CheckpointManager (pid " in refused[0], lines
    assert "FIRST True SECOND False" in lines and "PERSISTED True" in lines, lines
    assert steps_in(durable) == [1]
    assert os.listdir(parent) == ["alice"]


def test_an_unwritable_durable_tier_is_refused_when_the_manager_is_made(tiers: Tiers) -> None:
    """A durable tier the user may not write fails the manager at once, saying so and what to
    do (not at its first persist); with persist=None (loading only) it is accepted."""
    tiers.durable.mkdir(parents=True, mode=0o755)
    os.chmod(tiers.durable, 0o555)
    try:
        lines = run_unprivileged("unwritable", tiers.durable, tiers.memory)
    finally:
        os.chmod(tiers.durable, 0o755)
    assert any(line.startswith(f"REFUSED durable tier {tiers.durable} is not writable by this "
                               f"user") and "persist=None to only load from it" in line
               for line in lines), lines
    assert "PERSISTING False" in lines and "LOADING True" in lines, lines
