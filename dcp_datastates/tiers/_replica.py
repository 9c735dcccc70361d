"""Peer replicas of memory-tier checkpoints, sent over a torch.distributed (gloo) group.

After each save, rank ``r`` sends its memory-tier step to rank ``r + 1`` (mod the world size),
which keeps it under ``<memory_dir>/replicas/rank_<r>/step_<N>``; in a real job the peer is on
another node, so the loss of one node's memory can be restored from memory. At restore, a
holder sends a replica back to the rank that lost its copy. Files travel as uint8 tensors
mapped from (and received straight into) the tmpfs files; ``.metadata`` is written last, so a
replica is committed, like any checkpoint, only once it is whole.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from .._format.directory import LOCK_NAME, fsync_dir
from .._format.metadata_file import METADATA_NAME
from ._steps import make_private, remove_step, step_dir

log = logging.getLogger("dcp_datastates")

#: The directory of a memory tier that holds its replicas of other ranks' steps.
REPLICAS = "replicas"


def replica_root(memory_root: Path, owner: int) -> Path:
    return memory_root / REPLICAS / f"rank_{owner}"


def _files(directory: Path) -> list[str]:
    """The files of a committed step to send, ``.metadata`` last."""
    names = sorted(e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)
                   and e.name != LOCK_NAME and ".tmp." not in e.name)
    names.remove(METADATA_NAME)
    return [*names, METADATA_NAME]


def _as_tensor(path: Path, nbytes: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor mapped from it (the file must be ``nbytes`` long)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class Exchange:
    """Sends and receives of step directories between ranks of ``group`` (None: the default
    group), posted together."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, directory: Path | None, dst: int) -> None:
        """Post the sends of ``directory`` (None: an empty message) to global rank ``dst``."""
        names: list[str] = []
        sizes: list[int] = []
        try:
            if directory is not None:
                names = _files(directory)
                sizes = [os.stat(directory / n).st_size for n in names]
        except (OSError, ValueError) as exc:  # gone, or not committed: the peer still expects
            log.warning("dcp_datastates: %s cannot be sent to rank %d (%s); sending nothing",
                        directory, dst, exc)
            names, sizes = [], []
        listing = json.dumps(list(zip(names, sizes, strict=True))).encode()
        manifest = torch.frombuffer(bytearray(listing), dtype=torch.uint8)
        self._post(torch.tensor([manifest.numel()], dtype=torch.int64), dst)
        self._post(manifest, dst)
        for name, size in zip(names, sizes, strict=True):
            if size:
                assert directory is not None  # there are names only with a directory
                self._post(_as_tensor(directory / name, size), dst)

    def _post(self, tensor: torch.Tensor, dst: int) -> None:
        work = dist.isend(tensor, dst, group=self.group)
        if work is None:  # only where this rank is not in the group
            raise RuntimeError(f"this rank is not in the replication group of rank {dst}")
        self._pending.append((work, tensor))

    def receive(self, src: int, directory: Path) -> bool:
        """Receive a step from global rank ``src`` into ``directory`` (replacing what is there);
        False where ``src`` sent nothing."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, src, group=self.group)
        manifest = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(manifest, src, group=self.group)
        entries = json.loads(bytes(manifest.tolist())) if manifest.numel() else []
        if not entries:
            return False
        remove_step(directory)
        make_private(directory)
        for name, size in entries:
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"rank {src} sent a bad file name {name!r}")
            final = directory / name
            path = final if name != METADATA_NAME else directory / f"{name}.tmp.replica"
            with open(path, "wb") as f:
                f.truncate(size)
            if size:
                dist.recv(_as_tensor(path, size), src, group=self.group)
            if path != final:
                os.replace(path, final)
        fsync_dir(directory)
        return True

    def wait(self) -> None:
        """Wait for every send posted."""
        pending, self._pending = self._pending, []
        for work, _tensor in pending:
            work.wait()


def replicate_step(group: dist.ProcessGroup, rank: int, world: int, memory_root: Path,
                   step: int, mine: Path | None) -> Path | None:
    """Send ``mine`` (this rank's committed step, or None) to the next rank and keep the
    previous rank's in ``memory_root``'s replicas; return the replica's directory, if any."""
    ex = Exchange(group)
    peer_from = (rank - 1) % world
    ex.send(mine, (rank + 1) % world)
    target = step_dir(replica_root(memory_root, peer_from), step)
    try:
        got = ex.receive(peer_from, target)
    finally:
        ex.wait()
    return target if got else None


def restore(group: dist.ProcessGroup | None, rank: int, moves: list[tuple[int, int]],
            memory_root: Path, step: int) -> bool:
    """Carry out ``moves`` ((holder, owner) pairs, the same list on every rank): holders send
    their replica of the owner's ``step`` back, owners receive it into their own tier.
    Returns whether this rank received its step."""
    ex = Exchange(group)
    for holder, owner in moves:
        if holder == rank:
            ex.send(step_dir(replica_root(memory_root, owner), step), owner)
    got = False
    try:
        for holder, owner in moves:
            if owner == rank:
                got = ex.receive(holder, step_dir(memory_root, step))
    finally:
        ex.wait()
    return got
