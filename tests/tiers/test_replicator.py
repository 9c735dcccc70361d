"""When memory-tier steps are replicated: a save is replicated when no exchange with the peers
runs (saves made meanwhile are not, and never wait), and the newest step replicated stays in
the memory tier until a newer one is, whatever ``keep_memory``. One process; the exchange is a
stand-in that records what it sends and may be held."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

from helpers import MARKS

from dcp_datastates.tiers._handles import SaveHandle
from dcp_datastates.tiers._ranks import Ranks
from dcp_datastates.tiers._replicator import Replicator
from dcp_datastates.tiers._retention import Retention
from dcp_datastates.tiers._steps import committed_steps, step_dir

pytestmark = MARKS

TIMEOUT = 30


class HeldExchange:
    """Records the steps sent; each exchange waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[int] = []

    def __call__(self, group: object, rank: int, world: int, memory: Path, step: int,
                 mine: Path | None) -> Path | None:
        assert self.gate.wait(TIMEOUT)
        self.sent.append(step)
        return None


def committed_step(memory: Path, step: int) -> SaveHandle:
    """A memory-tier step committed on disk, and the handle of its save."""
    directory = step_dir(memory, step)
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"x")
    staged, done = Future(), Future()
    staged.set_result(None)
    done.set_result(None)
    return SaveHandle(step, staged, done)


def test_saves_during_an_exchange_are_not_replicated_and_never_wait(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    exchange = HeldExchange()
    one = Ranks(0, 1, None)
    retention = Retention(memory, None, None, one)
    replicator = Replicator(one, one, retention, keep=1, exchange=exchange)
    try:
        first = committed_step(memory, 1)
        replicator.decide(first)
        replicator.committed(first)  # its exchange starts, held
        for step in (2, 3):
            handle = committed_step(memory, step)
            replicator.decide(handle)  # an exchange runs: not replicated
            replicator.committed(handle)
            retention.retain(memory, 1)
        assert committed_steps(memory) == [1, 3]  # step 1 is being sent: kept
        exchange.gate.set()
        replicator.drain()
        assert exchange.sent == [1] and first.figures.replicated
        fourth = committed_step(memory, 4)
        retention.retain(memory, 1)
        assert committed_steps(memory) == [1, 4]  # the newest step replicated stays
        replicator.decide(fourth)  # idle again: replicated
        replicator.committed(fourth)
        replicator.drain()
        assert exchange.sent == [1, 4]
        retention.retain(memory, 1)
        assert committed_steps(memory) == [4]  # step 1 let go once step 4 is on the peer
    finally:
        exchange.gate.set()
        replicator.close()


def test_the_newest_step_sent_goes_with_the_run_that_was_left(tmp_path: Path) -> None:
    """The newest step replicated is kept in memory until a newer one is sent, but not once
    training leaves it: going back past it removes it like the other steps of that run, and
    saving it again lets retention drop it, so a restart never takes it for the newest step."""
    memory = tmp_path / "memory"
    exchange = HeldExchange()
    exchange.gate.set()
    one = Ranks(0, 1, None)
    retention = Retention(memory, None, None, one)
    replicator = Replicator(one, one, retention, keep=1, exchange=exchange)
    try:
        for step in (1, 2, 3):
            handle = committed_step(memory, step)
            replicator.decide(handle)
            replicator.committed(handle)
            replicator.drain()
        assert exchange.sent == [1, 2, 3]
        retention.set_aside(1)  # load(step=1), then a save: steps 2 and 3 belong to the past
        assert committed_steps(memory) == [1]
        retention.retain(memory, 1)
        assert committed_steps(memory) == [1]

        handle = committed_step(memory, 2)
        replicator.decide(handle)
        replicator.committed(handle)
        replicator.drain()
        assert exchange.sent == [1, 2, 3, 2]
        retention.replace(2)  # step 2 saved again, committed over the copy sent: not kept
        committed_step(memory, 3)
        retention.retain(memory, 1)
        assert committed_steps(memory) == [3]
    finally:
        replicator.close()
