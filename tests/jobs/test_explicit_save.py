"""The explicit save job (``_jobs/explicit.py``) that ``CheckpointManager`` drives: staged,
flushed and committed by its owner, or aborted; never judged abandoned by the rules that tell
of DCP's saves, since no DCP call holds it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import MARKS, assert_state_equal, clone_state, load_into, square_state

from dcp_datastates import DataStatesWriter
from dcp_datastates._jobs.explicit import ExplicitSave
from dcp_datastates._jobs.save import save_order

TIMEOUT = 60

pytestmark = MARKS


def test_an_explicit_save_commits_what_a_dcp_save_of_the_state_commits(
        tmp_path: Path, make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    state = square_state()
    expected = clone_state(state)
    save = ExplicitSave(engine, tmp_path / "explicit")
    save.stage(state).result(timeout=TIMEOUT)
    save.flush()
    save.commit()
    assert save.committed.result(timeout=TIMEOUT) is None
    dcp.save(state, checkpoint_id=tmp_path / "dcp", storage_writer=DataStatesWriter(),
             no_dist=True)
    loaded = load_into(clone_state(expected), tmp_path / "explicit")
    assert_state_equal(loaded, expected)
    assert_state_equal(loaded, load_into(clone_state(expected), tmp_path / "dcp"))


def test_an_explicit_save_outlives_the_threads_that_took_its_snapshot(
        tmp_path: Path, make_engine) -> None:
    """A DCP save whose snapshot was taken by a thread that ended is abandoned (DCP's upload
    thread died); an explicit one is its owner's to end, whichever threads read it."""
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    state = square_state()
    expected = clone_state(state)
    save = ExplicitSave(engine, tmp_path / "ckpt")
    staged = save.stage(state)
    reader = threading.Thread(target=staged.result, args=(TIMEOUT,))
    reader.start()
    reader.join()
    save_order(engine).reap()
    assert not save.committed.done()
    save.flush()
    save.commit()
    assert_state_equal(load_into(clone_state(expected), tmp_path / "ckpt"), expected)


def test_an_aborted_save_leaves_the_checkpoint_there_intact_and_frees_its_memory(
        tmp_path: Path, make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    old = square_state()
    before = ExplicitSave(engine, tmp_path)
    before.stage(old).result(timeout=TIMEOUT)
    before.flush()
    before.commit()
    newer = {k: v + 1 for k, v in old.items()}
    save = ExplicitSave(engine, tmp_path, overwrite=True)
    save.stage(newer).result(timeout=TIMEOUT)
    save.abort(RuntimeError("the owner gave it up"))
    with pytest.raises(RuntimeError, match="the owner gave it up"):
        save.committed.result(timeout=TIMEOUT)
    assert not save.job.holds_memory()
    assert_state_equal(load_into(clone_state(old), tmp_path), old)
    with pytest.raises(RuntimeError, match=f"save {save.job.ticket} was not flushed"):
        save.commit()


def test_steps_out_of_order_are_refused(tmp_path: Path, make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    save = ExplicitSave(engine, tmp_path)
    with pytest.raises(RuntimeError, match=f"save {save.job.ticket} was not staged"):
        save.flush()
    save.abort(RuntimeError("not needed"))
