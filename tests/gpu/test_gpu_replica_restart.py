"""A two-rank FSDP2 job with peer replicas killed mid-run (SIGKILL) and one node's memory tier
lost: restarted with the same command, every rank resumes bit for bit from the newest step,
the lost rank from its peer's replica. Starts ``tests/gpu/fsdp_tiers_job.py`` under torchrun: on
two GPUs where there are (marked ``gpu``), else on CPU with gloo."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import descendants, gone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (or none)"),
]

JOB = Path(__file__).with_name("fsdp_tiers_job.py")
TIMEOUT = 300


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(JOB), *args]


@pytest.fixture
def root() -> Iterator[Path]:
    """The job's directories in /dev/shm: both nodes' memory tiers and the durable tier."""
    path = Path(tempfile.mkdtemp(prefix="dcp_gpu_replica_", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def kill_when_ready(argv: list[str], log: Path) -> None:
    """Start the job; SIGKILL torchrun and every rank at once (a crash of the whole job)
    once it prints ``KILL-ME``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as err:
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                               start_new_session=True)
    try:
        ready, _, _ = select.select([job.stdout], [], [], TIMEOUT)
        line = job.stdout.readline() if ready else ""
        assert line.strip() == "KILL-ME", (line, job.poll(), log.read_text()[-4000:])
    finally:
        pids = [job.pid, *descendants(job.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait(60)
        job.stdout.close()
        deadline = time.monotonic() + 60
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_killed_job_resumes_every_rank_the_lost_one_from_its_peer(root: Path,
                                                                  tmp_path: Path) -> None:
    kill_when_ready(torchrun("run", str(root)), tmp_path / "run.log")
    shutil.rmtree(root / "node_1")  # rank 1's node is lost with its memory tier
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(torchrun("resume", str(root)), capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = dict(re.findall(r"^RESUMED (\d) (\d+ \w+)$", done.stdout, re.M))
    assert set(resumed) == {"0", "1"}, done.stdout
    steps = {v.split()[0] for v in resumed.values()}
    assert len(steps) == 1 and int(steps.pop()) >= 4, resumed
    assert all(v.endswith("True") for v in resumed.values()), resumed
    replica = re.findall(r"^LOG 1 .*restored into .* from rank 0's replica", done.stdout, re.M)
    assert replica, done.stdout
