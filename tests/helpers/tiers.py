"""Helpers of the tier tests (``tiers/``, and the GPU and multi-rank tests of the tiers):
training-like states, committed steps, I/O backends that hold or fail the tiers' writes, the
``persist`` command, a child process killed mid-save."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates._io import IOBackend, IOReq

from . import ROOT, TESTS, Tiers, rand_tensor, run_then_kill

TIMEOUT = 60
#: What the log says of a memory-tier save that waits for its slot, or aside for it.
WAITS = "the snapshot waits for it"
ASIDE = "the snapshot waits aside meanwhile"


# -- states and steps ------------------------------------------------------------------------------
def make_state(seed: int, big: int = 0) -> dict:
    """A training-like state: tensors of random bit patterns (several dtypes) and plain values;
    ``big`` adds a uint8 tensor of that many bytes."""
    state = {
        "model": {"w": rand_tensor((48, 40), torch.float32, seed),
                  "b": rand_tensor((40,), torch.bfloat16, seed + 1)},
        "optim": {"step": torch.tensor(seed, dtype=torch.int64),
                  "exp_avg": rand_tensor((48, 40), torch.float32, seed + 2)},
        "extra": {"step": seed, "tag": f"after-{seed}", "lr": 1.0 / (seed + 3),
                  "ids": [seed, seed + 1]},
    }
    if big:
        state["big"] = rand_tensor((big,), torch.uint8, seed + 3)
    return state


def steps_in(root: Path) -> list[int]:
    """Committed steps (``step_<N>`` with a ``.metadata``) under ``root``."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if re.fullmatch(r"step_\d+", p.name) and (p / ".metadata").is_file())


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def manager_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dcp_datastates"]


def restored_from(caplog: pytest.LogCaptureFixture, step: int) -> list[str]:
    """The tiers the log says ``step`` was restored from (in order)."""
    pat = re.compile(rf"restored step {step} from the (\w+) tier")
    return [m.group(1) for line in manager_logs(caplog) if (m := pat.search(line))]


def flip_payload_byte(directory: Path, fqn: str) -> None:
    """Flip one byte of item ``fqn`` in its data file (sizes stay right: only checksums tell)."""
    loc = next(v for k, v in read_metadata(directory).storage_data.items() if k.fqn == fqn)
    path = directory / loc.file
    with open(path, "r+b") as f:
        f.seek(loc.offset + 3)
        byte = f.read(1)
        f.seek(loc.offset + 3)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- I/O backends that hold or fail the tiers' writes ----------------------------------------------
class HoldWrites:
    """An IOBackend over a real one whose writes to files under ``prefix`` wait for ``gate``
    (after the first ``let_through`` of them); ``held`` is set when one waits. Writes to the
    memory tier pass, so saves commit while a persist is stuck."""

    def __init__(self, inner: IOBackend, prefix: Path | str, *, let_through: int = 0) -> None:
        self.inner = inner
        self.name = f"hold({inner.name})"
        self.prefix = str(prefix).rstrip("/") + "/"
        self.let_through = let_through
        self.gate = threading.Event()
        self.held = threading.Event()
        self.durable_writes = 0
        self._lock = threading.Lock()

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        if path.startswith(self.prefix):
            with self._lock:
                self.durable_writes += 1
                hold = self.durable_writes > self.let_through
            if hold:
                self.held.set()
                self.gate.wait()
        self.inner.write(fd, path, reqs)

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int, nbytes: int) -> None:
        self.inner.unregister(addr, nbytes)

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        self.inner.read(fd, path, reqs)

    def fsync(self, fd: int, path: str) -> None:
        self.inner.fsync(fd, path)

    def close(self) -> None:
        self.inner.close()


# -- a child killed after a memory commit or during a persist --------------------------------------
_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from helpers.tiers import HoldWrites, make_state
    from dcp_datastates import CheckpointManager, Engine
    from dcp_datastates._io import ThreadPoolBackend

    mode, memory, durable = sys.argv[1:4]
    step, big = int(sys.argv[4]), int(sys.argv[5])
    if mode == "commit":  # a memory commit, never persisted
        engine = Engine(io_backend="threads", host_cache_size="8MiB")
        manager = CheckpointManager(durable, memory_dir=memory, persist=None, engine=engine)
        handle = manager.save(step, make_state(step, big))
        handle.committed.result(timeout=60)
        print("COMMITTED", flush=True)
    else:  # "persist": a persist that has written part of the data file, then stalls
        hold = HoldWrites(ThreadPoolBackend(), durable, let_through=2)
        engine = Engine(io_backend=hold, host_cache_size="8MiB")
        manager = CheckpointManager(durable, memory_dir=memory, persist="idle", engine=engine)
        handle = manager.save(step, make_state(step, big))
        handle.committed.result(timeout=60)
        assert handle.persisted is not None, "the persist should have started"
        assert hold.held.wait(60), "the persist never reached the durable tier"
        print("PERSISTING", flush=True)
    time.sleep(600)  # the test kills us
    """
)


def run_and_kill(mode: str, tiers: Tiers, step: int, big: int, marker: str) -> None:
    """Run the child until it prints ``marker``, then SIGKILL it."""
    run_then_kill([sys.executable, "-c", _CHILD.format(tests=str(TESTS)), mode,
                   str(tiers.memory), str(tiers.durable), str(step), str(big)],
                  marker, tiers.scratch / f"child_{mode}.err", ROOT)


# -- the persist command ---------------------------------------------------------------------------
def persist(capsys: pytest.CaptureFixture[str], engine: Engine, *args: object) -> tuple[int, str,
                                                                                         str]:
    """``persist ARGS`` through ``cli.main`` in this process: exit code, stdout, stderr."""
    code = cli.main(["persist", *map(str, args)], engine=engine)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["DCP_DATASTATES_IO"] = "threads"
    return subprocess.run([sys.executable, "-m", "dcp_datastates", "persist", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


# -- a save whose fsync fails ----------------------------------------------------------------------
def save_through(manager: CheckpointManager, io: FailFsync, step: int, state: dict) -> bool:
    """Save ``state`` at ``step`` and wait for it and the manager; while ``io`` is failing
    both raise the injected error. Whether the save was committed."""
    handle = manager.save(step, state)
    if io.failing:
        with pytest.raises(OSError, match="injected EIO"):
            handle.result(timeout=30)
        with pytest.raises(OSError, match="injected EIO"):
            manager.wait()
        return False
    handle.result(timeout=30)
    manager.wait()
    return True


class FailFsync:
    """An IOBackend over a real one whose fsyncs of files under ``prefix`` fail while
    ``failing`` is set."""

    def __init__(self, inner: IOBackend, prefix: Path) -> None:
        self.inner = inner
        self.name = f"failfsync({inner.name})"
        self.prefix = str(prefix).rstrip("/") + "/"
        self.failing = False

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        self.inner.write(fd, path, reqs)

    def read(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        self.inner.read(fd, path, reqs)

    def register(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def unregister(self, addr: int, nbytes: int) -> None:
        self.inner.unregister(addr, nbytes)

    def fsync(self, fd: int, path: str) -> None:
        if self.failing and path.startswith(self.prefix):
            raise OSError(5, "injected EIO", path)
        self.inner.fsync(fd, path)

    def close(self) -> None:
        self.inner.close()


# -- slot files ------------------------------------------------------------------------------------
def slot_files(memory: Path) -> dict[Path, int]:
    """The slot files of every slot directory of ``memory``, and their inodes."""
    return {p: p.stat().st_ino for p in memory.glob(".slots.*/slot_*")}


def tier_files(memory: Path) -> set[int]:
    """The inodes of the memory tier's slot files, free or a step's data file."""
    steps = [p for p in memory.glob("step_*/*.safetensors")]
    return {p.stat().st_ino for p in [*slot_files(memory), *steps]}


# -- the log of a save waiting for its slot --------------------------------------------------------


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _wait_until(done) -> None:
    """Wait for ``done()`` (nothing signals it); fail after ``TIMEOUT``."""
    stop = threading.Event()
    for _ in range(TIMEOUT * 100):
        if done():
            return
        stop.wait(0.01)
    raise AssertionError("never happened")
