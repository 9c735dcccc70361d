"""Forgiving like DCP: saves in flight finish at interpreter exit (or say loudly that they were
lost), warnings a user sees without logging set up, tiers that clean up after dead processes,
the ``overwrite`` default as documented, and path errors that say what is wrong."""

from __future__ import annotations

import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    Tiers,
    assert_state_equal,
    data_files,
    load_into,
    raises_in_dcp,
    save,
)
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import (
    CheckpointError,
    CheckpointManager,
    DataStatesReader,
    DataStatesWriter,
    Engine,
)
from dcp_datastates import (
    _cli as cli,
)
from dcp_datastates._format.directory import DirectoryClaim
from dcp_datastates.tiers._manager import _default_memory_dir
from dcp_datastates.tiers._steps import RECORD_NAME, TierRecord, committed_steps, steps

pytestmark = MARKS
ROOT = Path(__file__).resolve().parents[1]
#: What users read: the README and the documents it links to.
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

#: The start of every script: a state of known bits (the test rebuilds it to compare).
PRELUDE = """\
import sys
import torch
import torch.distributed.checkpoint as dcp
from dcp_datastates import CheckpointManager, DataStatesWriter, Engine

def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 21, generator=g), "b": torch.randint(0, 9, (999,), generator=g),
            "step": seed}
"""


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 21, generator=g), "b": torch.randint(0, 9, (999,), generator=g),
            "step": seed}


def run_script(tmp_path: Path, body: str, *args: object, env: dict | None = None,
               returncode: int = 0) -> subprocess.CompletedProcess[str]:
    """``PRELUDE + body`` in a fresh interpreter (no logging set up), which then exits with
    ``returncode``."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    environ = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"} | (env or {})
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "tests"), environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-W", "ignore", str(script), *map(str, args)],
                          capture_output=True, text=True, timeout=240, env=environ)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


# -- 1. saves in flight at interpreter exit ------------------------------------------------------
def test_async_save_in_flight_at_exit_is_committed(tmp_path: Path) -> None:
    """DCP's idiom, and a script that exits right after it: the save completes."""
    proc = run_script(tmp_path, """
        dcp.async_save(state(1), checkpoint_id=sys.argv[1], storage_writer=DataStatesWriter())
    """, tmp_path / "ckpt")
    assert proc.stderr == ""
    assert_state_equal(load_into(state(1), tmp_path / "ckpt"), state(1))


def test_an_async_save_dcp_refused_after_staging_is_not_said_lost_at_exit(
        tmp_path: Path) -> None:
    """DCP stages the snapshot, then refuses a PROCESS-mode ``async_save`` without a process
    group: the script ends with DCP's error alone, no save "lost at exit" that it never had."""
    proc = run_script(tmp_path, """
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        dcp.async_save(state(1), checkpoint_id=sys.argv[1], storage_writer=DataStatesWriter(),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    """, tmp_path / "ckpt", returncode=1)
    assert "Default process group has not been initialized" in proc.stderr, proc.stderr
    assert "lost at exit" not in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_slow_save_on_an_engine_never_closed_finishes_at_exit(tmp_path: Path) -> None:
    """An engine of the script's own, never closed, on a slow disk (0.3 s a write): its saves
    are still flushing when the script ends; both are committed."""
    run_script(tmp_path, """
        from helpers.fakes import FaultyBackend
        from dcp_datastates._io import ThreadPoolBackend
        engine = Engine(host_cache_size="64MiB",
                        io_backend=FaultyBackend(ThreadPoolBackend(), delay_s=0.3))
        for i in (1, 2):
            dcp.async_save(state(i), checkpoint_id=f"{sys.argv[1]}/{i}",
                           storage_writer=DataStatesWriter(engine=engine))
    """, tmp_path)
    for i in (1, 2):
        assert_state_equal(load_into(state(i), tmp_path / str(i)), state(i))


def test_a_save_that_fails_at_exit_says_so_and_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    proc = run_script(tmp_path, """
        from helpers.fakes import FaultyBackend
        from dcp_datastates._io import ThreadPoolBackend
        dcp.save(state(1), checkpoint_id=sys.argv[1], storage_writer=DataStatesWriter())
        failing = Engine(io_backend=FaultyBackend(ThreadPoolBackend(), fail_write_after=0))
        dcp.async_save(state(2), checkpoint_id=sys.argv[1],
                       storage_writer=DataStatesWriter(engine=failing, overwrite=True))
    """, tmp_path / "ckpt")
    lines = [ln for ln in proc.stderr.splitlines() if "lost at exit" in ln]
    assert len(lines) == 1 and str(tmp_path / "ckpt") in lines[0], proc.stderr
    assert "a checkpoint committed there before is intact" in lines[0]
    assert_state_equal(load_into(state(1), tmp_path / "ckpt"), state(1))


def test_a_manager_not_closed_commits_and_persists_at_exit(tiers: Tiers, tmp_path: Path) -> None:
    """One rank: what close() would do. Five saves, persist=2, no close(): every save is
    committed in memory and the newest is persisted."""
    proc = run_script(tmp_path, """
        manager = CheckpointManager(sys.argv[1], memory_dir=sys.argv[2], persist=2,
                                    keep_durable=None)
        for step in range(5):
            manager.save(step, state(step))
    """, tiers.durable, tiers.memory)
    assert proc.stderr == ""
    assert committed_steps(tiers.memory) == [3, 4]
    assert committed_steps(tiers.durable)[-1] == 4
    assert_state_equal(load_into(state(4), tiers.durable / "step_4"), state(4))
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None) as manager:
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
               for k, v in state(0).items()}
        assert manager.load(out) == 4
    assert_state_equal(out, state(4))


def test_closing_the_engine_first_finishes_its_manager(tiers: Tiers) -> None:
    """The engine's close (at exit or called) waits for a manager left open on it."""
    engine = Engine(host_cache_size="16MiB", io_backend="threads")
    manager = CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                                engine=engine)
    handle = manager.save(3, state(3))
    engine.close()
    assert handle.committed.done() and handle.committed.exception() is None
    assert committed_steps(tiers.memory) == [3]
    manager.close()  # closed already: nothing to do
    with pytest.raises(RuntimeError, match="is closed"):
        manager.save(4, state(4))


# -- 3. what a user sees without logging set up --------------------------------------------------
def test_fallback_is_one_warning_and_figures_stay_at_info(tmp_path: Path) -> None:
    proc = run_script(tmp_path, """
        for i in (1, 2):
            dcp.save(state(i), checkpoint_id=f"{sys.argv[1]}/{i}",
                     storage_writer=DataStatesWriter())
    """, tmp_path, env={"DCP_DATASTATES_SHIM": str(tmp_path / "missing.so")})
    (line,) = proc.stderr.splitlines()  # one warning; nothing at INFO (figures, backend)
    assert line.startswith(f"dcp_datastates: shim {tmp_path / 'missing.so'} not found")
    assert line.endswith("falling back to the thread-pool I/O backend")


def test_the_readme_documents_the_logger() -> None:
    assert "`dcp_datastates` logger" in README
    assert "logging.getLogger(\"dcp_datastates\")" in README


# -- 4. tiers that clean up ----------------------------------------------------------------------
def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_unfinished_steps_of_dead_processes_are_removed(tiers: Tiers, caplog) -> None:
    """Step 2: unfinished, its process gone: removed. Step 3: unfinished, its process alive
    (this one): kept. Step 4: no record, but a save holds its claim: kept. Step 1: committed."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None) as manager:
        manager.save(1, state(1)).result(timeout=60)
    record = TierRecord.read(tiers.memory / "step_1")
    assert record.pid == os.getpid()
    for step, pid in ((2, _dead_pid()), (3, os.getpid())):
        (tiers.memory / f"step_{step}").mkdir()
        TierRecord(step, 0, 1, pid).write(tiers.memory / f"step_{step}")
        (tiers.memory / f"step_{step}" / "__0_0123456789abcdef.safetensors").write_bytes(b"x")
    (tiers.memory / "step_4").mkdir()
    claim = DirectoryClaim(tiers.memory / "step_4")
    try:
        with caplog.at_level(logging.INFO, logger="dcp_datastates"):
            CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None).close()
    finally:
        claim.release()
    assert steps(tiers.memory) == [1, 3, 4]
    assert f"removed unfinished step(s) [2] from {tiers.memory}" in caplog.text
    assert '"pid"' in (tiers.memory / "step_1" / RECORD_NAME).read_text()


def test_the_default_memory_tier_is_named_after_its_durable_dir() -> None:
    a = _default_memory_dir(Path("/shared/ckpt/run1"), 3)
    b = _default_memory_dir(Path("/other/ckpt/run1"), 3)
    assert a.parent.parent == Path(f"/dev/shm/dcp_datastates-{os.geteuid()}")
    assert a.name == "rank_3"
    assert a.parent.name.startswith("ckpt_run1-") and b.parent.name.startswith("ckpt_run1-")
    assert a != b
    assert _default_memory_dir(Path("/"), 0).parent.name.isalnum()


def test_persist_cli_creates_missing_parents_when_asked(tiers: Tiers, capsys) -> None:
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None) as manager:
        manager.save(5, state(5)).result(timeout=60)
    target = tiers.scratch / "a" / "b" / "durable"
    assert cli.main(["persist", str(tiers.memory), str(target)]) == 1
    assert "(--parents creates it)" in capsys.readouterr().err
    assert cli.main(["persist", str(tiers.memory), str(target), "--parents"]) == 0
    assert_state_equal(load_into(state(5), target / "step_5"), state(5))


def test_the_readme_says_what_happens_to_the_memory_tier_at_close() -> None:
    assert "After `close()` the memory tier stays" in README


# -- 5. overwrite --------------------------------------------------------------------------------
def test_overwrite_default_differs_from_dcp_as_the_readme_says(tmp_path: Path) -> None:
    """DCP's FileSystemWriter overwrites by default; DataStatesWriter refuses (documented)."""
    assert inspect.signature(FileSystemWriter).parameters["overwrite"].default is True
    assert inspect.signature(DataStatesWriter).parameters["overwrite"].default is False
    assert "**Unlike DCP's `FileSystemWriter`**, whose `overwrite` defaults to `True`" in README
    save(state(1), tmp_path, DataStatesWriter())
    with raises_in_dcp(RuntimeError, "overwrite=True"):
        save(state(2), tmp_path, DataStatesWriter())
    save(state(2), tmp_path, DataStatesWriter(overwrite=True))
    assert len(data_files(tmp_path)) == 1
    assert_state_equal(load_into(state(2), tmp_path), state(2))


# -- 6. path errors ------------------------------------------------------------------------------
def test_a_missing_directory_is_said_not_to_exist(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"\(the directory does not exist\)"):
        dcp.load({"w": torch.zeros(1)}, checkpoint_id=missing, storage_reader=DataStatesReader())
    assert cli.main(["inspect", str(missing)]) == 1


def test_a_file_is_said_to_be_a_file(tmp_path: Path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    file = tmp_path / "model.pt"
    file.write_bytes(b"not a checkpoint")
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint directory"):
        dcp.load({"w": torch.zeros(1)}, checkpoint_id=file, storage_reader=DataStatesReader())
    capsys.readouterr()
    for command in ("inspect", "verify"):
        assert cli.main([command, str(file)]) == 1
        assert f"{file} is a file, not a checkpoint directory" in capsys.readouterr().err


def test_one_directory_for_both_tiers_is_said_to_be_one(tmp_path: Path) -> None:
    """memory_dir naming durable_dir (through a link too) is refused as such, not as a tier
    "in use by another CheckpointManager" (this one)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    for memory in (tmp_path / "ckpt", tmp_path / "link"):
        with pytest.raises(ValueError, match=r"memory_dir .* is durable_dir"):
            CheckpointManager(tmp_path / "ckpt", memory_dir=memory)


def test_one_memory_dir_for_every_rank_is_said_to_need_one_each(tiers: Tiers) -> None:
    """The same ``memory_dir`` for every rank of a node (as two ranks would give it): the
    second manager is refused, and told that each rank needs a memory_dir of its own."""
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None):
        with pytest.raises(CheckpointError) as info:
            CheckpointManager(tiers.durable / "other", memory_dir=tiers.memory, persist=None)
    said = str(info.value)
    assert f"memory tier {tiers.memory} is in use by another CheckpointManager" in said, said
    assert "each rank of a job needs a memory_dir of its own" in said, said


def test_a_meta_tensor_is_refused_by_name(tmp_path: Path) -> None:
    """A tensor on the meta device (a model made there and never materialized) holds no data:
    ``dcp.save``, ``dcp.async_save`` and a manager's save refuse it, naming it (the snapshot
    read its null data pointer: the process died of SIGSEGV), and the manager's next save
    works."""
    proc = run_script(tmp_path, """
        from torch.distributed.checkpoint.api import CheckpointException
        root = sys.argv[1]
        bad = {"layer": {"x": torch.ones(4, device="meta")}, "y": torch.ones(3)}

        def said(exc):
            if isinstance(exc, CheckpointException):
                (exc,) = [e for e, _ in exc.failures.values()]
            print(type(exc).__name__, exc)
        for run in (lambda: dcp.save(bad, checkpoint_id=root + "/sync", no_dist=True,
                                     storage_writer=DataStatesWriter()),
                    lambda: dcp.async_save(bad, checkpoint_id=root + "/async",
                                           storage_writer=DataStatesWriter()
                                           ).upload_completion.result()):
            try:
                run()
            except BaseException as exc:
                said(exc)
        with CheckpointManager(root + "/durable", memory_dir=root + "/memory",
                               persist=None) as manager:
            try:
                manager.save(1, bad).result()
            except Exception as exc:
                said(exc)
            good = state(2)
            manager.save(2, good).result()
            out = {"w": torch.zeros_like(good["w"]), "b": torch.zeros_like(good["b"]), "step": 0}
            assert manager.load(out) == 2 and torch.equal(out["w"], good["w"])
    """, tmp_path / "run")
    said = proc.stdout.splitlines()
    assert len(said) == 3, proc.stdout + proc.stderr[-3000:]
    for line in said:
        assert line.startswith("TypeError 'layer.x': a tensor on the meta device"), line


@pytest.mark.parametrize("path", ["dcp.save", "dcp.async_save", "manager"])
def test_a_value_that_cannot_be_pickled_is_refused_by_name(tmp_path: Path, tiers: Tiers,
                                                           path: str) -> None:
    """A lock in an optimizer's state (no tensor, no picklable value) is refused naming where
    it is in the state, on every save path; the manager's next save works."""
    bad = {"w": torch.ones(3), "opt": {"groups": [{"lock": threading.Lock()}]}}
    expected = (re.escape("'opt.groups.0.lock': a ") + ".*"
                + re.escape("(cannot pickle '_thread.lock' object)"))
    if path == "manager":
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None) as manager:
            with pytest.raises(TypeError, match=expected):
                manager.save(1, bad).result()
            manager.save(2, {"w": torch.ones(3)}).result()
            assert manager.latest_step() == 2
        return
    with raises_in_dcp(TypeError, expected):
        if path == "dcp.save":
            dcp.save(bad, checkpoint_id=tmp_path, no_dist=True, storage_writer=DataStatesWriter())
        else:
            dcp.async_save(bad, checkpoint_id=tmp_path, no_dist=True,
                           storage_writer=DataStatesWriter()).upload_completion.result()
