"""The process group a save began under (``_jobs/groups.py``), in one process on fake groups of
two ranks: a save that DCP starts on another thread than the one that made its writer (as
``dcp.async_save``'s upload thread does, the state staged by another stager) began when the
writer was made; one on that thread (``dcp.save``) begins then."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import MARKS
from torch.testing._internal.distributed.fake_pg import FakeStore

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates.errors import CheckpointError

pytestmark = MARKS


def new_group() -> None:
    """Destroy the fake group of two ranks up, if any, and make another."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


@pytest.fixture
def groups() -> Iterator[Callable[[], None]]:
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    try:
        yield new_group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def reset_on_another_thread(writer: DataStatesWriter, path: Path) -> BaseException | None:
    """What ``writer.reset(path)`` raised on a thread of its own (None if nothing)."""
    raised: list[BaseException] = []

    def start() -> None:
        try:
            writer.reset(path)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"{writer}.reset({path}) on another thread never returned"
    return raised[0] if raised else None


def test_a_save_never_moves_onto_a_group_made_after_its_writer(
        groups: Callable[[], None], engine: Engine, tmp_path: Path) -> None:
    groups()
    writer = DataStatesWriter(engine=engine)
    groups()  # the group the writer was made under is gone; a new one is up
    error = reset_on_another_thread(writer, tmp_path / "a")
    assert isinstance(error, CheckpointError), error
    assert "save 1 abandoned: the process group was destroyed while the save was in flight; " \
           "DCP would run it on the new process group" in str(error)


def test_a_save_begins_under_the_group_up_on_its_writers_thread(
        groups: Callable[[], None], engine: Engine, tmp_path: Path) -> None:
    groups()
    made_before = DataStatesWriter(engine=engine)
    groups()
    made_after = DataStatesWriter(engine=engine)
    # first (a save waits for the DCP calls of earlier saves to return: a call from the test's
    # own frame never does)
    assert reset_on_another_thread(made_after, tmp_path / "b") is None
    made_before.reset(tmp_path / "a")  # dcp.save on the thread that made it: begins now
