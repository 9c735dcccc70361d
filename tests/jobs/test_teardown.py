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
import torch.distributed.checkpoint as dcp
from helpers import MARKS, assert_state_equal, load_into

from dcp_datastates import DataStatesWriter
from dcp_datastates._format.directory import DATA_FILE_RE
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates._jobs.commit import data_files
from dcp_datastates.tiers._steps import committed_steps

pytestmark = MARKS

JOB = Path(__file__).with_name("teardown_job.py")
#: as in ``teardown_job.py``
SHARD, TRIALS, HELD = 1 << 16, 8, (6, 7)
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


def left_over(ckpt: Path) -> dict[str, bytes]:
    """The files of ``ckpt`` that the checkpoint saved there before (``<ckpt>.before``) lacks."""
    before = files_of(ckpt.with_suffix(".before"))
    return {name: data for name, data in files_of(ckpt).items() if name not in before}


def check_whole_or_intact(ckpt: Path, lines: list[str], late: bool = False) -> bool:
    """Assert ``ckpt`` holds the whole new save (both ranks saved) or the checkpoint saved there
    before, its files bit for bit (both ranks' saves failed); return whether it is intact. Next
    to an intact one may lie data files of the failed save, which no ``.metadata`` names (a rank
    cannot tell whether its coordinator committed once the group is gone, so it leaves its file;
    the next commit deletes them). ``late``: the group was destroyed a moment after the save
    began, so perhaps after the coordinator committed and before DCP's last collective (its
    broadcast of the outcome), which then fails on both ranks: a whole save may say failed."""
    before, now = files_of(ckpt.with_suffix(".before")), files_of(ckpt)
    intact = all(now.get(name) == data for name, data in before.items())
    if intact:
        named = data_files(read_metadata(ckpt))
        assert all(DATA_FILE_RE.match(name) and name not in named for name in left_over(ckpt)), \
            (ckpt, sorted(left_over(ckpt)))
    for version, where in ((1, ckpt.with_suffix(".before")), (1 if intact else 2, ckpt)):
        template = {"w": torch.full((2 * SHARD,), float("nan")), "step": torch.tensor(-1)}
        assert_state_equal(load_into(template, where), whole(version), str(where))
    want = ("failed: ",) if intact else ("saved", "failed: ") if late else ("saved",)
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
    destroyed before the staged state reaches DCP's save, just after, or (``HELD``) while DCP's
    save writes each rank's data file: in every trial the checkpoint there before is intact bit
    for bit (and loads), or replaced whole; the files a failed save left go at the next commit."""
    codes, out, err = run_job(tmp_path, "stager")
    assert codes == [0, 0], err[-3000:]
    intact = []
    for trial in range(TRIALS):
        lines = re.findall(rf"^rank \d trial {trial}: .*$", out, re.M)
        assert len(lines) == 2, out
        intact.append(check_whole_or_intact(tmp_path / f"ckpt{trial}", lines,
                                            late=trial % 2 == 1 and trial not in HELD))
        if trial in HELD:  # destroyed while DCP's save wrote the data files: each rank's
            assert sorted(n[:3] for n in left_over(tmp_path / f"ckpt{trial}")) == ["__0", "__1"]
            continue
        if trial % 2 == 0:  # destroyed before DCP's save began: refused, on both ranks
            assert all(ABANDONED in line for line in lines), lines
    assert [intact[t] for t in (0, 2, 4, *HELD)] == [True] * 5
    ckpt = tmp_path / f"ckpt{HELD[0]}"  # the next commit there deletes the failed save's files
    dcp.save({"w": torch.ones(4)}, checkpoint_id=ckpt, no_dist=True,
             storage_writer=DataStatesWriter(overwrite=True))
    assert not set(left_over(ckpt)) - data_files(read_metadata(ckpt)), sorted(left_over(ckpt))


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
