"""A two-rank job that starts async saves and destroys the process group while they are in
flight, as the last lines of a torchrun script do; started by ``tests/jobs/test_teardown.py``
(``python teardown_job.py <root> <mode>`` per rank, ``RANK`` in the environment; each process
group meets in a ``FileStore`` under ``<root>``). Not a test module.

``shared`` (default): each rank saves items of its own (``rank<r>``) and a tensor both hold
alike into ``<root>/ckpt`` with a fresh ``DataStatesWriter()``, does not wait, then calls
``dist.destroy_process_group()`` and exits.

``own``: each rank saves a checkpoint of its own, ``dcp.async_save(no_dist=True)`` into
``<root>/own<r>`` and a ``CheckpointManager``'s step 1 into its memory tier ``<root>/mem<r>``;
their snapshots are handed out only once the group is destroyed (a held settle thread), so
both saves are in flight then. It waits for both and prints ``rank <r>: saved``.

``stager``: :data:`TRIALS` trials, each on a group of its own: a DTensor state (``Shard(0)``
on a CPU mesh) saved whole into ``<root>/ckpt<t>`` (copied to ``<root>/ckpt<t>.before``), then
saved again over it
(``overwrite=True``) staged by DCP's ``DefaultStager`` (:class:`GatedStager`), the group
destroyed meanwhile: before the staged state is handed out (even trials) or a moment after
(odd ones); in the :data:`HELD` trials, while DCP's save writes the data files: rank ``t - 6``
(of trial ``t``) destroys it once its data file write has begun (held by its engine's backend
until then), the other once its own data file is written. Prints ``rank <r> trial <t>: saved``
or ``... failed: <error>``.

``regroup``: the same save over a complete checkpoint in ``<root>/ckpt-<stager>``, staged by
the writer itself and then by a ``DefaultStager``; each time the group is destroyed and a new
one made before the staged state is handed out, and the ranks run collectives on the new one
(training) while the save goes on. Prints ``rank <r> <stager>: saved`` or ``... failed:
<error>``, then ``rank <r>: trained``.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.fakes import FaultyBackend, HeldSettles
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine
from dcp_datastates._io import ThreadPoolBackend

#: trials of ``stager`` mode
TRIALS = 8
#: trials of ``stager`` mode whose group is destroyed while DCP's save writes the data files
HELD = (6, 7)
#: elements of each rank's shard of the DTensor
SHARD = 1 << 16
#: how long a rank waits for a save (a save that hangs fails the job)
WAIT_S = 20.0


def join(root: Path, name: str, rank: int) -> None:
    """Join the two-rank gloo group that meets in ``<root>/store-<name>``."""
    store = dist.FileStore(str(root / f"store-{name}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=WAIT_S))


def save_whole(ckpt: Path, rank: int, **writer_kw: object) -> None:
    """Save version 1 of the state into ``ckpt``; rank 0 keeps a copy of it in
    ``<ckpt>.before`` (the checkpoint a later save must leave intact, or replace whole)."""
    dcp.save(dtensor_state(1, rank), checkpoint_id=ckpt,
             storage_writer=DataStatesWriter(**writer_kw))  # type: ignore[arg-type]
    if rank == 0:
        shutil.copytree(ckpt, ckpt.with_suffix(".before"))


def dtensor_state(version: int, rank: int) -> dict:
    """Version ``version`` of the state: a DTensor whose shard on rank r is ``10*version+r``
    (on a CPU mesh of the group now up) and a step both ranks hold alike."""
    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((SHARD,), float(10 * version + rank))
    return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
            "step": torch.tensor(version)}


class GatedStager(DefaultStager):
    """DCP's ``DefaultStager`` (CPU, staging on its thread) whose staged state dict is handed
    out only once ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(StagingOptions(False, False, True, False))
        self.gate = gate

    def stage(self, state_dict: dict, **kwargs: object) -> Future:  # type: ignore[override]
        staged = super().stage(state_dict, **kwargs)
        out: Future = Future()

        def hand_out() -> None:
            self.gate.wait()
            out.set_result(staged.result())  # type: ignore[union-attr]

        threading.Thread(target=hand_out, daemon=True).start()
        return out


def outcome(response: object) -> str:
    """``saved`` or ``failed: <error>`` for an async save's response."""
    try:
        response.upload_completion.result(timeout=WAIT_S)  # type: ignore[attr-defined]
    except BaseException as exc:  # noqa: BLE001 - the job reports it (DCP's is a BaseException)
        return "failed: " + " ".join(str(exc).split())
    return "saved"


def shared(root: Path, rank: int) -> None:
    join(root, "shared", rank)
    state = {f"rank{rank}": torch.full((8 << 20,), float(rank)), "both": torch.arange(1000)}
    dcp.async_save(state, checkpoint_id=root / "ckpt", storage_writer=DataStatesWriter())
    dist.destroy_process_group()


def own(root: Path, rank: int) -> None:
    join(root, "own", rank)
    held = HeldSettles()
    with Engine(io_backend="threads", settle_pool=held) as engine:
        state = {"w": torch.full((1 << 16,), float(rank))}
        manager = CheckpointManager(None, memory_dir=root / f"mem{rank}", persist=None,
                                    engine=engine)
        response = dcp.async_save(state, checkpoint_id=root / f"own{rank}", no_dist=True,
                                  storage_writer=DataStatesWriter(engine=engine))
        handle = manager.save(1, state)
        dist.destroy_process_group()
        held.gate.set()
        response.upload_completion.result(timeout=60)
        handle.result(timeout=60)
        manager.close()
    print(f"rank {rank}: saved", flush=True)


def stager(root: Path, rank: int) -> None:
    for trial in range(TRIALS):
        join(root, f"trial{trial}", rank)
        ckpt = root / f"ckpt{trial}"
        save_whole(ckpt, rank)
        if trial in HELD:
            print(f"rank {rank} trial {trial}: {held_write(ckpt, rank, trial - 6)}", flush=True)
            continue
        gate = threading.Event()
        response = dcp.async_save(dtensor_state(2, rank), checkpoint_id=ckpt,
                                  storage_writer=DataStatesWriter(overwrite=True),
                                  async_stager=GatedStager(gate))
        if trial % 2 == 0:
            dist.destroy_process_group()
            gate.set()
        else:
            gate.set()
            time.sleep(0.002 * trial)
            dist.destroy_process_group()
        print(f"rank {rank} trial {trial}: {outcome(response)}", flush=True)


def held_write(ckpt: Path, rank: int, holder: int) -> str:
    """The save over ``ckpt``, its group destroyed while DCP's save writes the data files: on
    rank ``holder`` once its write has begun (held until then), on the other once its data
    file is written (fsynced). Its outcome."""
    written = threading.Event()
    backend = FaultyBackend(ThreadPoolBackend(), gated=rank == holder,
                            on_fsync=lambda path: written.set())
    with Engine(io_backend=backend) as engine:
        gate = threading.Event()
        response = dcp.async_save(dtensor_state(2, rank), checkpoint_id=ckpt,
                                  storage_writer=DataStatesWriter(engine=engine, overwrite=True),
                                  async_stager=GatedStager(gate))
        gate.set()
        (backend.write_started if rank == holder else written).wait(WAIT_S)
        dist.destroy_process_group()
        backend.gate.set()
        return outcome(response)


def regroup(root: Path, rank: int) -> None:
    held = HeldSettles()
    with Engine(io_backend="threads", settle_pool=held) as engine:
        for name in ("writer", "default"):
            join(root, f"{name}-a", rank)
            ckpt = root / f"ckpt-{name}"
            save_whole(ckpt, rank, engine=engine)
            writer = DataStatesWriter(engine=engine, overwrite=True)
            gate = held.gate if name == "writer" else threading.Event()
            response = dcp.async_save(dtensor_state(2, rank), checkpoint_id=ckpt,
                                      storage_writer=writer,
                                      async_stager=writer if name == "writer" else
                                      GatedStager(gate))
            dist.destroy_process_group()
            join(root, f"{name}-b", rank)
            gate.set()
            for _ in range(50):  # the training's collectives, on the new group
                dist.all_reduce(torch.ones(1000))
            print(f"rank {rank} {name}: {outcome(response)}", flush=True)
            dist.destroy_process_group()
    print(f"rank {rank}: trained", flush=True)


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "shared"
    {"shared": shared, "own": own, "stager": stager, "regroup": regroup}[mode](
        root, int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
