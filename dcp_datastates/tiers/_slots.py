"""Memory-tier slots: files of the memory tier that snapshots are copied into directly.

A slot is a file on the memory tier's file system (tmpfs), mapped shared by the engine
(:meth:`~dcp_datastates.Engine.map_file`) and reused save after save. A managed save
snapshots its state straight into a slot, laid out as the data file lays it out after a header
room; the save job then writes only the header and the bytes items, and renames the slot's file
into the step directory as that step's data file: the snapshot *is* the memory-tier copy, with
no second copy. When retention drops the step, its ``.metadata`` goes first and the file moves
back to the slot directory, free for a later save. A slot whose file is gone (a failed save
removed it) is unmapped and forgotten.

Making a slot (populating its pages and pinning them: seconds for a few GiB) never delays a
save's call or the training: the pool's thread (:mod:`~dcp_datastates._workers.background`)
sizes and pins free slots in the background, one at a time, the one the next save needs first.
From :meth:`SlotPool.prepare` on, the pool makes the slots that saves committed before the
next one comes (every N steps) rotate through, its ``rotation``: the kept steps, the one being
written and the spare (``keep_memory + 2``), one after the other in the background while
training starts, so that saves find theirs ready as early as they can be; then it keeps
:data:`SPARE` free slot(s) sized and pinned ahead of the next save, up to its ``limit`` (one
more than the rotation: while a step older than the kept ones is still being persisted,
retention leaves it). Slots are sized as ``prepare()`` said, or as two saves in a row took (a
state that grew since, e.g. by its optimizer's state, has its free slots sized again in the
background); a slot a dropped step gives back is free again (slots made stay).
A save taken while no free slot is ready (every slot in use, the next one still being sized
and pinned, or saves waiting for one) gets the next one to come free (:class:`NextSlot`), in
save order: its snapshot waits aside meanwhile (on the GPU where it has room), and its move is
queued once the slot is given (where the GPU has no room to keep it aside, the save's staging
thread waits for the slot instead, or for room: an earlier snapshot aside moving out). No copy
goes into a slot not pinned yet: a copy into pageable memory holds the CUDA driver, and the
training's next CUDA call waits for all of it (so does it, less, while two slots are made at
once); once pinning has failed, saves take unpinned slots, and once the tier had no room for a
slot the pool's thread sized (its pages go back to the tier), saves size their slots
themselves (the thread still pins them once they are free).

Slot files live in ``<memory_dir>/.slots.<pid>.<token>``, one directory per pool. The pool's
manager holds the memory tier's claim (:mod:`.claims`), so any other slot directory there was
left by a manager that is gone (killed): the new pool adopts its files as free slots (their
pages are reused where their size covers the state's; pinning is per process, so they are
pinned again in the background), up to its ``limit``; the rest are removed.

Each slot is in one :class:`SlotState` (FREE, SIZING, PINNING, DOOMED, IN_SAVE, HELD, GONE):
:data:`MOVES`, next to it, lists the moves a slot may make, and :meth:`SlotPool._move` makes
each one (refusing any other: a bug); the pool's free slots, those being readied and the
steps' are views of those states. What the pool stopped doing for good (a save had no room,
the tier had none for a slot, pinning failed, closed) is one :class:`Mode`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from .._format.align import ALIGN, round_up
from .._format.directory import new_token
from .._memory.host_cache import Arena, Lease
from .._sizes import free_bytes
from .._workers.background import Background
from ._steps import make_private


class FileMapper(Protocol):
    """What the slots need of the engine (:class:`dcp_datastates._engine.Engine`): arenas over
    their files."""

    def map_file(self, fd: int, nbytes: int, name: str, *, pin: bool = True) -> Arena: ...
    def pin_file(self, arena: Arena) -> None: ...
    def unmap_file(self, arena: Arena) -> None: ...

log = logging.getLogger("dcp_datastates")

SLOT_DIR_PREFIX = ".slots."
#: Free slots the pool keeps sized and pinned ahead of the next save once the rotation is
#: made (``prepare()`` makes the rotation's slots, as many as the tier has room for).
SPARE = 1
#: how long a save that found the tier short waits for the slots being sized (wait_sized)
READY_WAIT_S = 60.0
#: Header room of a slot: this much, plus ``ENTRY_BYTES`` per tensor (an entry, its alignment
#: pad's and its share of the bytes items'; a header that outgrows it raises the pool's room).
BASE_ROOM, ENTRY_BYTES = 64 << 10, 1024


class SlotState(enum.Enum):
    """Where a slot is; :data:`MOVES` lists the moves, :meth:`SlotPool._move` makes them."""

    FREE = enum.auto()  #: at home, no save's (its file is made by its first fit, or adopted)
    SIZING = enum.auto()  #: being sized by the pool's thread: the tier's pages move
    PINNING = enum.auto()  #: sized, being pinned by the pool's thread
    DOOMED = enum.auto()  #: given up by release_free while being readied: goes once it is
    IN_SAVE = enum.auto()  #: taken by a save, not settled yet
    HELD = enum.auto()  #: a committed step's data file
    GONE = enum.auto()  #: unmapped and closed (or being): no longer the pool's


FREE, SIZING, PINNING, DOOMED, IN_SAVE, HELD, GONE = SlotState  # in the order above
#: Every move a slot may make; any other is a bug (:meth:`SlotPool._move` refuses it).
MOVES: Mapping[SlotState, frozenset[SlotState]] = MappingProxyType({
    FREE: frozenset({SIZING, IN_SAVE, GONE}),
    SIZING: frozenset({PINNING, FREE, DOOMED, GONE}),  # FREE: no room for it
    PINNING: frozenset({FREE, DOOMED, GONE}),  # GONE: the pool closed meanwhile
    DOOMED: frozenset({FREE, GONE}),  # FREE: a waiting save is owed it
    IN_SAVE: frozenset({FREE, HELD, GONE}),  # not used, committed, lost
    HELD: frozenset({FREE, GONE}),  # its step dropped: reclaimed, or with the step
    GONE: frozenset(),
})
#: The slots the pool's thread is readying (or giving up, DOOMED)
READYING = (SIZING, PINNING, DOOMED)


class Mode(enum.Flag):
    """What a pool stopped doing, for the rest of its life (:meth:`SlotPool._stop`); none
    at first: it sizes and pins free slots ahead of the saves, the rotation and spares."""

    GAVE_WAY = enum.auto()  #: a save had no room (release_free): no slot is made ahead
    NO_ROOM = enum.auto()  #: the tier had no room for a slot the thread sized: it only pins
    UNPINNED = enum.auto()  #: pinning failed: the thread readies none, saves take any slot
    CLOSED = enum.auto()  #: closed: waiting saves get no slot, one being readied goes


def _header_room(entries: int) -> int:
    """Bytes a slot keeps before its data for the header of ``entries`` tensors."""
    return round_up(BASE_ROOM + ENTRY_BYTES * entries, ALIGN)


def _slot_size(room: int, total: int, entries: int) -> int:
    """Bytes a slot takes with at least ``room`` bytes of header room before ``total`` bytes
    of data of ``entries`` tensors."""
    return max(room, _header_room(entries)) + round_up(total)


class Slot:
    """One slot file, its mapping, and where the file is now (its home or a step directory).
    A snapshot target (``snapshot.SnapshotTarget``) of memory-tier saves."""

    def __init__(self, pool: SlotPool, index: int) -> None:
        self.pool = pool
        self.home = pool.directory / f"slot_{index}"
        self.path = self.home
        self.room = 0  # the data starts here
        self.arena: Arena | None = None
        self.fd = -1  # the file is made by the first fit(), or adopted (a dead process's)
        self.pinned = False  # by the pool's thread (or nothing to pin: no GPU)
        self.state = FREE  # changed by the pool (SlotPool._move) alone

    def __str__(self) -> str:
        return f"memory-tier slot {self.home}"

    @property
    def nbytes(self) -> int:
        """Bytes the slot takes on the tier (0 if it is being closed meanwhile: other threads
        ask, e.g. :meth:`SlotPool.slot_bytes` while the pool's thread sizes it)."""
        return self._bytes(lambda st: st.st_size)

    def pages(self) -> int:
        """Bytes of the tier the slot's file holds now: a slot being sized, or that the tier
        had no room for, holds fewer than it takes once sized (:attr:`nbytes`)."""
        return self._bytes(lambda st: st.st_blocks * 512)

    def _bytes(self, of: Callable[[os.stat_result], int]) -> int:
        """The mapping's bytes, else ``of`` the file's status (0 without a file)."""
        arena, fd = self.arena, self.fd
        if arena is not None:
            return arena.nbytes
        try:
            return of(os.fstat(fd)) if fd >= 0 else 0
        except OSError:  # closed since it was read
            return 0

    def size_for(self, total: int, entries: int) -> int:
        """Bytes the slot takes once :meth:`fit` for ``total`` bytes of ``entries`` tensors."""
        return _slot_size(max(self.room, self.pool.room), total, entries)

    def sized_for(self, total: int, entries: int) -> bool:
        """Whether the slot is mapped as :meth:`fit` for ``total`` bytes of ``entries``
        tensors maps it (a fit would change nothing)."""
        return (self.arena is not None and self.room >= self._room_for(entries)
                and self.arena.nbytes == self.size_for(total, entries))

    def fit(self, total: int, entries: int) -> None:
        """Size the slot for ``total`` bytes of data after the header room for ``entries``
        tensors, mapping it again, unpinned, if its size changes. An adopted file keeps its
        pages where it covers that size; any other file is emptied first (no stale bytes)."""
        room = self._room_for(entries)
        size = self.size_for(total, entries)
        if self.arena is not None and self.arena.nbytes == size and self.room == room:
            return
        adopted = self.arena is None and self.fd >= 0
        self.unmap()
        if self.fd < 0:
            self.fd = os.open(self.home, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        covers = adopted and round_up(os.fstat(self.fd).st_size) >= size
        if not covers:
            os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, size)
        # mapping populates the pages: a tier without room fails here (ENOSPC), not with
        # SIGBUS at a copy into a hole; the pages populated until then go back to the tier
        try:
            self.arena = self.pool.engine.map_file(self.fd, size, str(self), pin=False)
        except BaseException:
            os.ftruncate(self.fd, 0)
            raise
        self.room = room

    def lease(self, total: int, entries: int) -> Lease | None:
        """Where a snapshot of ``total`` bytes goes: the slot's data region (the slot is
        sized first, on the caller's thread: the engine's staging thread). None if busy."""
        self.pool.saw(total, entries)
        self.fit(total, entries)
        assert self.arena is not None  # fit() maps the slot or raises
        return self.arena.pool.try_allocate_at(self.room, total)

    def _room_for(self, entries: int) -> int:
        """Header room for ``entries`` tensors: what the slot has, or the pool's saves need."""
        return max(self.room, self.pool.room, _header_room(entries))

    def need_room(self, header_len: int) -> None:
        """A header of ``header_len`` bytes did not fit: every slot makes the room (the free
        ones in the background, the others when a save next sizes them)."""
        self.pool.need_room(header_len)

    def when_ready(self, queue: Callable[[], None]) -> None:
        """The slot can be leased at once (the move sizes it, pinned or not): ``queue`` now."""
        queue()

    def adopt(self, path: Path) -> Path:
        """Move the slot's file to ``path`` (a step's data file); return ``path``."""
        os.rename(self.path, path)
        self.path = path
        return path

    def unmap(self) -> None:
        if self.arena is not None:
            self.pool.engine.unmap_file(self.arena)
            self.arena = None
        self.pinned = False

    def close(self) -> None:
        """Unmap the slot and close its file (the file stays where it is)."""
        self.unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class NextSlot:
    """The next slot of ``pool`` to come free, for a save taken while every slot is in use:
    a snapshot target that is not ready (the job copies the snapshot aside at once, or waits
    where that copy would go to pageable memory). The pool gives the slots that come free to
    the waiting saves in save order, and queues each one's move into its slot then
    (:meth:`when_ready`)."""

    pinned = False  # never ready at the save's call: the snapshot waits (aside)

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.slot: Slot | None = None  # given by the pool once one is free
        self.queue: Callable[[], None] | None = None  # the job's move, once the snapshot is aside

    def __str__(self) -> str:
        return "the next memory-tier slot to come free"

    @property
    def nbytes(self) -> int:
        """Bytes of the tier that the slot this save is to get holds now (the save reuses
        them; :meth:`SlotPool.next_bytes`)."""
        return self.pool.next_bytes(self)

    def when_ready(self, queue: Callable[[], None]) -> None:
        """Call ``queue`` once the pool has given this save its slot (or has closed)."""
        self.pool.when_given(self, queue)

    def lease(self, total: int, entries: int) -> Lease | None:
        """The given slot's lease (see :meth:`Slot.lease`)."""
        if self.slot is None:
            raise RuntimeError(f"the memory-tier slots of {self.pool.directory} closed before "
                               "one came free")
        return self.slot.lease(total, entries)

    def need_room(self, header_len: int) -> None:
        self._given().need_room(header_len)

    def adopt(self, path: Path) -> Path:
        return self._given().adopt(path)

    def _given(self) -> Slot:
        if self.slot is None:
            raise RuntimeError(f"no memory-tier slot of {self.pool.directory} was given")
        return self.slot


class SlotPool:
    """A memory tier's slots: ``limit`` at most, free or holding a step's data file, made
    from :meth:`prepare` on (``rotation`` of them, then :data:`SPARE` ahead of the saves);
    free ones are sized (after :meth:`prepare`) and pinned by a thread of the pool's, one at
    a time. Each slot is in one :class:`SlotState`, changed by :meth:`_move` alone."""

    def __init__(self, engine: FileMapper, memory: Path, limit: int,
                 rotation: int = SPARE, room: Callable[[], int] | None = None) -> None:
        self.engine = engine
        self.directory = memory / f"{SLOT_DIR_PREFIX}{os.getpid()}.{new_token()}"
        self.limit = limit
        self._rotation = min(rotation, limit)  # made from prepare() on (none once GAVE_WAY)
        # bytes the tier has for more (its free slots aside): its file system's, by default
        self._room = room or (lambda: free_bytes(self.directory))
        self._cap = 0  # bytes the rotation's slots may take (the tier's room at prepare)
        self._nbytes = 0  # bytes a save asks the tier for (prepare's): its slot's, or more
        self._slots: list[Slot] = []  # every slot not GONE, in the order of their last move
        self._want: tuple[int, int] | None = None  # the size prepare() gave: (total, entries)
        self._last: tuple[int, int] | None = None  # the size the last save took (saw)
        self.room = 0  # header room the saves' headers needed (need_room)
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._readied = threading.Condition(self._lock)  # a slot left SIZING, PINNING, DOOMED
        self._waiting: list[NextSlot] = []  # saves waiting for a slot, in save order
        self._mode = Mode(0)  # what the pool stopped doing (_stop)
        self._warned = False  # the saves waiting for a slot were logged
        make_private(self.directory)
        self._adopt_dead_pools(memory)
        self._thread = Background(self._ready_one, "dcp_datastates-pin")

    def _in(self, *states: SlotState) -> list[Slot]:
        """(Lock held) The slots in ``states``, in the order they entered them."""
        return [s for s in self._slots if s.state in states]

    def _move(self, slot: Slot, to: SlotState) -> None:
        """(Lock held) Move ``slot`` to ``to``; a move :data:`MOVES` does not list is a bug."""
        if to not in MOVES[slot.state]:
            raise RuntimeError(f"{slot}: no move from {slot.state.name} to {to.name}")
        slot.state = to
        self._slots.remove(slot)
        if to is not GONE:
            self._slots.append(slot)

    def _make(self) -> Slot:
        """(Lock held) A new slot, FREE (its file is made by its first fit)."""
        slot = Slot(self, next(self._names))
        self._slots.append(slot)
        return slot

    def _held_in(self, directory: Path) -> Slot | None:
        """(Lock held) The slot whose file is the step ``directory``'s data file."""
        return next((s for s in self._in(HELD) if s.path.parent == directory), None)

    def _stop(self, what: Mode) -> None:
        """(Lock held) The pool stops doing ``what`` (:class:`Mode`), for the rest of its life."""
        self._mode |= what

    def _sizes(self) -> tuple[int, int] | None:
        """(Lock held) The size the pool's thread sizes free slots for ahead of the saves, that
        take only ready ones (:meth:`saw`); None before :meth:`prepare`, and once the tier had
        no room for one, pinning failed or the pool closed: saves take any slot."""
        stopped = self._mode & (Mode.NO_ROOM | Mode.UNPINNED | Mode.CLOSED)
        return None if stopped else self._want

    def readying(self) -> bool:
        """Whether the pool's thread still has free slots to size or pin (the tier is being
        set up: the loop runs slower meanwhile, a save in flight or not)."""
        with self._lock:
            return bool(self._in(*READYING)) or self._want is not None and any(
                self._to_ready(s) for s in self._in(FREE))

    def _to_ready(self, slot: Slot) -> bool:
        """(Lock held) Whether the pool's thread is to size and pin ``slot`` (a free one):
        one not pinned, or not sized as the saves' state now is (none once UNPINNED)."""
        if self._mode & (Mode.UNPINNED | Mode.CLOSED):
            return False
        want = self._sizes()
        if want is not None:
            return not slot.pinned or not slot.sized_for(*want)
        return not slot.pinned and slot.arena is not None

    def saw(self, total: int, entries: int) -> None:
        """A save sizes its slot for ``total`` bytes of ``entries`` tensors: once
        :meth:`prepare` gave a size and two saves in a row took this one (a state that grew
        since, e.g. by the optimizer's state; not saves of two states in turn, whose slots
        would be sized again at each), the slots made and readied from now on are sized so,
        the free ones again, in the background."""
        size = (total, entries)
        with self._lock:
            last, self._last = self._last, size
            if self._want is None or self._want == size or last != size:
                return
            self._want = size
        self._thread.wake()

    def take(self, later: bool = False, spare: bool = True) -> Slot | NextSlot | None:
        """A free slot, pinned ones first, then ones with a file (made if fewer than ``limit``
        exist), unless saves wait for one. Else None, or with ``later`` the next one to come
        free after theirs (logged once: the save's snapshot waits aside, on the GPU where it
        has room). A spare is made in its place, unless ``spare`` is False (a save that may
        yet be skipped: :meth:`make_spares` once it is taken)."""
        with self._lock:
            slot = None if self._waiting else self._take(spare)
            if slot is None and later:
                waiting = NextSlot(self)
                self._waiting.append(waiting)
                in_use = len(self._slots) >= self.limit and not self._in(FREE, *READYING)
                warn = in_use and not self._warned
                self._warned = self._warned or in_use
        self._thread.wake()  # to ready the spare it made, or the slot on its way
        if slot is not None:
            return slot
        if not later:
            return None
        if warn:
            log.warning("dcp_datastates: all %d memory-tier slots are in use (earlier saves "
                        "are still being committed or persisted); this save (and any other "
                        "while they are) waits aside for the next free slot", self.limit)
        return waiting

    def when_given(self, waiting: NextSlot, queue: Callable[[], None]) -> None:
        """Call ``queue`` once ``waiting`` has its slot (now if it has), or the pool closed,
        or the save ended (settled: with no slot; its move lets its snapshot aside go). A
        second call (a save that waited for its slot, then went aside once the GPU had room)
        replaces the first's ``queue``, or calls it now where the first was served already."""
        with self._lock:
            waiting.queue = queue
            served = waiting not in self._waiting  # given its slot, closed or settled
        if served:
            queue()
            return
        self._serve()

    def _serve(self) -> None:
        """Give the free slots to the saves waiting for one, in save order, and queue the
        moves of those whose snapshot is aside (every one once the pool is closed: the
        move then finds no slot and goes to the engine's host cache)."""
        with self._lock:
            closed = Mode.CLOSED in self._mode
            short = False  # a save still waits: the slot on its way (made here) needs the thread
            for waiting in self._waiting:
                if waiting.slot is None and not closed:
                    waiting.slot = self._take()
                    if waiting.slot is None:
                        short = True
                        break
            # each save's queue as it is now: one it sets from here on (when_given) is its to call
            due = [(w, w.queue) for w in self._waiting
                   if w.queue is not None and (w.slot is not None or closed)]
            for waiting, _ in due:
                self._waiting.remove(waiting)
        if due or short:
            self._thread.wake()  # to ready the spares their slots made, or the slot on its way
        for _, queue in due:
            assert queue is not None  # due holds saves with a queue
            queue()

    def _take(self, spare: bool = True) -> Slot | None:
        """(Lock held) A free slot that is ready (pinned, sized as the saves' state is: see
        :meth:`saw`), now IN_SAVE. Where none is, None, and a slot is on its way: one being
        readied, a free one to ready, or a new one (``limit`` allowing) that the pool's thread
        sizes and pins, one at a time (two at once, or a save's copy into memory not pinned
        yet, stall the training's CUDA calls). Before :meth:`prepare` gave a size, once
        pinning failed, or once the tier had no room for a slot the thread sized: any free
        slot, else a new one (sized by the save). Then (``spare``) a spare is made in its
        place (readied once the caller wakes the thread)."""
        free, want = self._in(FREE), self._sizes()
        if want is not None:
            slot = next((s for s in reversed(free) if s.pinned and s.sized_for(*want)), None)
            if slot is None:
                if not self._in(FREE, *READYING) and len(self._slots) < self.limit:
                    self._make()
                return None
        elif free:
            slot = max(reversed(free), key=lambda s: (s.pinned, s.fd >= 0))
        elif len(self._slots) < self.limit:
            slot = self._make()
        else:
            return None
        self._move(slot, IN_SAVE)
        if spare:
            self._add_spares()
        return slot

    def make_spares(self) -> None:
        """A save taken with ``take(spare=False)`` goes ahead: make the spare(s) it left out."""
        with self._lock:
            self._add_spares()
        self._thread.wake()

    def _add_spares(self) -> None:
        """(Lock held) Make slots until the rotation is made and :data:`SPARE` are free or
        being readied, once :meth:`prepare` said how large (``limit`` and the tier's room
        allowing; none once GAVE_WAY, no spare once NO_ROOM)."""
        rotation = 0 if Mode.GAVE_WAY in self._mode else self._rotation
        spares = 0 if self._mode & (Mode.GAVE_WAY | Mode.NO_ROOM) else SPARE
        while (self._want is not None and len(self._slots) < self.limit and self._room_for_one()
               and (len(self._slots) < rotation
                    or len(self._in(FREE, *READYING)) < spares)):
            self._make()

    def _room_for_one(self) -> bool:
        """(Lock held) Whether the tier's room when :meth:`prepare` came (``room``, with the
        free slots' bytes) holds one slot more of the size it gave, and what a save asks
        beyond its slot: a slot made ahead without it would fail for want of room on the
        pool's thread (no slot is sized ahead from then on), or be removed by the next save's
        admission. A save that finds no slot free still gets one made (:meth:`_take`)."""
        assert self._want is not None  # asked once prepare() gave a size
        size = _slot_size(self.room, *self._want)
        return (len(self._slots) + 1) * size + max(0, self._nbytes - size) <= self._cap

    def slot_bytes(self) -> int:
        """Bytes the largest slot takes on the tier."""
        with self._lock:
            slots = self._in(FREE, *READYING, HELD)
        return max((s.nbytes for s in slots), default=0)

    def next_bytes(self, waiting: NextSlot) -> int:
        """Bytes of the tier that the slot ``waiting`` is to get holds now: the free slot
        (or one being readied) that comes to it in save order, whose pages may not be there
        yet (a slot made for it, that the tier may have no room for), else one that a step
        holds and gives back once a save in flight commits (the largest; none where no save
        is in flight: the step leaves only after this save)."""
        with self._lock:
            if waiting.slot is not None:
                return waiting.slot.pages()
            ahead = [w for w in self._waiting if w.slot is None]
            if waiting not in ahead:
                return 0  # settled: it gets none
            order = sorted(self._in(FREE, SIZING, PINNING), reverse=True,
                           key=lambda s: (s.pinned, s.state is not FREE, s.fd >= 0))
            index = ahead.index(waiting)
            if index < len(order):
                return order[index].pages()
            # a step's slot comes free when a save in flight commits and the step leaves the
            # tier; with none in flight (slots taken, not held), none comes before this save's
            slots = self._in(HELD) if self._in(IN_SAVE) else []
        return max((s.pages() for s in slots), default=0)

    def need_room(self, header_len: int) -> None:
        """A save's header of ``header_len`` bytes did not fit before its data: slots are
        sized with that room from now on (the free ones again, in the background)."""
        with self._lock:
            self.room = max(self.room, round_up(header_len, ALIGN))
        self._thread.wake()

    def snapshot_bytes(self) -> int:
        """Bytes of data a save's snapshot takes, as :meth:`prepare` (or later saves, see
        :meth:`saw`) said; 0 before."""
        with self._lock:
            return self._want[0] if self._want is not None else 0

    def prepared(self) -> bool:
        """Whether :meth:`prepare` gave the slots a size."""
        with self._lock:
            return self._want is not None

    def prepare(self, total: int, entries: int, wait: bool = False, nbytes: int = 0) -> None:
        """Make the rotation's slots now; the pool's thread sizes each free slot for ``total``
        bytes of ``entries`` tensors and pins it, in the background (``wait``: the calling
        thread helps, and returns once no free slot is left to ready). ``nbytes``: the bytes
        a save of that state asks the tier for (``memory_save.state_bytes``: a page per
        tensor, more than its slot where the state has many small ones); the rotation
        leaves room for what they exceed a slot by."""
        room = self._room()  # not under the lock: it asks for free_bytes()
        with self._lock:
            self._want = (total, entries)
            self._nbytes = nbytes
            self._cap = room + sum(s.nbytes for s in self._in(FREE))  # adopted slots' pages
            self._add_spares()
        self._thread.wake()
        if wait:
            while self._ready_one():
                pass
            with self._lock:
                self._readied.wait_for(lambda: not self._in(*READYING))

    def _ready_one(self) -> bool:
        """On the pool's thread: size (as :meth:`prepare` said) and pin one free slot; False
        when none needs it."""
        with self._lock:
            slot = next((s for s in self._in(FREE) if self._to_ready(s)), None)
            if slot is None:
                return False
            self._move(slot, SIZING)
            want = self._sizes()
        try:
            start = time.perf_counter()
            try:
                if want is not None and not slot.sized_for(*want):
                    slot.fit(*want)
            except Exception as exc:  # noqa: BLE001 - no room on the tier (ENOSPC): no caller
                with self._lock:
                    self._stop(Mode.NO_ROOM)
                log.warning("dcp_datastates: %s not made (%s): the memory tier has no room for "
                            "a slot ahead of the saves; none is made from now on, a save sizes "
                            "its slot itself", slot, exc)
            else:
                with self._lock:  # a slot release_free gave up (DOOMED) goes unpinned
                    pin = slot.state is SIZING
                    if pin:
                        self._move(slot, PINNING)
                        self._readied.notify_all()
                if pin:
                    self._pin(slot, start, time.perf_counter())
        finally:
            with self._lock:  # a DOOMED one a waiting save is owed is FREE again
                doomed = slot.state is DOOMED and not self._owed()
                gone = doomed or Mode.CLOSED in self._mode
                if not gone:
                    self._move(slot, FREE)
                elif not doomed:  # the pool closed meanwhile (a prepare(wait=True) was helping)
                    self._move(slot, GONE)
                self._readied.notify_all()
        if gone:
            self._forget(slot)
        else:
            self._serve()
        return True

    def _pin(self, slot: Slot, start: float, sized: float) -> None:
        """Pin ``slot`` (sized from ``start`` to ``sized``); once that fails, no more."""
        try:
            if slot.arena is None:
                raise RuntimeError("the slot is not mapped")
            self.engine.pin_file(slot.arena)
            slot.pinned = True
            log.info("dcp_datastates: %s ready: sized in %.2f s, pinned in %.2f s", slot,
                     sized - start, time.perf_counter() - sized)
        except Exception as exc:  # noqa: BLE001 - no caller: saves go on, unpinned
            log.warning("dcp_datastates: %s not pinned (%s); no more slots are pinned: "
                        "snapshots into them are copied at pageable speed", slot, exc)
            with self._lock:
                self._stop(Mode.UNPINNED)

    def free_bytes(self) -> int:
        """Bytes that free slots take on the tier (a save can reuse them), those the pool's
        thread is to size (a spare just made) at the size :meth:`prepare` gave; less the
        slots that the saves waiting for one are to get (each save counts its slot itself).
        """
        with self._lock:
            free, want = self._spare_slots(), self._sizes()
            return sum(s.nbytes if want is None else max(s.nbytes, s.size_for(*want))
                       for s in free)

    def _owed(self) -> int:
        """(Lock held) Saves waiting for a slot that none was given yet."""
        return 0 if Mode.CLOSED in self._mode else sum(w.slot is None for w in self._waiting)

    def _spare_slots(self) -> list[Slot]:
        """(Lock held) The free slots and those being readied that no waiting save is to get
        and :meth:`release_free` did not give up."""
        return self._unowed(self._in(FREE, SIZING, PINNING))

    def _unowed(self, slots: list[Slot]) -> list[Slot]:
        """(Lock held) ``slots`` (free ones) less those the waiting saves are to get: pinned
        ones first, then those being readied, then those with a file."""
        order = sorted(slots, key=lambda s: (s.pinned, s.state is not FREE, s.fd >= 0))
        return order[:max(0, len(order) - self._owed())]

    def release_free(self) -> int:
        """A save does not fit on the tier: remove the free slots that no waiting save is
        to get, and make no more spares; return how many go. One being readied is DOOMED:
        it goes once the pool's thread is done with it (not pinned; :meth:`wait_sized` waits
        for that)."""
        with self._lock:
            self._stop(Mode.GAVE_WAY)
            unowed = self._spare_slots()
            gone = [s for s in unowed if s.state is FREE]
            for slot in unowed:
                self._move(slot, GONE if slot in gone else DOOMED)
            kept = bool(self._in(FREE))
        if kept:
            self._thread.wake()  # to ready the free slots kept for waiting saves
        for slot in gone:
            self._forget(slot)
        if unowed:
            log.info("dcp_datastates: the memory tier %s had no room for a save: %d free "
                     "slot(s) removed; no slot is made ahead of the saves from now on",
                     self.directory.parent, len(unowed))
        return len(unowed)

    def wait_sized(self) -> None:
        """Wait until no slot is being sized, nor given up and not yet gone (SIZING, DOOMED):
        the tier's pages stop moving between its free space and the slots (a save that found
        the tier short counts its room again after; pinning, which moves none, is not waited
        for; bounded, logged if it runs out)."""
        with self._lock:
            if not self._readied.wait_for(lambda: not self._in(SIZING, DOOMED),
                                          timeout=READY_WAIT_S):
                log.warning("dcp_datastates: the memory-tier slots in %s were still being "
                            "made after %.0f s", self.directory, READY_WAIT_S)

    def settle(self, slot: Slot | NextSlot, directory: Path, committed: bool) -> None:
        """A save that had ``slot`` has ended: the slot is free again (the save did not use
        it), held by the step ``directory`` (committed there), or lost (a failed save). A
        save still waiting for the next slot has its queue called (the move of its snapshot
        aside, which finds no slot and lets the copy aside go) now or when it asks."""
        if isinstance(slot, NextSlot):
            queue = None
            with self._lock:
                if slot in self._waiting:  # the save ended before its move was queued
                    self._waiting.remove(slot)
                    queue = slot.queue
                given, slot.slot = slot.slot, None  # the save's later calls find no slot
            if queue is not None:  # its move finds no slot: it lets the snapshot aside go
                queue()
            if given is None:
                return
            slot = given
        with self._lock:
            # one never made (a skipped save's) has nothing to keep, no slot to ready
            to = (GONE if slot.fd < 0 else FREE if slot.path == slot.home else HELD
                  if committed and slot.path.parent == directory and slot.path.exists() else GONE)
            # a step saved again: the file its slot held was replaced (removed)
            replaced = self._held_in(directory) if committed else None
            self._move(slot, to)
            if replaced is not None:
                self._move(replaced, GONE)
        if replaced is not None:
            self._forget(replaced)
        if to is GONE:
            self._forget(slot)
        elif to is FREE:
            if not slot.pinned:
                self._thread.wake()
            self._serve()

    def give_back(self, slot: Slot | NextSlot) -> None:
        """A save that took ``slot`` is not made (skipped): the slot is free again, or the
        save no longer waits for the next one."""
        self.settle(slot, self.directory, committed=False)

    def waiting(self) -> bool:
        """Whether saves wait for the next slot to come free."""
        with self._lock:
            return bool(self._waiting)

    def reclaim(self, directory: Path) -> None:
        """The step ``directory`` is being dropped (its ``.metadata`` is gone): its slot
        goes back home, free (and pinned in the background if it is not)."""
        lost = None
        with self._lock:  # the file moves with the state: no other call finds it half-way
            slot = self._held_in(directory)
            if slot is None:
                return
            try:
                slot.adopt(slot.home)
            except OSError as exc:  # the file went: the slot with it
                lost = exc
            self._move(slot, FREE if lost is None else GONE)
        if lost is not None:
            log.warning("dcp_datastates: memory-tier slot %s lost (%s)", slot.path, lost)
            self._forget(slot)
            return
        if not slot.pinned:
            self._thread.wake()
        self._serve()

    def discard(self, directory: Path) -> None:
        """The step ``directory`` is being dropped to make room on the tier: its slot is
        forgotten, and its file goes with the step."""
        with self._lock:
            slot = self._held_in(directory)
            if slot is not None:
                self._move(slot, GONE)
        if slot is not None:
            self._forget(slot)

    def _forget(self, slot: Slot) -> None:
        """Unmap ``slot`` (GONE, or DOOMED: GONE once its pages are back on the tier) and
        close its file, removing it if it is at home."""
        slot.close()
        if slot.path == slot.home:
            slot.home.unlink(missing_ok=True)
        with self._lock:
            if slot.state is DOOMED:  # release_free's wait_sized ends
                self._move(slot, GONE)
                self._readied.notify_all()
        self._serve()  # one more slot may be made

    def close(self) -> None:
        """Stop the pool's thread; unmap every slot; remove the free ones (held ones are
        steps' data files)."""
        with self._lock:
            self._stop(Mode.CLOSED)  # a slot being readied now is forgotten by its reader
        self._serve()  # the saves waiting for a slot go to the engine's host cache
        self._thread.close()
        with self._lock:
            slots = self._in(FREE, HELD)
            for slot in slots:
                self._move(slot, GONE)
        for slot in slots:
            self._forget(slot)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _adopt_dead_pools(self, memory: Path) -> None:
        """Take the slot files of the other pools' directories (left by managers that are
        gone: this one's holds the tier's claim) as free slots, up to ``limit``; remove the
        rest. Their size is checked when a save or :meth:`prepare` sizes them."""
        adopted = 0
        for entry in memory.glob(f"{SLOT_DIR_PREFIX}*"):
            if entry == self.directory or entry.is_symlink() or not entry.is_dir():
                continue  # a link may lead to files that are not slots: left alone
            for path in sorted(entry.glob("slot_*")):
                if len(self._slots) < self.limit and path.is_file() and not path.is_symlink():
                    slot = Slot(self, next(self._names))
                    try:
                        os.rename(path, slot.home)
                        slot.fd = os.open(slot.home, os.O_RDWR | os.O_CLOEXEC)
                    except OSError as exc:
                        log.warning("dcp_datastates: %s not adopted (%s)", path, exc)
                        continue
                    self._slots.append(slot)
                    adopted += 1
            shutil.rmtree(entry, ignore_errors=True)
        if adopted:
            log.info("dcp_datastates: %d memory-tier slot(s) of a process that is gone adopted "
                     "into %s", adopted, self.directory)
