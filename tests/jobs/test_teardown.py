"""A save in flight when the script ends with ``dist.destroy_process_group()``: it is committed
whole (every rank's items) or not at all, and the exit says which."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MARKS, load_into

from dcp_datastates.format.metadata_file import read_metadata
from dcp_datastates.tiers.steps import committed_steps

pytestmark = MARKS

JOB = Path(__file__).with_name("teardown_job.py")


@pytest.mark.parametrize("run", range(3))
def test_destroyed_group_never_commits_part_of_the_ranks(tmp_path: Path, run: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parents[2]), str(JOB.parents[1])])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(JOB), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    meta = tmp_path / "ckpt" / ".metadata"
    if meta.exists():
        names = {k.split(".")[0] for k in read_metadata(meta.parent).state_dict_metadata}
        assert names == {"rank0", "rank1", "both"}, f"a commit of part of the ranks: {names}"
    else:
        assert "the process group was destroyed while the save was in flight" in done.stderr, \
            done.stderr[-3000:]


def test_destroyed_group_keeps_each_ranks_own_saves(tmp_path: Path) -> None:
    """Saves that are each rank's own checkpoint (``no_dist=True``, a manager's memory tier)
    need no process group: destroyed while they are in flight, they still commit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parents[2]), str(JOB.parents[1])])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(JOB), str(tmp_path), "own"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}: saved" in done.stdout
        got = load_into({"w": torch.empty(1 << 16)}, tmp_path / f"own{rank}")
        assert torch.equal(got["w"], torch.full((1 << 16,), float(rank)))
        assert committed_steps(tmp_path / f"mem{rank}") == [1]
