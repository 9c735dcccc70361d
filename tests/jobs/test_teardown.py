"""A save in flight when its process group is destroyed (a script's last lines,
``dist.destroy_process_group()``; or a group destroyed and made again): it is committed whole
(every rank's items) or not at all, says so, and never runs on a group made after its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MARKS, assert_state_equal, load_into

from dcp_datastates.format.metadata_file import read_metadata
from dcp_datastates.tiers.steps import committed_steps

pytestmark = MARKS

JOB = Path(__file__).with_name("teardown_job.py")
#: as in ``teardown_job.py``
SHARD, TRIALS = 1 << 16, 6
ABANDONED = "abandoned: the process group was destroyed while the save was in flight"


def run_job(root: Path, mode: str, timeout: float = 120) -> tuple[list[int], str, str]:
    """Run ``teardown_job.py`` in ``mode`` as two ranks: their exit codes, stdout, stderr (a
    job still running after ``timeout`` seconds, hung, fails the test)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parents[2]), str(JOB.parents[1])])}
    ranks = [subprocess.Popen([sys.executable, str(JOB), str(root), mode],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [rank.communicate(timeout=timeout) for rank in ranks]
    except subprocess.TimeoutExpired:
        pytest.fail(f"teardown_job.py {mode} still running after {timeout} s: hung")
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()
    return [r.returncode for r in ranks], "".join(o for o, _ in outs), "".join(e for _, e in outs)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def whole(version: int) -> dict:
    """Version ``version`` of the job's DTensor state, as one tensor (rank r's shard holds
    ``10*version+r``)."""
    return {"w": torch.cat([torch.full((SHARD,), float(10 * version + r)) for r in range(2)]),
            "step": torch.tensor(version)}


def check_whole_or_intact(ckpt: Path, lines: list[str]) -> bool:
    """Assert ``ckpt`` holds the whole new save (both ranks saved) or, bit for bit, the
    checkpoint saved there before (both ranks' saves failed); return whether it is intact."""
    before = ckpt.with_suffix(".before")
    intact = files_of(ckpt) == files_of(before)
    for version, where in ((1, before), (1 if intact else 2, ckpt)):
        template = {"w": torch.full((2 * SHARD,), float("nan")), "step": torch.tensor(-1)}
        assert_state_equal(load_into(template, where), whole(version), str(where))
    want = "failed: " if intact else "saved"
    assert all(line.split(": ", 1)[1].startswith(want) for line in lines), (ckpt, lines)
    return intact


@pytest.mark.parametrize("run", range(3))
def test_destroyed_group_never_commits_part_of_the_ranks(tmp_path: Path, run: int) -> None:
    _, _, err = run_job(tmp_path, "shared")
    meta = tmp_path / "ckpt" / ".metadata"
    if meta.exists():
        names = {k.split(".")[0] for k in read_metadata(meta.parent).state_dict_metadata}
        assert names == {"rank0", "rank1", "both"}, f"a commit of part of the ranks: {names}"
    else:
        assert ABANDONED in err, err[-3000:]


def test_a_save_staged_by_another_stager_never_commits_part_of_the_ranks(
        tmp_path: Path) -> None:
    """``dcp.async_save(async_stager=DefaultStager(...))`` with a ``DataStatesWriter``, the group
    destroyed before the staged state reaches DCP's save or just after: in every trial the
    checkpoint there before is intact bit for bit (and loads), or replaced whole."""
    codes, out, err = run_job(tmp_path, "stager")
    assert codes == [0, 0], err[-3000:]
    intact = []
    for trial in range(TRIALS):
        lines = re.findall(rf"^rank \d trial {trial}: .*$", out, re.M)
        assert len(lines) == 2, out
        intact.append(check_whole_or_intact(tmp_path / f"ckpt{trial}", lines))
        if trial % 2 == 0:  # destroyed before DCP's save began: refused, on both ranks
            assert all(ABANDONED in line for line in lines), lines
    assert intact[::2] == [True] * (TRIALS // 2)


def test_a_save_never_moves_onto_a_group_made_after_its_own(tmp_path: Path) -> None:
    """The group destroyed and a new one made while a save is in flight (staged by the writer,
    then by DCP's ``DefaultStager``), the ranks training on the new one: the save fails saying
    so, before any collective, and the ranks go on; the checkpoint there before is intact."""
    codes, out, err = run_job(tmp_path, "regroup", timeout=90)
    assert codes == [0, 0], err[-3000:]
    for name in ("writer", "default"):
        lines = re.findall(rf"^rank \d {name}: .*$", out, re.M)
        assert len(lines) == 2 and all(ABANDONED in line and "on the new process group" in line
                                       for line in lines), out
        assert check_whole_or_intact(tmp_path / f"ckpt-{name}", lines)
    assert "rank 0: trained" in out and "rank 1: trained" in out


def test_destroyed_group_keeps_each_ranks_own_saves(tmp_path: Path) -> None:
    """Saves that are each rank's own checkpoint (``no_dist=True``, a manager's memory tier)
    need no process group: destroyed while they are in flight, they still commit."""
    codes, out, err = run_job(tmp_path, "own")
    assert codes == [0, 0], err[-3000:]
    for rank in range(2):
        assert f"rank {rank}: saved" in out
        got = load_into({"w": torch.empty(1 << 16)}, tmp_path / f"own{rank}")
        assert torch.equal(got["w"], torch.full((1 << 16,), float(rank)))
        assert committed_steps(tmp_path / f"mem{rank}") == [1]
