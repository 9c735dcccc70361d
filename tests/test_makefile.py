"""The Makefile's apt-get calls wait for the locks another apt holds, rather than fail at once.

``make mpi`` runs with stand-ins on PATH: ``dpkg`` says the packages are missing, ``apt-get``
records its arguments and when it ran; the test holds the lock of apt's lists meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stand_in(path: Path, script: str) -> None:
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_apt_get_waits_for_the_locks(tmp_path: Path) -> None:
    bin_dir, calls, lock = tmp_path / "bin", tmp_path / "calls", tmp_path / "lists.lock"
    bin_dir.mkdir()
    _stand_in(bin_dir / "dpkg", "exit 1")
    _stand_in(bin_dir / "apt-get", f'echo "$(date +%s.%N) $*" >> {calls}')
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(held, fcntl.LOCK_EX)  # another apt-get update, as it takes it
    try:
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        make = subprocess.Popen(["make", "--no-print-directory", "mpi", "SUDO=",
                                 f"APT_LISTS_LOCK={lock}"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        released = time.time()
    finally:
        os.close(held)
    output = make.communicate(timeout=60)[0]
    assert make.returncode == 0, output
    stamps, args = zip(*(line.split(" ", 1) for line in calls.read_text().splitlines()),
                       strict=True)
    assert args == ("-q -o DPkg::Lock::Timeout=600 update",
                    "-q -o DPkg::Lock::Timeout=600 install -y openmpi-bin libopenmpi-dev")
    assert float(stamps[0]) >= released, "apt-get update ran while its lists were locked"
