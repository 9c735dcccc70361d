"""dcp.async_save through the writer's AsyncStager: snapshots, writer reuse, PROCESS mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
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

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates._format.data_file import LARGE_ITEM_BYTES

MiB = 1 << 20
TIMEOUT = 60

pytestmark = MARKS


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
    tmp_path: Path, make_writer, faulty_engine, io_backend: str
) -> None:
    # The writes are held back: the flush surely runs after the mutation.
    engine, backend = faulty_engine(io_backend, host_cache_size="8MiB", gated=True)
    state = _source_state()
    expected = clone_state(state)
    writer = make_writer(engine=engine)
    response = dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=TIMEOUT)
    _mutate(state)
    assert not response.upload_completion.done()
    backend.gate.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert_state_equal(load_into(expected, tmp_path, io_backend=io_backend), expected)


def test_async_save_larger_than_host_cache(
    tmp_path: Path, make_writer, faulty_engine, io_backend: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    engine, backend = faulty_engine(io_backend, host_cache_size="1MiB", gated=True)
    state = {
        "huge": rand_tensor((3 * MiB // 4 + 5,), torch.float32, seed=5),  # 3 MiB > 1 MiB cache
        "mid": rand_tensor((300 * 1024,), torch.uint8, seed=6),
        "small": rand_tensor((7, 3), torch.float64, seed=7),
    }
    expected = clone_state(state)
    writer = make_writer(engine=engine)
    response = dcp.async_save(state, checkpoint_id=tmp_path, storage_writer=writer, no_dist=True)
    response.staging_completion.result(timeout=TIMEOUT)
    for t in state.values():
        t.zero_()
    backend.gate.set()
    response.upload_completion.result(timeout=TIMEOUT)
    assert writer.last_stats().bytes_written >= 3 * MiB + 300 * 1024
    assert writer.last_stats().overflow_bytes > 0
    assert "did not fit in the host cache" in caplog.text
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


def save_then_change(state: dict, path: Path, writer, mode: str, change) -> None:
    """Save ``state`` (``"sync"``: dcp.save; ``"async"``: async_save, then ``change()`` the
    source once the snapshot is taken and before the upload is done)."""
    if mode == "sync":
        save(state, path, writer)
        return
    response = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
    response.staging_completion.result(timeout=TIMEOUT)
    change()
    response.upload_completion.result(timeout=TIMEOUT)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shared_tensors_are_saved_under_each_name(tmp_path: Path, make_writer, mode: str) -> None:
    """Tied weights: one tensor object under several keys (staged once, written twice)."""
    big = rand_tensor((LARGE_ITEM_BYTES // 4 + 9,), torch.float32, seed=40)
    small = rand_tensor((5,), torch.int16, seed=41)
    state = {"enc": {"emb": big}, "dec": {"emb": big, "s": small}, "s": small}
    expected = clone_state(state)
    writer = make_writer(host_cache_size="4MiB")
    save_then_change(state, tmp_path, writer, mode, lambda: (big.zero_(), small.zero_()))
    assert_state_equal(load_into(expected, tmp_path), expected)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpointable_tensor_shards(tmp_path: Path, make_writer, mode: str) -> None:
    """A plain tensor holding shards of a larger one (DCP's CheckpointableTensor protocol):
    the snapshot keeps its shard attributes, so the global tensor is saved, not the buffer."""
    if not hasattr(dcp, "CheckpointableTensor"):
        pytest.skip("DCP's CheckpointableTensor protocol came with torch 2.14")
    full = rand_tensor((8, 3), torch.float32, seed=50)
    local = torch.cat([full[4:], full[:4], torch.zeros(1, 3)])  # halves swapped, a pad row
    local.global_shape = (8, 3)
    local.global_offsets = ((4, 0), (0, 0))
    local.local_offsets = ((0, 0), (4, 0))
    local.local_sizes = ((4, 3), (4, 3))
    expected = {"w": full.clone(), "step": 7}
    state = {"w": local, "step": 7}
    writer = make_writer()
    save_then_change(state, tmp_path, writer, mode, local.zero_)
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
    tmp_path: Path, make_writer, faulty_engine
) -> None:
    """Queued saves must not change the writer's path/save id under the save still flushing."""
    # The first flush is still running (held at the gate) when the others start.
    engine, backend = faulty_engine(host_cache_size="8MiB", gated=True)
    writer = make_writer(engine=engine)
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
    backend.gate.set()
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


def test_queued_async_saves_on_one_writer_have_own_stats_and_commit_in_order(
    tmp_path: Path, faulty_engine
) -> None:
    """Four async saves queued on ONE writer before the first can write a byte: each save's
    figures are its own (bytes_written = its data file), and they commit in call order."""
    engine, backend = faulty_engine(host_cache_size="16MiB", gated=True)
    writer = DataStatesWriter(engine=engine)
    states = [{"t": rand_tensor(((k + 1) * 300_000 + 17 * k,), torch.uint8, seed=200 + k),
               "k": k} for k in range(4)]
    expected = [clone_state(s) for s in states]
    responses, stats = [], []
    for k, state in enumerate(states):
        responses.append(dcp.async_save(state, checkpoint_id=tmp_path / f"c{k}",
                                        storage_writer=writer, no_dist=True))
        responses[-1].staging_completion.result(timeout=TIMEOUT)
        state["t"].zero_()
        # Once save k is staged, no earlier save changes which one is the writer's latest:
        # wait until DCP's thread for save k has taken it.
        deadline = time.monotonic() + TIMEOUT
        while (latest := writer.last_stats()) is None or any(latest is s for s in stats):
            assert time.monotonic() < deadline, f"save {k} never became the writer's latest"
            time.sleep(0.005)
        stats.append(latest)
    assert backend.write_started.wait(TIMEOUT)
    assert not any(r.upload_completion.done() for r in responses), "the gate is closed"
    assert all(s.bytes_written == 0 for s in stats)
    backend.gate.set()
    for r in responses:
        r.upload_completion.result(timeout=TIMEOUT)
    assert writer.last_stats() is stats[-1]
    for k, s in enumerate(stats):
        (file,) = data_files(tmp_path / f"c{k}")
        assert s.bytes_written == file.stat().st_size, k
        assert s.overflow_bytes == 0 and s.staged_bytes >= (k + 1) * 300_000, k
    assert len({s.bytes_written for s in stats}) == len(stats)
    committed = [s.start + s.durable_s for s in stats]  # perf_counter time of each commit
    assert committed == sorted(committed), "saves committed out of order"
    for k, exp in enumerate(expected):
        assert_state_equal(load_into(exp, tmp_path / f"c{k}"), exp)
    assert engine.live_leases() == 0


def _tiny_state(n: int) -> dict:
    """``n`` tiny tensors: a model's step counters, norms and biases, in many dtypes."""
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
              torch.int32, torch.bool, torch.uint8]
    state: dict = {}
    for i in range(n // 3):
        layer = {
            "step": torch.tensor(i, dtype=torch.int64),
            "norm": torch.rand((), generator=gen),
            "bias": rand_tensor((1 + i % 9,), dtypes[i % len(dtypes)], seed=i),
        }
        state[f"layers.{i}"] = layer
    return state


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_thirty_thousand_tiny_tensors(tmp_path: Path, make_writer, mode: str) -> None:
    """30,000 tiny items (DCP's planner and .metadata dominate: the storage layer must not add
    a per-item cost of its own), saved and loaded back bit for bit."""
    state = _tiny_state(30_000)
    assert sum(len(v) for v in state.values()) == 30_000
    expected = clone_state(state)
    writer = make_writer(host_cache_size="8MiB")
    save_then_change(state, tmp_path, writer, mode,
                     lambda: [layer["bias"].zero_() for layer in state.values()])
    assert len(data_files(tmp_path)) == 1
    stats = writer.last_stats()
    assert stats.overflow_bytes == 0
    assert_state_equal(load_into(expected, tmp_path, engine=writer.engine), expected)


def test_checksums_not_computed_over_recycled_cache(tmp_path: Path, make_writer) -> None:
    """The snapshot's cache memory is given back only after its checksums are computed: the
    next save's snapshot waits for that memory (the cache holds one snapshot) and fills it with
    other bytes the moment it is free; .metadata's checksums must describe the saved bytes."""
    writer = make_writer(host_cache_size="64MiB", io_workers=8)  # 48 MiB for snapshots
    engine = writer.engine
    states = [{"t": rand_tensor((40 * MiB,), torch.uint8, seed=1),
               "u": rand_tensor((3 * MiB + 5,), torch.uint8, seed=2)},
              {"t": torch.zeros(40 * MiB, dtype=torch.uint8),
               "u": torch.full((3 * MiB + 5,), 0x5A, dtype=torch.uint8)}]
    expected = [clone_state(s) for s in states]
    first = dcp.async_save(states[0], checkpoint_id=tmp_path / "a", storage_writer=writer,
                           no_dist=True)
    first.staging_completion.result(timeout=TIMEOUT)
    # The next step's snapshot: it waits for the memory the first save is flushing from.
    second_writer = DataStatesWriter(engine=engine)
    second = dcp.async_save(states[1], checkpoint_id=tmp_path / "b",
                            storage_writer=second_writer, no_dist=True)
    second.staging_completion.result(timeout=TIMEOUT)
    for r in (first, second):
        r.upload_completion.result(timeout=TIMEOUT)
    for w in (writer, second_writer):  # the cache held both: the memory was reused
        assert w.last_stats().overflow_bytes == 0
    for name, exp in zip("ab", expected, strict=True):
        assert_state_equal(load_into(exp, tmp_path / name, engine=engine), exp, name)


def test_snapshot_that_no_save_takes_blocks_nothing(tmp_path: Path) -> None:
    """A snapshot staged through a writer (its AsyncStager) that no DCP save ever takes: the
    caller gave up between the two, or DCP failed to start the upload. Later saves on the
    engine must not wait for it."""
    engine = Engine(host_cache_size="4MiB", io_backend="threads", io_workers=2)
    try:
        DataStatesWriter(engine=engine).stage(_source_state(seed=50)).result(timeout=TIMEOUT)
        state = _source_state(seed=51)
        expected = clone_state(state)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                save(state, tmp_path, DataStatesWriter(engine=engine))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "a save waits for a snapshot that no save will take"
        assert not errors, errors
        assert_state_equal(load_into(expected, tmp_path, engine=engine), expected)
    finally:
        engine.close(timeout=1)  # ends what is still waiting


def test_snapshot_that_no_save_takes_holds_no_memory(tmp_path: Path) -> None:
    """A snapshot staged through a writer whose caller then gave up without a save must not
    keep the cache from the next save: with the cache too small for both, the next snapshot is
    still staged (in the cache or beside it), saved and loaded; the writer's close() frees it."""
    engine = Engine(host_cache_size="4MiB", io_backend="threads", io_workers=2)  # 3 MiB cache
    try:
        dropped = DataStatesWriter(engine=engine)
        dropped.stage(
            {"a": rand_tensor((640_000,), torch.float32, seed=60)}).result(timeout=TIMEOUT)
        state = {"b": rand_tensor((640_000,), torch.float32, seed=61), "step": 61}
        expected = clone_state(state)
        response = dcp.async_save(state, checkpoint_id=tmp_path,
                                  storage_writer=DataStatesWriter(engine=engine), no_dist=True)
        try:
            response.staging_completion.result(timeout=10)
        except TimeoutError:
            pytest.fail("the next snapshot waits for memory that a dropped snapshot holds")
        response.upload_completion.result(timeout=TIMEOUT)
        assert_state_equal(load_into(expected, tmp_path, engine=engine), expected)
        assert engine.live_leases() == 1, "the snapshot no save took keeps its lease"
        dropped.close()
        assert engine.live_leases() == 0, "close() must free the snapshot no save took"
    finally:
        engine.close(timeout=1)  # ends what is still waiting


_PROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from dcp_datastates import DataStatesReader, DataStatesWriter, Engine

    def main(root):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        store = dist.FileStore(os.path.join(root, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            engine = Engine(host_cache_size="8MiB", io_backend="threads")
            gen = torch.Generator().manual_seed(0)
            states, expected = [], []
            for i in range(2):
                state = {
                    "a": torch.randn(70_000, generator=gen),
                    "b": {"c": torch.randn(7, 3, generator=gen).t(), "n": i},
                }
                expected.append({"a": state["a"].clone(), "c": state["b"]["c"].clone()})
                resp = dcp.async_save(
                    state, checkpoint_id=os.path.join(root, f"ck{i}"),
                    storage_writer=DataStatesWriter(engine=engine),
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
                         storage_reader=DataStatesReader(engine=engine))
                for got, want in ((out["a"], expected[i]["a"]), (out["b"]["c"], expected[i]["c"])):
                    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
                assert out["b"]["n"] == i
                files = sorted(os.listdir(os.path.join(root, f"ck{i}")))
                assert len(files) == 3 and files[:2] == [".dcp_datastates.lock", ".metadata"], (
                    files)
                assert files[2].startswith("__0_") and files[2].endswith(".safetensors"), files
            assert engine.live_leases() == 0, engine.live_leases()
            engine.close()
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
    root = str(Path(__file__).resolve().parents[2])  # the package, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0 and "PROCESS-MODE-OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )
