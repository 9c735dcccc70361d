"""Multi-rank test helpers: torch.distributed from mpirun or torchrun, agreement, shared dirs.

``init_distributed()`` starts the default process group once per process:

* under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) it uses
  them as they are;
* under ``mpirun`` (Open MPI's ``OMPI_COMM_WORLD_*``, or PMI/PMIx variables) it takes rank and
  size from MPI, and rank 0 picks a free TCP port that mpi4py broadcasts to the others.
  ``MASTER_ADDR`` is 127.0.0.1 when every rank runs on one host, otherwise rank 0's host name
  (an ``MASTER_ADDR`` already in the environment wins).

The backend is gloo on CPU-only hosts and ``cpu:gloo,cuda:nccl`` where CUDA is available (DCP's
``async_save`` needs a CPU backend). A collective that waits longer than ``timeout_s`` raises
instead of hanging the run.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_MPI_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID")


def _first_env(names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in os.environ:
            return os.environ[name]
    return None


def launched_by() -> str | None:
    """``"torchrun"``, ``"mpirun"`` or None (a plain single process)."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"
    if _first_env(_MPI_RANK_VARS) is not None and _first_env(_MPI_SIZE_VARS) is not None:
        return "mpirun"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env_from_mpi() -> None:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI."""
    from mpi4py import MPI  # imported only under mpirun: it initialises MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    local_rank = _first_env(_MPI_LOCAL_RANK_VARS)
    if local_rank is None:
        local_rank = str(sum(h == hosts[rank] for h in hosts[:rank]))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["LOCAL_RANK"] = local_rank
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
    os.environ.setdefault("MASTER_PORT", str(port))


def init_distributed(timeout_s: float = 180) -> tuple[int, int]:
    """Start the default process group (once); return (rank, world size).

    Returns (0, 1) without starting anything when launched as a plain process.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    how = launched_by()
    if how is None:
        return 0, 1
    if how == "mpirun":
        _env_from_mpi()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(errors: list[str], what: str = "") -> None:
    """Raise on every rank if any rank reports an error (so no rank is left in a collective).

    Each rank passes the problems it found; all ranks learn all of them.
    """
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    found = [f"rank {r}: {e}" for r, errs in enumerate(gathered) for e in (errs or [])]
    assert not found, f"{what}\n" + "\n".join(found)


@contextmanager
def collecting(errors: list[str], what: str) -> Iterator[None]:
    """Turn an exception inside the block into an entry of ``errors`` (for ``agree``)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
        errors.append(f"{what}: {type(exc).__name__}: {exc}")


@contextmanager
def shared_tmp_dir(prefix: str = "dcp_datastates_mpi_") -> Iterator[Path]:
    """A directory every rank sees (made by rank 0, removed after all ranks are done).

    ``DCP_DATASTATES_SHARED_TMP`` names its parent (a shared file system across nodes);
    otherwise the system temporary directory, which is enough on one host.
    """
    rank = dist.get_rank()
    parent = os.environ.get("DCP_DATASTATES_SHARED_TMP") or tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix=prefix, dir=parent) if rank == 0 else None
    path = Path(broadcast_object(path))
    try:
        yield path
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class World:
    rank: int
    size: int


@pytest.fixture(scope="session")
def world() -> Iterator[World]:
    """The default process group over all ranks (skips the test in a plain single process).

    Test modules take it with ``world = mpi_util.world``.
    """
    rank, size = init_distributed()
    if size < 2:
        pytest.skip("needs several ranks: mpirun -n 2 (or 4) ... --with-mpi, or torchrun")
    torch.set_num_threads(1)  # ranks share few cores; tiny models gain nothing from threads
    yield World(rank, size)
    if dist.is_initialized():
        # Work objects still referenced when the interpreter exits make gloo's threads abort
        # the process ("terminate called without an active exception"): let them go first.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


@pytest.fixture
def shared(world: World) -> Iterator[Path]:
    """A fresh directory that every rank sees, removed after the test."""
    with shared_tmp_dir() as path:
        yield path


@pytest.fixture
def nodes(world: World) -> Iterator[Path]:
    """A /dev/shm directory for the test: rank r's memory tier is ``node_<r>`` in it."""
    path = tempfile.mkdtemp(prefix="dcp_mpi_nodes_", dir="/dev/shm") if world.rank == 0 else None
    path = Path(broadcast_object(path))
    try:
        yield path
    finally:
        try:
            dist.barrier()
        finally:  # removed also when a failed test broke the group
            if world.rank == 0:
                shutil.rmtree(path, ignore_errors=True)


def data_file_bytes(directory: Path) -> dict[str, int]:
    """Size of each data file (``*.safetensors``) in a checkpoint directory."""
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.suffix == ".safetensors"}
