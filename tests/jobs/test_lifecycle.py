"""Saves that DCP gives up on outside the writer's own steps, and other ends of a save's life.

DCP can fail between the writer's calls (a planner that raises, another rank that fails): the
writer hears nothing more. Such a save must not hold its directory, its cache memory or the
turn of later saves; and a save whose commit fails must leave no data file behind.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import MARKS, assert_state_equal, clone_state, data_files, load_into, rand_tensor
from helpers.fakes import FaultyBackend
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from dcp_datastates import CheckpointError, DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._format.directory import DirectoryClaim
from dcp_datastates._io import ThreadPoolBackend

pytestmark = MARKS
TIMEOUT = 30


class FailingPlanner(DefaultSavePlanner):
    """A planner that raises at one step: ``set_up`` (before the writer's reset, for a writer
    given its path), ``finish`` (after the writer set the save up and claimed the directory)
    or ``metadata`` (an item DCP cannot pickle into ``.metadata``: the commit fails)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def set_up_planner(self, state_dict: dict, storage_meta: object = None,
                       is_coordinator: bool = False) -> None:
        if self.where == "set_up":
            raise RuntimeError("planner failed in set_up_planner")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def finish_plan(self, new_plan: object) -> object:
        if self.where == "finish":
            raise RuntimeError("planner failed in finish_plan")
        return super().finish_plan(new_plan)

    def create_global_plan(self, all_plans: list) -> tuple:
        plans, metadata = super().create_global_plan(all_plans)
        if self.where == "metadata":
            metadata.planner_data = threading.Lock()  # cannot be pickled
        return plans, metadata


def _state(seed: int) -> dict:
    return {"w": rand_tensor((300, 77), torch.float32, seed=seed), "step": seed}


def _save_in_thread(state: dict, path: Path, engine: Engine) -> list:
    """A plain save on another thread; returns [error] or [] once it ended (bounded)."""
    outcome: list = []

    def run() -> None:
        try:
            dcp.save(state, checkpoint_id=path, no_dist=True,
                     storage_writer=DataStatesWriter(engine=engine))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "a save waits behind a save that DCP abandoned"
    return outcome


def test_planner_failure_after_set_up_releases_directory_and_turn(
    tmp_path: Path, make_engine
) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    directory = tmp_path / "ck"
    writer = DataStatesWriter(directory, engine=engine)
    with pytest.raises(BaseException, match="planner failed in finish_plan"):
        dcp.save(_state(1), storage_writer=writer, planner=FailingPlanner("finish"),
                 no_dist=True)
    assert not list(directory.glob("*.safetensors")), "the failed save left data files"
    # another process (here: a claim of our own) may take the directory within moments
    deadline = time.monotonic() + 5
    while True:
        try:
            DirectoryClaim(directory).release()
            break
        except CheckpointError:
            assert time.monotonic() < deadline, "the abandoned save still holds its directory"
            time.sleep(0.05)
    # a save from another thread does not wait for the abandoned one
    state = _state(2)
    assert _save_in_thread(state, tmp_path / "other", engine) == []
    assert_state_equal(load_into(clone_state(state), tmp_path / "other"), state)
    # the same writer (path from its constructor, no checkpoint_id) saves again
    state = _state(3)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert_state_equal(load_into(clone_state(state), directory), state)
    assert engine.live_leases() == 0
    start = time.monotonic()
    engine.close(timeout=TIMEOUT)
    assert time.monotonic() - start < 5, "close waited for a save DCP had left"


def test_async_planner_failure_before_reset_frees_the_snapshot(tmp_path: Path,
                                                               make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    writer = DataStatesWriter(tmp_path / "ck", engine=engine, overwrite=True)
    response = dcp.async_save(_state(4), storage_writer=writer, no_dist=True,
                              planner=FailingPlanner("set_up"))
    with pytest.raises(BaseException, match="planner failed in set_up_planner"):
        response.upload_completion.result(timeout=TIMEOUT)
    state = _state(5)
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    response.upload_completion.result(timeout=TIMEOUT)  # the writer's next save runs
    assert_state_equal(load_into(clone_state(state), tmp_path / "ck"), state)
    deadline = time.monotonic() + TIMEOUT
    while engine.live_leases() and time.monotonic() < deadline:
        engine.saves.reap()
        time.sleep(0.05)
    assert engine.live_leases() == 0, "the snapshot of the failed save still holds its lease"


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-directory", "over-checkpoint"])
def test_failed_commit_leaves_no_data_file(tmp_path: Path, make_engine, fresh: bool) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    directory = tmp_path / "ck"
    old = _state(6)
    if not fresh:
        dcp.save(old, checkpoint_id=directory, no_dist=True,
                 storage_writer=DataStatesWriter(engine=engine))
    before = data_files(directory) if not fresh else []
    with pytest.raises(BaseException, match="pickle"):
        dcp.save(_state(7), checkpoint_id=directory, planner=FailingPlanner("metadata"),
                 storage_writer=DataStatesWriter(engine=engine, overwrite=True), no_dist=True)
    assert data_files(directory) == before, "the failed commit left its data files"
    if not fresh:
        assert_state_equal(load_into(clone_state(old), directory), old)
    assert engine.live_leases() == 0


def test_load_with_a_small_fixed_cache(tmp_path: Path, make_engine) -> None:
    """An engine that can save a state can load it: coalesced reads fit its bounce pool."""
    engine = make_engine(host_cache_size="4MiB", io_backend="threads", io_workers=2)
    state = {f"t{i}": rand_tensor((50_000,), torch.float32, seed=i) for i in range(20)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True,
             storage_writer=DataStatesWriter(engine=engine))
    assert_state_equal(load_into(clone_state(state), tmp_path, engine=engine), state)


def test_writer_close_discards_an_untaken_snapshot(make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    writer = DataStatesWriter(engine=engine)
    writer.stage(_state(8)).result(timeout=TIMEOUT)
    assert engine.live_leases() == 1
    writer.close()
    assert engine.live_leases() == 0


class _OverwritingPlanner(DefaultLoadPlanner):
    """Commits a new checkpoint into the directory after the load read ``.metadata``."""

    def __init__(self, save: object) -> None:
        super().__init__()
        self.save = save

    def create_local_plan(self) -> object:
        self.save()
        return super().create_local_plan()


def test_load_racing_an_overwrite_says_superseded(tmp_path: Path, make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    old, new = _state(9), _state(10)
    dcp.save(old, checkpoint_id=tmp_path, no_dist=True,
             storage_writer=DataStatesWriter(engine=engine))

    def overwrite() -> None:
        dcp.save(new, checkpoint_id=tmp_path, no_dist=True,
                 storage_writer=DataStatesWriter(engine=engine, overwrite=True))

    with pytest.raises(BaseException, match="removed or replaced while this load read it"):
        dcp.load(clone_state(old), checkpoint_id=tmp_path, no_dist=True,
                 planner=_OverwritingPlanner(overwrite),
                 storage_reader=DataStatesReader(engine=engine))
    assert_state_equal(load_into(clone_state(new), tmp_path), new)  # load again: the new one


class GatedLoadPlanner(DefaultLoadPlanner):
    """A load planner whose first ``resolve_tensor`` waits for ``gate`` (setting ``entered``):
    the load is in the reader's ``read_data`` and has not started its reads yet."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.gate = threading.Event(), threading.Event()

    def resolve_tensor(self, read_item: object) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(TIMEOUT)
        return super().resolve_tensor(read_item)


def test_close_waits_for_a_load_in_progress(tmp_path: Path, make_engine) -> None:
    """A load running when ``Engine.close()`` is called finishes; close waits for it."""
    state = {"w": rand_tensor((1024, 300), torch.float32, seed=9),
             "b": rand_tensor((7,), torch.int64, seed=3), "step": 9}
    dcp.save(state, checkpoint_id=tmp_path / "ck", no_dist=True,
             storage_writer=DataStatesWriter(engine=make_engine(io_backend="threads")))
    engine = make_engine(io_backend=FaultyBackend(ThreadPoolBackend(), read_delay_s=0.2))
    target, planner, errors = clone_state(state), GatedLoadPlanner(), []
    for value in target.values():
        if isinstance(value, torch.Tensor):
            value.zero_()

    def load() -> None:
        try:
            dcp.load(target, checkpoint_id=tmp_path / "ck", planner=planner, no_dist=True,
                     storage_reader=DataStatesReader(engine=engine))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    assert planner.entered.wait(TIMEOUT)
    closer = threading.Thread(target=engine.close, kwargs={"timeout": TIMEOUT})
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive(), "close() returned while a load was in progress"
    planner.gate.set()
    loader.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert not loader.is_alive() and not closer.is_alive()
    assert errors == []
    assert_state_equal(target, state)
    assert engine.closed and engine.cache_bytes() == 0 and engine.live_leases() == 0
