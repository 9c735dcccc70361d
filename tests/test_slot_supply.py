"""Every save waiting for a memory-tier slot gets one: a slot lost while saves wait is made
again (and readied), a slot the tier has no room for holds none of the tier's pages, and
pinning that fails leaves no save waiting. Pinning is held or failed through an injected
engine (``HeldPinEngine``); waits are bounded, never timed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MARKS, Tiers
from fakes import HeldPinEngine

from dcp_datastates import Engine
from dcp_datastates.tiers.slots import NextSlot, SlotPool

MiB = 1 << 20

pytestmark = MARKS


@pytest.fixture
def engine() -> Iterator[HeldPinEngine]:
    made = HeldPinEngine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    made.gate.set()
    try:
        yield made
    finally:
        made.gate.set()
        made.close()


@pytest.fixture
def memory(tiers: Tiers) -> Path:
    tiers.memory.mkdir(parents=True)
    return tiers.memory


def test_a_slot_lost_while_a_save_waits_is_made_again(memory: Path,
                                                      engine: Engine) -> None:
    """Every slot in use (limit 1) and a save waiting for the next: the slot's save fails
    after its file went into the step directory (the slot is lost). The pool makes a new
    slot in its place, and its thread readies it for the waiting save (it was made and left
    unready: the save waited until some later save woke the thread, so ``wait()`` and
    ``close()`` hung at the end of a run)."""
    pool = SlotPool(engine, memory, 1)
    try:
        pool.prepare(MiB, 4, wait=True)
        slot = pool.take()
        waiting = pool.take(later=True)
        assert isinstance(waiting, NextSlot) and waiting.slot is None
        given = threading.Event()
        waiting.when_ready(given.set)
        time.sleep(0.3)  # the pool's thread, woken by take(), has gone idle: nothing to ready
        step = memory / "step_1"
        step.mkdir()
        slot.adopt(step / "data.safetensors")
        pool.settle(slot, step, committed=False)  # a failed save: its slot is lost
        assert given.wait(5), "the waiting save never got the slot made in place of the lost"
        assert waiting.slot is not None and waiting.slot.pinned
    finally:
        pool.close()
