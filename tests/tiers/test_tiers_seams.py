"""The seams of the tiers: the manager leaves the process's warning filters alone, a persist is
a copy job committed by the same commit code as any save (``_jobs/commit.py``, ``_jobs/copy.py``),
and the rank of a persisted part comes from its caller."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import MARKS, Tiers, assert_state_equal, blank_like, clone_state, load_into, save

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates._jobs.commit import commit, committed_by
from dcp_datastates._jobs.copy import copy_checkpoint
from dcp_datastates.tiers._persist import persist_part

pytestmark = MARKS


def small_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "n": torch.arange(seed, seed + 7),
            "extra": {"step": seed, "tag": f"s{seed}"}}


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=4)


def test_manager_keeps_the_warning_filters_and_emits_no_single_process_warning(
        tiers: Tiers, engine: Engine) -> None:
    """Making a manager leaves ``warnings.filters`` as it was, and its memory-tier saves and
    loads (one-process DCP calls) warn of nothing; the user's own DCP call still does."""
    state = small_state(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        with CheckpointManager(tiers.durable, memory_dir=tiers.memory, persist=None,
                               engine=engine) as manager:
            assert warnings.filters == before
            manager.save(1, state).result()
            blank = blank_like(clone_state(state))
            assert manager.load(blank) == 1
        assert warnings.filters == before
        assert_state_equal(blank, state)
        ours = [str(w.message) for w in seen if "torch.distributed is disabled" in str(w.message)]
        assert not ours, ours
        import torch.distributed.checkpoint as dcp

        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tiers.scratch / "plain"), no_dist=True)
        assert any("torch.distributed is disabled" in str(w.message) for w in seen), \
            "the user's own one-process DCP call still warns"


def test_commit_removes_its_files_when_it_fails_and_prunes_when_it_succeeds(
        tiers: Tiers, make_writer) -> None:
    src = tiers.scratch / "src"
    save(small_state(2), src, make_writer())
    metadata = read_metadata(src)
    (name,) = {loc.file for loc in metadata.storage_data.values()}
    stale = src / "__0_00000000deadbeef.safetensors"
    stale.write_bytes(b"x")
    (src / ".metadata").unlink()
    (src / ".metadata").mkdir()  # the atomic rename onto it fails
    with pytest.raises(OSError):
        commit(src, metadata, "aaaa1111")
    assert not (src / name).exists(), "a failed commit leaves no file that nothing names"
    assert not committed_by(src, "aaaa1111")
    (src / ".metadata").rmdir()
    (src / name).write_bytes(b"")  # stands for the file again
    commit(src, metadata, "bbbb2222")
    assert committed_by(src, "bbbb2222")
    assert not stale.exists(), "a commit deletes data files no .metadata names"


def test_a_copy_job_commits_a_whole_checkpoint_or_a_part(tiers: Tiers, make_writer,
                                                         engine: Engine) -> None:
    state = small_state(3)
    src = tiers.scratch / "src"
    save(state, src, make_writer())
    whole = tiers.durable / "whole"
    copy_checkpoint(engine, src, whole)
    assert_state_equal(load_into(state, whole), state)

    target = tiers.durable / "parts"
    target.mkdir(parents=True)
    other = target / "__1_00000000cafecafe.safetensors"  # another share's file
    other.write_bytes(b"other rank")
    copy_checkpoint(engine, src, target, part=target / ".part.0")
    assert (target / ".part.0" / ".metadata").is_file()
    assert not (target / ".metadata").exists(), "a part does not commit the checkpoint"
    assert other.read_bytes() == b"other rank", "a part deletes nothing of other shares"


def test_persist_takes_the_rank_from_its_caller(tiers: Tiers, make_writer,
                                                engine: Engine) -> None:
    """A checkpoint with no tier record of its own persists as the part of the rank given."""
    state = small_state(4)
    src = tiers.scratch / "step_4"
    save(state, src, make_writer())
    target = tiers.durable / "step_4"
    assert not persist_part(engine, src, target, 1, 2), "rank 0's part is still missing"
    assert (target / ".part.1").is_dir() and not (target / ".metadata").exists()
    assert persist_part(engine, src, target, 0, 2), "the second part completes the step"
    assert not list(target.glob(".part.*"))
    assert_state_equal(load_into(state, target), state)



def test_a_persist_failing_over_a_committed_part_leaves_no_part_without_its_file(
        tiers: Tiers, make_writer, engine: Engine, faulty_engine) -> None:
    """A rank's part persisted again (``persist`` from the memory tier over a part already in
    the durable step) that fails half-way leaves no committed part naming a file it removed:
    the other rank's part must not complete the step with that rank's data missing."""
    state = small_state(5)
    src = tiers.scratch / "step_5"
    save(state, src, make_writer())
    target = tiers.durable / "step_5"
    assert not persist_part(engine, src, target, 0, 2)
    bad, _backend = faulty_engine(fail_write_after=0)
    with pytest.raises(OSError):
        persist_part(bad, src, target, 0, 2)
    other = tiers.scratch / "step_5_rank_1"  # rank 1's share: a data file of its own
    save(state, other, make_writer())
    assert not persist_part(engine, other, target, 1, 2), "rank 0's part lost its file"
    assert persist_part(engine, src, target, 0, 2)
    assert_state_equal(load_into(state, target), state)
