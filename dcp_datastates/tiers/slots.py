"""Memory-tier slots: files of the memory tier that snapshots are copied into directly.

A slot is a file on the memory tier's file system (tmpfs), mapped shared and pinned once by the
engine (:meth:`~dcp_datastates.Engine.map_file`) and reused save after save. A managed save
snapshots its state straight into a slot, laid out as the data file lays it out after a header
room; the save job then writes only the header and the bytes items, and renames the slot's file
into the step directory as that step's data file: the snapshot *is* the memory-tier copy, with
no second copy. When retention drops the step, its ``.metadata`` goes first and the file moves
back to the slot directory, free for a later save. A slot whose file is gone (a failed save
removed it) is unmapped and forgotten.

Slot files live in ``<memory_dir>/.slots.<pid>.<token>`` (one directory per pool, so two managers
of a process on one tier keep theirs apart); a new pool deletes those of processes that are
gone (a slot holds no checkpoint until it is renamed into a step directory).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
from pathlib import Path

from ..align import ALIGN, round_up
from ..directory import new_token
from ..host_cache import Arena, Lease
from .steps import alive

log = logging.getLogger("dcp_datastates")

SLOT_DIR_PREFIX = ".slots."
#: Header room of a slot: this much, plus ``ENTRY_BYTES`` per tensor (names are rarely longer).
BASE_ROOM, ENTRY_BYTES = 64 << 10, 512


def header_room(entries: int) -> int:
    """Bytes a slot keeps before its data for the header of ``entries`` tensors."""
    return round_up(BASE_ROOM + ENTRY_BYTES * entries, ALIGN)


class Slot:
    """One slot file, its mapping, and where the file is now (its home or a step directory).
    A snapshot target (``snapshot.SnapshotTarget``) of memory-tier saves."""

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.pool = pool
        self.home = pool.directory / f"slot_{index}"
        self.path = self.home
        self.room = 0  # the data starts here
        self.arena: Arena | None = None
        self.fd = -1  # the file is made by the first fit()

    def __str__(self) -> str:
        return f"memory-tier slot {self.home}"

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes if self.arena is not None else 0

    def fit(self, total: int, entries: int) -> None:
        """Size the slot for ``total`` bytes of data after the header room for ``entries``
        tensors, mapping and pinning it again if its size changes (seconds per GiB)."""
        room = max(self.room, header_room(entries))
        size = room + round_up(total)
        if self.arena is not None and self.arena.nbytes == size and self.room == room:
            return
        self.unmap()
        if self.fd < 0:
            self.fd = os.open(self.home, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        os.ftruncate(self.fd, 0)  # no stale bytes of an earlier size
        os.posix_fallocate(self.fd, 0, size)  # ENOSPC now, not SIGBUS at a copy into a hole
        self.arena = self.pool.engine.map_file(self.fd, size, f"memory-tier slot {self.home}")
        self.room = room

    def lease(self, total: int, entries: int) -> Lease | None:
        """Where a snapshot of ``total`` bytes goes: the slot's data region (the slot is
        sized first, on the caller's thread: the engine's staging thread). None if busy."""
        self.fit(total, entries)
        return self.arena.pool.try_allocate_at(self.room, total)

    def need_room(self, header_len: int) -> None:
        """A header of ``header_len`` bytes did not fit: the next save makes the room."""
        self.room = max(self.room, round_up(header_len, ALIGN))

    def adopt(self, path: Path) -> Path:
        """Move the slot's file to ``path`` (a step's data file); return ``path``."""
        os.rename(self.path, path)
        self.path = path
        return path

    def unmap(self) -> None:
        if self.arena is not None:
            self.pool.engine.unmap_file(self.arena)
            self.arena = None

    def close(self) -> None:
        """Unmap the slot and close its file (the file stays where it is)."""
        self.unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotPool:
    """A memory tier's slots: ``limit`` at most, free or holding a step's data file."""

    def __init__(self, engine: object, memory: Path, limit: int) -> None:
        self.engine = engine
        self.directory = memory / f"{SLOT_DIR_PREFIX}{os.getpid()}.{new_token()}"
        self.limit = limit
        self._free: list[Slot] = []
        self._held: dict[Path, Slot] = {}  # step directory -> its slot
        self._count = 0  # slots mapped now
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._warned = False
        _remove_dead_pools(memory)
        self.directory.mkdir(parents=True)

    def take(self, warn: bool = True) -> Slot | None:
        """A free slot (made if fewer than ``limit`` exist); None when all are in use (logged
        once, with ``warn``: the save is copied into the tier instead)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif self._count < self.limit:
                slot = Slot(self, next(self._names))
                self._count += 1
            else:
                if warn and not self._warned:
                    log.warning("dcp_datastates: all %d memory-tier slots are in use; this save "
                                "(and any other while they are) is copied into the tier "
                                "instead of snapshotted into it (slower)", self.limit)
                    self._warned = True
                return None
            return slot

    def prepare(self, total: int, entries: int) -> None:
        """Make every slot now and size it for ``total`` bytes of ``entries`` tensors."""
        with self._lock:
            while self._count < self.limit:
                self._free.append(Slot(self, next(self._names)))
                self._count += 1
            for slot in self._free:
                slot.fit(total, entries)

    def free_bytes(self) -> int:
        """Bytes that free slots take on the tier (a save can reuse them)."""
        with self._lock:
            return sum(s.nbytes for s in self._free)

    def settle(self, slot: Slot, directory: Path, committed: bool) -> None:
        """A save that had ``slot`` has ended: the slot is free again (the save did not use
        it), held by the step ``directory`` (committed there), or lost (a failed save)."""
        replaced = None
        with self._lock:
            if committed:  # a step saved again: the file it held was replaced (removed)
                old = self._held.get(directory)
                if old is not None and old is not slot and not old.path.exists():
                    replaced = self._held.pop(directory)
        if replaced is not None:
            self._forget(replaced)
        with self._lock:
            if slot.path == slot.home:
                self._free.append(slot)
                return
            if committed and slot.path.parent == directory and slot.path.exists():
                self._held[directory] = slot
                return
        self._forget(slot)

    def reclaim(self, directory: Path) -> None:
        """The step ``directory`` is being dropped (its ``.metadata`` is gone): its slot
        goes back home, free."""
        with self._lock:
            slot = self._held.pop(directory, None)
        if slot is None:
            return
        try:
            slot.adopt(slot.home)
        except OSError as exc:  # the file went: the slot with it
            log.warning("dcp_datastates: memory-tier slot %s lost (%s)", slot.path, exc)
            self._forget(slot)
            return
        with self._lock:
            self._free.append(slot)

    def _forget(self, slot: Slot) -> None:
        with self._lock:
            self._count -= 1
        slot.close()
        if slot.path == slot.home:
            slot.home.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap every slot; remove the free ones (held ones are steps' data files)."""
        with self._lock:
            slots = [*self._free, *self._held.values()]
            self._free, self._held = [], {}
        for slot in slots:
            self._forget(slot)
        shutil.rmtree(self.directory, ignore_errors=True)


def _remove_dead_pools(memory: Path) -> None:
    """Delete slot directories of processes that are gone."""
    for entry in memory.glob(f"{SLOT_DIR_PREFIX}*"):
        pid = entry.name[len(SLOT_DIR_PREFIX):].split(".")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
