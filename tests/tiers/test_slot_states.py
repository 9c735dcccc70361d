"""Each memory-tier slot is in one ``SlotState``, moved only as ``MOVES`` lists: a move it
does not list (a slot given back twice) is refused, naming the slot and both states; and the
pool's public calls move a slot through a save's life (taken, committed, reclaimed), and a
slot being pinned that ``release_free`` gives up through DOOMED to GONE. The engine is a
fake injected into the pool (sizes only, pinning gated by the test)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import MARKS
from helpers.tiers import wait_until

from dcp_datastates.tiers._slots import (
    MOVES,
    NextSlot,
    Slot,
    SlotPool,
    SlotState,
)

MiB = 1 << 20

pytestmark = MARKS


class SizesOnly:
    """A ``FileMapper`` whose arenas are only their sizes; ``pin_file`` waits for ``gate``
    (set at first) and sets ``pinning`` meanwhile."""

    def __init__(self) -> None:
        self.gate, self.pinning = threading.Event(), threading.Event()
        self.gate.set()

    def map_file(self, fd: int, nbytes: int, name: str, *, pin: bool = True) -> SimpleNamespace:
        return SimpleNamespace(nbytes=nbytes)

    def pin_file(self, arena: object) -> None:
        self.pinning.set()
        assert self.gate.wait(10), "the test never let the pinning go on"

    def unmap_file(self, arena: object) -> None:
        pass


@pytest.fixture
def mapper() -> SizesOnly:
    return SizesOnly()


@pytest.fixture
def pool(mapper: SizesOnly, tmp_path: Path) -> Iterator[SlotPool]:
    made = SlotPool(mapper, tmp_path, 2, room=lambda: 1 << 40)
    yield made
    mapper.gate.set()
    made.close()


def test_every_state_has_its_moves_and_gone_has_none() -> None:
    assert set(MOVES) == set(SlotState)
    assert not MOVES[SlotState.GONE]
    assert all(SlotState.GONE in moves for state, moves in MOVES.items()
               if state is not SlotState.GONE)


def test_a_slot_given_back_twice_is_refused_naming_it_and_both_states(pool: SlotPool) -> None:
    """The second give_back would move a FREE slot to FREE (it once put the slot in the free
    list twice, for two saves to take)."""
    slot = pool.take()
    assert isinstance(slot, Slot)
    slot.fit(MiB, 4)  # a save's: its file is made
    pool.give_back(slot)
    assert slot.state is SlotState.FREE
    with pytest.raises(RuntimeError,
                       match=rf"^{re.escape(str(slot))}: no move from FREE to FREE$"):
        pool.give_back(slot)
    assert slot.state is SlotState.FREE


def test_a_save_moves_its_slot_from_taken_to_held_and_back_to_free(
        pool: SlotPool, tmp_path: Path) -> None:
    """prepare() readies a slot (FREE, pinned); a save takes it (IN_SAVE), commits into the
    step (HELD); the step dropped, its slot is FREE at home again. A save waiting for the
    next slot gets one given back (IN_SAVE)."""
    pool.prepare(MiB, 4, wait=True)
    slot = pool.take()
    assert isinstance(slot, Slot) and slot.pinned
    assert slot.state is SlotState.IN_SAVE
    step = tmp_path / "step_1"
    step.mkdir()
    slot.adopt(step / "data.safetensors")
    pool.settle(slot, step, committed=True)
    assert slot.state is SlotState.HELD
    pool.reclaim(step)
    assert slot.state is SlotState.FREE and slot.path == slot.home and slot.home.exists()

    wait_until(lambda: not pool.readying(), "the spare to be readied", 5)
    taken = [pool.take(), pool.take()]  # the pool's two slots (limit 2)
    assert all(isinstance(s, Slot) and s.state is SlotState.IN_SAVE for s in taken)
    waiting = pool.take(later=True)
    assert isinstance(waiting, NextSlot) and waiting.slot is None
    pool.give_back(taken[0])
    assert waiting.slot is taken[0] and taken[0].state is SlotState.IN_SAVE


def test_a_slot_given_up_while_pinned_is_doomed_until_gone(
        pool: SlotPool, mapper: SizesOnly) -> None:
    """A slot the pool's thread is pinning (held) when a save finds the tier short
    (release_free): DOOMED, and wait_sized waits for it; once the pinning ends it is GONE,
    its file removed, and wait_sized returns."""
    mapper.gate.clear()
    slot = pool.take()
    assert isinstance(slot, Slot)
    slot.fit(MiB, 4)
    pool.give_back(slot)  # free, not pinned: the pool's thread pins it
    assert mapper.pinning.wait(5), "the pool's thread never pinned the slot"
    assert slot.state is SlotState.PINNING
    assert pool.release_free() == 1
    assert slot.state is SlotState.DOOMED
    waited = threading.Thread(target=pool.wait_sized, daemon=True)
    waited.start()
    waited.join(0.2)
    assert waited.is_alive(), "wait_sized returned while a given-up slot was not gone"
    mapper.gate.set()
    waited.join(5)
    assert not waited.is_alive()
    assert slot.state is SlotState.GONE and not slot.home.exists()
