"""dcp.async_save through the writer's AsyncStager: snapshots, writer reuse, PROCESS mode."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    MARKS,
    assert_state_equal,
    clone_state,
    data_files,
    load_into,
    rand_tensor,
    save,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import dcp_datastates.writer as writer_mod
from dcp_datastates.file_format import LARGE_ITEM_BYTES
from dcp_datastates.io import get_backend

MiB = 1 << 20
TIMEOUT = 60

pytestmark = MARKS


@pytest.fixture
def gate_writes(monkeypatch: pytest.MonkeyPatch):
    """Hold every data write of backend ``name`` until the returned event is set.

    So the flush surely runs after what the test does next (a mutation, another save).
    """

    def apply(name: str) -> threading.Event:
        backend = get_backend(name)
        real = backend.write
        gate = threading.Event()

        def write(fd, path, reqs):
            gate.wait(TIMEOUT)
            return real(fd, path, reqs)

        monkeypatch.setattr(backend, "write", write)
        return gate

    return apply


def _source_state(seed: int = 0) -> dict:
    base = rand_tensor((64, 33), torch.float32, seed=seed)
    return {
        "large": rand_tensor((LARGE_ITEM_BYTES + 4001,), torch.uint8, seed=seed + 1),
        "weights": rand_tensor((128, 130), torch.bfloat16, seed=seed + 2),
        "base": base,
        "view": base.t()[1:30:2],
        "scalar": rand_tensor((), torch.int64, seed=seed + 3),
        "nested": {"bias": rand_tensor((33,), torch.float16, seed=seed + 4), "step": seed,
                   "hist": [1, 2, 3]},
    }


def _mutate(state: dict) -> None:
    """Change every source in place (as the next training step would)."""
    state["large"].add_(1)
    state["weights"].mul_(-3)
    state["base"].fill_(float("nan"))  # also changes `view`
    state["scalar"].add_(7)
    state["nested"]["bias"].zero_()
    state["nested"]["step"] = -1
    state["nested"]["hist"].append(4)


def test_async_save_snapshot_ignores_later_mutation(
    tmp_path: Path, make_writer, gate_writes, io_backend: str
) -> None:
    gate = gate_writes(io_backend)
    state = _source_state()
    expected = clone_state(state)
    writer = make_writer(io_backend=io_backend, host_cache_size="8MiB")
    response = dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=TIMEOUT)
    _mutate(state)
    assert not response.upload_completion.done()
    gate.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert_state_equal(load_into(expected, tmp_path, io_backend=io_backend), expected)


def test_async_save_larger_than_host_cache(
    tmp_path: Path, make_writer, gate_writes, io_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    gate = gate_writes(io_backend)
    state = {
        "huge": rand_tensor((3 * MiB // 4 + 5,), torch.float32, seed=5),  # 3 MiB > 1 MiB cache
        "mid": rand_tensor((300 * 1024,), torch.uint8, seed=6),
        "small": rand_tensor((7, 3), torch.float64, seed=7),
    }
    expected = clone_state(state)
    writer = make_writer(io_backend=io_backend, host_cache_size="1MiB")
    response = dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    response.staging_completion.result(timeout=TIMEOUT)
    for t in state.values():
        t.zero_()
    gate.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert writer.last_stats().bytes_written >= 3 * MiB + 300 * 1024
    assert "exceeds the free host cache" in caplog.text
    assert_state_equal(load_into(expected, tmp_path, io_backend=io_backend), expected)


def test_one_writer_many_checkpoints_sequential(tmp_path: Path, make_writer) -> None:
    """Sync and async saves alternate on one writer (waiting in between); all bit-exact."""
    writer = make_writer(host_cache_size="2MiB")
    expected = []
    for i in range(4):
        state = _source_state(seed=10 * i)
        expected.append(clone_state(state))
        if i % 2:
            save(state, tmp_path / f"c{i}", writer)
        else:
            response = dcp.async_save(
                state, checkpoint_id=tmp_path / f"c{i}", storage_writer=writer, no_dist=True
            )
            response.staging_completion.result(timeout=TIMEOUT)
            _mutate(state)
            response.upload_completion.result(timeout=TIMEOUT)
    for i, exp in enumerate(expected):
        assert len(data_files(tmp_path / f"c{i}")) == 1
        assert_state_equal(load_into(exp, tmp_path / f"c{i}"), exp)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shared_tensors_are_saved_under_each_name(tmp_path: Path, make_writer, mode: str) -> None:
    """Tied weights: one tensor object under several keys (staged once, written twice)."""
    big = rand_tensor((LARGE_ITEM_BYTES // 4 + 9,), torch.float32, seed=40)
    small = rand_tensor((5,), torch.int16, seed=41)
    state = {"enc": {"emb": big}, "dec": {"emb": big, "s": small}, "s": small}
    expected = clone_state(state)
    writer = make_writer(host_cache_size="4MiB")
    if mode == "sync":
        save(state, tmp_path, writer)
    else:
        response = dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer,
                                  no_dist=True)
        response.staging_completion.result(timeout=TIMEOUT)
        big.zero_()
        small.zero_()
        response.upload_completion.result(timeout=TIMEOUT)
    assert_state_equal(load_into(expected, tmp_path), expected)


def test_async_tuple_with_tensor_does_not_pickle_the_host_cache(
    tmp_path: Path, make_writer
) -> None:
    """DCP pickles tuples whole; a staged tuple must not hold views of the host cache (torch.save
    of a view writes its entire storage: the whole cache)."""
    state = {"pair": (torch.arange(4, dtype=torch.float32), "tag"), "x": torch.ones(10)}
    writer = make_writer(host_cache_size="8MiB")
    save(state, tmp_path / "sync", writer)
    dcp.async_save(
        state, checkpoint_id=tmp_path / "async", storage_writer=writer, no_dist=True
    ).upload_completion.result(timeout=TIMEOUT)
    for mode in ("sync", "async"):
        loaded = load_into(state, tmp_path / mode)
        assert_state_equal(loaded, state)
        storage_bytes = loaded["pair"][0].untyped_storage().nbytes()  # no repr of the storage
        assert storage_bytes == 16, mode
        (file,) = data_files(tmp_path / mode)
        assert file.stat().st_size < 64 * 1024, f"{mode}: {file.stat().st_size} bytes"


def test_back_to_back_async_saves_without_waiting(
    tmp_path: Path, make_writer, gate_writes
) -> None:
    """Queued saves must not change the writer's path/save id under the save still flushing."""
    gate = gate_writes("threads")  # the first flush is still running when the others start
    writer = make_writer(host_cache_size="8MiB")
    states = [_source_state(seed=100 + i) for i in range(3)]
    expected = [clone_state(s) for s in states]
    responses = [
        dcp.async_save(s, checkpoint_id=tmp_path / f"c{i}", storage_writer=writer, no_dist=True)
        for i, s in enumerate(states)
    ]
    for response, state in zip(responses, states, strict=True):
        response.staging_completion.result(timeout=TIMEOUT)
        _mutate(state)
    time.sleep(0.2)  # let the queued saves' threads start (DCP resets the writer there)
    gate.set()
    errors = []
    for response in responses:
        try:
            response.upload_completion.result(timeout=TIMEOUT)
        except CheckpointException as e:
            errors.append(e)
    assert not errors, errors
    for i, exp in enumerate(expected):
        assert len(data_files(tmp_path / f"c{i}")) == 1
        assert_state_equal(load_into(exp, tmp_path / f"c{i}"), exp)


def test_checksums_not_computed_over_recycled_cache(
    tmp_path: Path, make_writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot's cache regions are given back only after their checksums are computed."""
    real = writer_mod.block_checksums
    restaged = threading.Event()

    def slow_checksums(*args, **kwargs):
        restaged.wait(TIMEOUT)  # a busy CPU: hashing lags behind the write
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_mod, "block_checksums", slow_checksums)
    writer = make_writer(host_cache_size="16MiB")
    src = {"t": rand_tensor((1 * MiB,), torch.uint8, seed=1)}
    expected = clone_state(src)
    response = dcp.async_save(src, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    response.staging_completion.result(timeout=TIMEOUT)
    pool = writer.engine.cache.snapshots
    deadline = time.monotonic() + 5
    while pool.used and time.monotonic() < deadline:  # the flush gives the region back
        time.sleep(0.002)
    # The next step's snapshot (what async_save does first, on the training thread).
    writer.stage({"t": torch.zeros(1 * MiB, dtype=torch.uint8)}).result(timeout=TIMEOUT)
    restaged.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert_state_equal(load_into(expected, tmp_path), expected)


_PROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from dcp_datastates import DataStatesReader, DataStatesWriter

    def main(root):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        store = dist.FileStore(os.path.join(root, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            writer = DataStatesWriter(host_cache_size="8MiB", io_backend="threads")
            gen = torch.Generator().manual_seed(0)
            states, expected = [], []
            for i in range(2):
                state = {
                    "a": torch.randn(70_000, generator=gen),
                    "b": {"c": torch.randn(7, 3, generator=gen).t(), "n": i},
                }
                expected.append({"a": state["a"].clone(), "c": state["b"]["c"].clone()})
                resp = dcp.async_save(
                    state, checkpoint_id=os.path.join(root, f"ck{i}"), storage_writer=writer,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                assert type(resp).__name__ == "AsyncSaveResponse", type(resp)
                resp.staging_completion.result(timeout=120)
                state["a"].add_(1)
                state["b"]["c"].zero_()
                resp.upload_completion.result(timeout=120)
            for i in range(2):
                out = {"a": torch.zeros(70_000), "b": {"c": torch.zeros(3, 7), "n": None}}
                dcp.load(out, checkpoint_id=os.path.join(root, f"ck{i}"),
                         storage_reader=DataStatesReader())
                for got, want in ((out["a"], expected[i]["a"]), (out["b"]["c"], expected[i]["c"])):
                    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
                assert out["b"]["n"] == i
                files = sorted(os.listdir(os.path.join(root, f"ck{i}")))
                assert len(files) == 2 and files[0] == ".metadata", files
            writer.close()
            print("PROCESS-MODE-OK")
        finally:
            dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def test_async_process_checkpointer_single_rank_gloo(tmp_path: Path) -> None:
    """AsyncCheckpointerType.PROCESS: the writer is pickled into DCP's checkpoint process."""
    script = tmp_path / "process_save.py"
    script.write_text(_PROCESS_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0 and "PROCESS-MODE-OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )
