"""The flush (``_jobs/flush.py``) writes a snapshot's copies as the data file, and the file's
checksums are made of the bytes it writes, not taken from a snapshot they may not match (a plan
resolved to a view of a copy, a staged tensor changed in place); a process hand-off does not
wait for a snapshot's checksums."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    clone_state,
    load_into,
    rand_tensor,
    square_state,
)
from helpers.fakes import FileTarget
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._jobs.explicit import ExplicitSave

TIMEOUT = 60

pytestmark = MARKS


class GatedSumsEngine(Engine):
    """An engine whose checksum tasks started by a save job (on the engine's own threads,
    from its snapshot) wait for ``gate`` before they hash."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()

    def compute(self, fn: Callable, *args: object, background: bool = False) -> Future:
        if fn.__name__ == "_sum_pieces" and threading.current_thread().name.startswith(
                "dcp_datastates-"):
            def gated() -> object:
                self.gate.wait(TIMEOUT)
                return fn(*args)
            return super().compute(gated, background=background)
        return super().compute(fn, *args, background=background)


class TransposingPlanner(DefaultSavePlanner):
    """Resolves the tensor ``fqn`` to its transpose: a view with the staged copy's address
    and size, but not its bytes' order."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def resolve_data(self, write_item: WriteItem) -> object:
        data = super().resolve_data(write_item)
        return data.t() if write_item.index.fqn == self.fqn else data


@pytest.mark.parametrize("in_target", [False, True], ids=["host_cache", "in_place"])
def test_a_plan_resolved_to_a_transposed_view_of_a_copy_saves_the_view(
        tmp_path: Path, make_engine, in_target: bool) -> None:
    """The view has the copy's address and size; its bytes are in another order. The file
    must hold (and its checksums cover) the view's bytes: not the copy's under the view's
    name (in place: wrong values loaded), nor the view's under the copy's checksums (a load
    that reports corruption)."""
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    state = square_state()
    if in_target:  # a memory-tier save: the manager's explicit save job
        target = FileTarget(engine, tmp_path / "slot", 1 << 20)
        try:
            save = ExplicitSave(engine, tmp_path / "ckpt", target=target)
            save.stage(state).result(timeout=TIMEOUT)
            save.flush(TransposingPlanner("m"))
            save.commit()
        finally:
            target.close()
    else:
        writer = DataStatesWriter(engine=engine)
        staged = writer.stage(state).result(timeout=TIMEOUT)
        dcp.save(staged, checkpoint_id=tmp_path / "ckpt", storage_writer=writer, no_dist=True,
                 planner=TransposingPlanner("m"))
    expected = {"m": state["m"].t().contiguous(), "v": state["v"].clone()}
    assert cli.main(["verify", "-q", str(tmp_path / "ckpt")]) == 0
    assert_state_equal(load_into(clone_state(expected), tmp_path / "ckpt"), expected)


def test_a_snapshot_with_empty_tensors_partly_in_pageable_memory_saves_and_verifies(
        tmp_path: Path, make_engine) -> None:
    """Some copies in the lease (their checksums the save job's), the rest staged in pageable
    memory (the flush's), empty ones in both places."""
    engine = make_engine(host_cache_size="64KiB", io_backend="threads", io_workers=2)
    state = {"a": rand_tensor((3000,), torch.uint8, seed=1), "e0": torch.empty(0),
             "b": rand_tensor((100, 300), torch.float32, seed=2), "e1": torch.empty(0, 3),
             "c": rand_tensor((77,), torch.int64, seed=3)}
    expected = clone_state(state)
    writer = DataStatesWriter(engine=engine)
    for k in range(2):  # the first waits aside for the cache, the second is copied into it
        response = dcp.async_save(state, checkpoint_id=tmp_path / f"s{k}", no_dist=True,
                                  storage_writer=writer)
        response.upload_completion.result(timeout=TIMEOUT)
        assert cli.main(["verify", "-q", str(tmp_path / f"s{k}")]) == 0
        assert_state_equal(load_into(clone_state(expected), tmp_path / f"s{k}"), expected)


def test_a_staged_tensor_changed_in_place_before_its_save_still_verifies(
        tmp_path: Path, make_engine) -> None:
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    writer = DataStatesWriter(engine=engine)
    staged = writer.stage(square_state()).result(timeout=TIMEOUT)
    staged["m"].add_(1)  # e.g. a planner or a hook that scales a tensor in place
    expected = clone_state(staged)
    dcp.save(staged, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    assert cli.main(["verify", "-q", str(tmp_path)]) == 0
    assert_state_equal(load_into(clone_state(expected), tmp_path), expected)


def test_a_process_hand_off_does_not_wait_for_the_snapshots_checksums() -> None:
    """DCP's PROCESS checkpointer pickles the writer on the caller's thread: the snapshot is
    now the other process's, and its checksums here are wasted work to wait for."""
    engine = GatedSumsEngine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    try:
        writer = DataStatesWriter(engine=engine)
        staged = threading.Event()

        def save() -> None:  # the thread that took the snapshot pickles the writer
            writer.stage(square_state()).result(timeout=TIMEOUT)
            staged.set()
            pickle.dumps(writer)
        pickling = threading.Thread(target=save)
        pickling.start()
        assert staged.wait(TIMEOUT)
        pickling.join(0.5)
        assert not pickling.is_alive(), "the hand-off waited for the snapshot's checksums"
    finally:
        engine.gate.set()
        pickling.join(TIMEOUT)
        engine.close()
    assert engine.live_leases() == 0


