"""Helpers of the whole suite: state builders, saves and loads, bit-exact comparisons, tier
directories, processes killed mid-run. Fixtures are in ``conftest.py``."""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._io import make_backend
from dcp_datastates.errors import UringUnavailable

#: The suite's directory (``tests/``) and the repository's root.
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

BACKENDS = ["threads", "uring"]

#: Every dtype that has a safetensors name (stored as that dtype in the data file).
SAFETENSORS_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
#: Dtypes safetensors cannot hold: stored as raw U8 arrays.
RAW_DTYPES = [torch.complex128, torch.complex32] + [
    getattr(torch, name) for name in ("float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, name)
]
ALL_DTYPES = SAFETENSORS_DTYPES + RAW_DTYPES


#: ``pytestmark`` of the core suite's modules.
MARKS = [
    pytest.mark.usefixtures("no_backend_override"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    # torch.load(weights_only=True) of a damaged or foreign .metadata
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
]


def require_backend(name: str) -> str:
    """``name``, after skipping the test where that backend cannot be made here."""
    try:
        backend, _ = make_backend(name)
    except UringUnavailable as e:
        pytest.skip(f"io_uring unavailable here: {e.reason}")
    backend.close()
    return name


ENGINE_ARGS = ("host_cache_size", "io_backend", "io_workers")


def split_engine_args(kw: dict) -> dict:
    """Take the engine's arguments out of ``kw`` (writers and readers take only an engine)."""
    return {k: kw.pop(k) for k in ENGINE_ARGS if k in kw}


# -- state builders ------------------------------------------------------------------------------
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rand_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads, subnormals, ... included)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    n = math.prod(shape) * itemsize(dtype)
    raw = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def blank_like(obj: object) -> object:
    """The same structure with every tensor filled with 0xA5 bytes and every leaf set to None."""
    if isinstance(obj, torch.Tensor):
        out = torch.empty(obj.shape, dtype=obj.dtype)
        if out.numel():
            out.reshape(-1).view(torch.uint8).fill_(0xA5)
        return out
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [blank_like(v) for v in obj]
    return None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(as_bytes(actual), as_bytes(expected)), f"{what}: bytes differ"


def assert_state_equal(actual: object, expected: object, path: str = "") -> None:
    """Recursive comparison; tensors bit for bit, everything else with ==."""
    if isinstance(expected, torch.Tensor):
        assert_bits_equal(actual, expected, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_state_equal(a, e, f"{path}.{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, (path, actual, expected)


def clone_state(obj: object) -> object:
    """Deep copy whose tensors keep their exact bytes (and shapes/strides of a fresh tensor)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


# -- save / load ---------------------------------------------------------------------------------
def save(state: dict, path: Path, writer: DataStatesWriter) -> None:
    dcp.save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)


def load_into(template: dict, path: Path, **reader_kw: object) -> dict:
    """Load ``path`` into a blank copy of ``template``'s structure and return it (engine
    arguments in ``reader_kw`` give the load an engine of its own)."""
    out = blank_like(template)
    assert isinstance(out, dict)
    engine_args = split_engine_args(reader_kw)
    engine = Engine(**engine_args) if engine_args and "engine" not in reader_kw else None
    try:
        reader = DataStatesReader(engine=engine, **reader_kw) if engine else DataStatesReader(
            **reader_kw)
        dcp.load(out, checkpoint_id=path, storage_reader=reader, no_dist=True)
    finally:
        if engine is not None:
            engine.close()
    return out


def small_state(seed: int = 0) -> dict:
    """A small state: two tensors of two dtypes and a nested dict of plain values."""
    return {
        "w": rand_tensor((300, 257), torch.float32, seed=seed),
        "b": rand_tensor((257,), torch.bfloat16, seed=seed + 1),
        "cfg": {"lr": 0.1 * (seed + 1), "name": f"run{seed}"},
    }


def small_checkpoint(tmp_path: Path, make_writer, seed: int = 0) -> tuple[Path, dict]:
    """:func:`small_state` saved into ``tmp_path / "ckpt"``; the directory and a copy of the
    state."""
    directory = tmp_path / "ckpt"
    state = small_state(seed)
    save(state, directory, make_writer())
    return directory, clone_state(state)


def square_state() -> dict:
    """A square float matrix (one a planner can transpose) and an int16 vector."""
    return {"m": rand_tensor((64, 64), torch.float32, seed=5),
            "v": rand_tensor((100,), torch.int16, seed=6)}


def run_script(script: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (a SIGBUS there fails the test, not the suite)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=Path.cwd(),
                          capture_output=True, text=True, timeout=timeout)


def data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".safetensors"))


@contextlib.contextmanager
def raises_in_dcp(exc_type: type[BaseException], match: str) -> Iterator[None]:
    """Check the error a DCP call raised: DCP wraps a rank's error in ``CheckpointException``
    (and some torch versions replace a failed metadata read by "metadata is None"), so the
    reader also raises a missing or damaged ``.metadata`` directly, from ``reset``."""
    with pytest.raises((CheckpointException, exc_type)) as info:
        yield
    err = info.value
    if isinstance(err, CheckpointException):
        errors = [exc for exc, _ in err.failures.values()]
        assert len(errors) == 1, errors
        err = errors[0]
    assert isinstance(err, exc_type), f"expected {exc_type.__name__}, got {err!r}"
    assert re.search(match, str(err)), f"{match!r} not in {str(err)!r}"


@dataclass
class Tiers:
    """Checkpoint tier directories of one test."""

    memory: Path  # under /dev/shm
    durable: Path  # on disk
    scratch: Path  # under /dev/shm, for anything else


def run_then_kill(argv: list[str], marker: str, err: Path, root: Path) -> None:
    """Run ``argv`` (with ``root`` on its import path, the default I/O backend) until it
    prints ``marker`` on a line, then SIGKILL it; its stderr goes to ``err`` (shown if the
    marker never comes)."""
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    err.parent.mkdir(parents=True, exist_ok=True)
    with open(err, "w") as errfile:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errfile, env=env,
                                 text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline() if ready else ""
        assert line.strip() == marker, (line, child.poll(), err.read_text()[-3000:])
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def descendants(pid: int) -> list[int]:
    """``pid``'s processes: its children, theirs, and so on (torchrun starts each rank in a
    session of its own: killing torchrun's process group leaves the ranks running)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        kids = [p for p, pp in parent.items() if pp == here]
        found += kids
        todo += kids
    return found


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie no one reaps has: its locks are released)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextlib.contextmanager
def mounted_tmpfs(size: str, prefix: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``, e.g. "2m") on a new directory, unmounted and
    removed after; skips the test where mounting is not permitted (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix=prefix))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()
