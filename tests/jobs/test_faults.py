"""Faults during a save: SIGKILL mid-write, a full disk, injected I/O errors."""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import shutil
import sys
import textwrap
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
    mounted_tmpfs,
    raises_in_dcp,
    rand_tensor,
    run_then_kill,
    save,
)
from helpers.fakes import FaultyBackend
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._format.directory import LOCK_NAME
from dcp_datastates._io import ThreadPoolBackend

MiB = 1 << 20
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

pytestmark = MARKS


def _state(seed: int, nbytes: int = 2 * MiB) -> dict:
    return {
        "big": rand_tensor((nbytes,), torch.uint8, seed=seed),
        "w": rand_tensor((64, 100), torch.float32, seed=seed + 1),
        "step": seed,
    }


def _pools_empty(writer) -> None:
    leases = writer.engine.live_leases()
    assert leases == 0, f"{leases} lease(s) of host cache still held after the save ended"


# -- SIGKILL in the middle of a save -------------------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed.checkpoint as dcp
    from helpers import rand_tensor
    from helpers.fakes import FaultyBackend
    from dcp_datastates import DataStatesWriter, Engine
    from dcp_datastates._io import ThreadPoolBackend

    backend = FaultyBackend(ThreadPoolBackend(), delay_s=0.5)  # the parent kills us meanwhile

    def announce():
        backend.write_started.wait()
        print("WRITING", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    engine = Engine(io_backend=backend, host_cache_size="4MiB", io_workers=2)
    state = {{"big": rand_tensor((8 << 20,), torch.uint8, seed=77), "step": 77}}
    writer = DataStatesWriter(sys.argv[1], engine=engine, overwrite=True)
    dcp.save(state, checkpoint_id=sys.argv[1], storage_writer=writer, no_dist=True)
    print("FINISHED", flush=True)
    """
)


def _kill_mid_save(directory: Path) -> None:
    """SIGKILL a child process as its save's first data write starts."""
    run_then_kill([sys.executable, "-c", _CHILD.format(tests=str(TESTS)), str(directory)],
                  "WRITING", directory.parent / f"{directory.name}.stderr", ROOT)
    assert any(directory.glob("*.safetensors")), "a partial data file should exist by now"


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path: Path, make_writer) -> None:
    directory = tmp_path / "ckpt"
    a = _state(seed=1)
    expected_a = clone_state(a)
    save(a, directory, make_writer())
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    _kill_mid_save(directory)

    # A's files are untouched; B left (at most) a partial data file that .metadata ignores.
    after = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert {k: after[k] for k in before} == before
    leftovers = set(after) - set(before)
    assert all(re.fullmatch(r"__0_[0-9a-f]+\.safetensors", n) for n in leftovers), leftovers
    assert_state_equal(load_into(expected_a, directory), expected_a)

    # The next successful save into the directory sweeps the partial file away.
    c = _state(seed=3)
    expected_c = clone_state(c)
    save(c, directory, make_writer(overwrite=True))
    assert len(data_files(directory)) == 1
    assert_state_equal(load_into(expected_c, directory), expected_c)


def test_sigkill_mid_save_into_fresh_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    _kill_mid_save(directory)
    assert data_files(directory), "the killed save should have started a data file"
    assert not (directory / ".metadata").exists()
    with raises_in_dcp(
        FileNotFoundError,
        rf"{re.escape(str(directory))} is not a checkpoint: \.metadata is missing",
    ):
        load_into({"big": torch.zeros(8 << 20, dtype=torch.uint8), "step": 0}, directory)


# -- SIGKILL in the middle of an export ----------------------------------------------------------
_EXPORT_CHILD = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    from helpers.fakes import FaultyBackend
    from dcp_datastates import Engine
    from dcp_datastates import _cli as cli
    from dcp_datastates._io import ThreadPoolBackend

    ckpt, out, reads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    backend = FaultyBackend(ThreadPoolBackend(), hold_reads_after=reads)

    def announce():
        backend.reads_held.wait()
        print("EXPORTING", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    engine = Engine(io_backend=backend, host_cache_size="4MiB", io_workers=2)
    cli.main(["export", "-q", ckpt, out, "--max-shard-size", "300KiB"], engine=engine)
    print("FINISHED", flush=True)
    """
)


def _model(seed: int) -> dict:
    """Three 256 KiB tensors: an export of ``--max-shard-size 300KiB`` writes a shard each."""
    return {f"layer{k}": rand_tensor((64 << 10,), torch.float32, seed=seed + k)
            for k in range(3)}


def _export(ckpt: Path, out: Path, engine: Engine) -> None:
    assert cli.main(["export", "-q", str(ckpt), str(out), "--max-shard-size", "300KiB"],
                    engine=engine) == 0


def _model_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir()
            if p.name.startswith("model") and p.is_file()}


def test_sigkill_mid_export_leaves_the_old_export_whole(tmp_path: Path, make_writer,
                                                         faulty_engine) -> None:
    """An export killed while it reads its last shard's tensor, into a directory that holds
    an earlier export of another checkpoint: the directory still holds that export whole
    (never new shards under the old index); the next export replaces it and removes what the
    killed one left."""
    old_ckpt, new_ckpt, out = tmp_path / "old", tmp_path / "new", tmp_path / "hf"
    save(_model(1), old_ckpt, make_writer())
    new = _model(10)
    expected_new = clone_state(new)
    save(new, new_ckpt, make_writer())
    engine, counting = faulty_engine()
    _export(old_ckpt, out, engine)
    old_files = _model_files(out)
    assert len(old_files) == 4, sorted(old_files)  # three shards and the index
    reads = counting.reads

    run_then_kill([sys.executable, "-c", _EXPORT_CHILD.format(tests=str(TESTS)), str(new_ckpt),
                   str(out), str(reads - 1)], "EXPORTING", tmp_path / "export.stderr", ROOT)
    assert _model_files(out) == old_files

    _export(new_ckpt, out, engine)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["model.safetensors.index.json", *set(index["weight_map"].values())])
    got: dict = {}
    for shard in set(index["weight_map"].values()):
        got |= load_file(out / shard)
    assert_state_equal(got, expected_new)


# -- a full disk ---------------------------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs():
    """A 2 MiB tmpfs (root only; skipped where mounting is not permitted)."""
    with mounted_tmpfs("2m", "dcp_enospc_") as mnt:
        yield mnt


def _assert_enospc(err: BaseException, directory: Path) -> None:
    if isinstance(err, CheckpointException):
        (err,) = [exc for exc, _ in err.failures.values()]
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
    assert re.search(rf"{re.escape(str(directory))}/__0_[0-9a-f]+\.safetensors", str(err)), err


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_enospc_on_a_full_file_system(
    tiny_tmpfs: Path, tmp_path: Path, make_writer, mode: str
) -> None:
    writer = make_writer(host_cache_size="8MiB")
    state = _state(seed=5, nbytes=3 * MiB)  # more than the 2 MiB file system
    expected = clone_state(state)
    directory = tiny_tmpfs / "ckpt"
    with pytest.raises((OSError, CheckpointException)) as info:
        if mode == "sync":
            save(state, directory, writer)
        else:
            dcp.async_save(state, checkpoint_id=directory, storage_writer=writer,
                           no_dist=True).upload_completion.result(timeout=60)
    _assert_enospc(info.value, directory)
    info = None
    assert not (directory / ".metadata").exists()
    assert data_files(directory) == [], "the partial data file must be removed"
    assert os.statvfs(tiny_tmpfs).f_bfree * os.statvfs(tiny_tmpfs).f_frsize > MiB
    _pools_empty(writer)

    # The same writer saves elsewhere (and on the small file system, a state that fits).
    save(state, tmp_path / "ok", writer)
    assert_state_equal(load_into(expected, tmp_path / "ok"), expected)
    small = _state(seed=6, nbytes=256 << 10)
    expected_small = clone_state(small)
    save(small, tiny_tmpfs / "small", writer)
    assert_state_equal(load_into(expected_small, tiny_tmpfs / "small"), expected_small)


def test_enospc_at_the_commit_names_the_metadata_file(tmp_path: Path, make_writer) -> None:
    """A file system with room for the data file but not for ``.metadata``: the save fails
    with an ENOSPC naming the file it could not write, and leaves neither file; the
    checkpoint already there loads as it was, and with room again the next save commits."""
    state, old = _state(seed=11, nbytes=MiB), _state(seed=12, nbytes=4096)
    expected, expected_old = clone_state(state), clone_state(old)
    writer = make_writer(host_cache_size="8MiB")
    save(state, tmp_path / "new", writer)
    save(old, tmp_path / "old", writer)
    # KiB: the old checkpoint's pages and the new data file's, not one more
    room = sum(-(-p.stat().st_size // 4096) * 4 for p in [
        *data_files(tmp_path / "new"), *(tmp_path / "old").iterdir()])
    with mounted_tmpfs(f"{room}k", "dcp_enospc_commit_") as mnt:
        directory = mnt / "ckpt"
        save(old, directory, writer)
        with pytest.raises((OSError, CheckpointException)) as info:
            save(state, directory, make_writer(host_cache_size="8MiB", overwrite=True))
        err = info.value
        if isinstance(err, CheckpointException):
            (err,) = [exc for exc, _ in err.failures.values()]
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC, repr(err)
        assert re.fullmatch(rf"\[Errno 28\] write failed: No space left on device: "
                            rf"'{re.escape(str(directory))}/\.metadata\.tmp\.[0-9a-f]+'",
                            str(err)), str(err)
        err = info = None
        assert sorted(p.name for p in directory.iterdir() if p.name != LOCK_NAME) == sorted(
            [".metadata", *(p.name for p in data_files(directory))])
        assert_state_equal(load_into(expected_old, directory), expected_old)
        shutil.rmtree(directory)
        save(state, directory, writer)
        assert_state_equal(load_into(expected, directory), expected)


# -- injected write errors -----------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_injected_write_error(
    tmp_path: Path, make_writer, faulty_engine, io_backend: str, code: int, mode: str
) -> None:
    # The first data write succeeds, every later one fails with ``code``.
    engine, backend = faulty_engine(io_backend, host_cache_size="8MiB", fail_write_after=1,
                                    errno_=code)
    writer = make_writer(engine=engine)
    state = _state(seed=8)
    expected = clone_state(state)
    directory = tmp_path / "ckpt"
    with pytest.raises((OSError, CheckpointException)) as info:
        if mode == "sync":
            save(state, directory, writer)
        else:
            response = dcp.async_save(state, checkpoint_id=directory, storage_writer=writer,
                                      no_dist=True)
            response.staging_completion.result(timeout=60)
            state["big"].add_(1)  # training goes on; the failed save must not matter
            response.upload_completion.result(timeout=60)
    backend.fail_write_after = None  # the disk works again
    err = info.value
    if isinstance(err, CheckpointException):
        (err,) = [exc for exc, _ in err.failures.values()]
    assert isinstance(err, OSError) and err.errno == code, repr(err)
    assert re.search(rf"{re.escape(str(directory))}/__0_[0-9a-f]+\.safetensors", str(err)), err
    err = info = None
    assert backend.writes >= 2, "the fault was never injected"
    assert not (directory / ".metadata").exists()
    assert data_files(directory) == []
    _pools_empty(writer)  # at once: nothing waits for the garbage collector

    # The next save with the same writer succeeds, into the same directory.
    state = _state(seed=9)
    expected = clone_state(state)
    if mode == "sync":
        save(state, directory, writer)
    else:
        dcp.async_save(state, checkpoint_id=directory, storage_writer=writer,
                       no_dist=True).upload_completion.result(timeout=60)
    assert writer.last_stats().overflow_bytes == 0
    assert_state_equal(load_into(expected, directory), expected)


@pytest.mark.parametrize("failure", ["under_a_file", "exists"])
def test_failed_async_saves_release_memory_without_gc(
    tmp_path: Path, make_engine, failure: str
) -> None:
    """Async saves that fail (the directory lies under a regular file; a checkpoint is there
    and overwrite is off), more of them than the host cache holds, with the garbage collector
    off: each gives its memory back when it fails, so the next save, on the same writer and on
    a fresh one, starts at once; the checkpoint already there stays intact."""
    engine = make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)
    previous = _state(seed=20)
    expected_previous = clone_state(previous)
    directory = tmp_path / "ckpt"
    save(previous, directory, DataStatesWriter(engine=engine))
    if failure == "under_a_file":
        (tmp_path / "plain_file").write_text("not a directory")
        bad = tmp_path / "plain_file" / "ckpt"
        error, match = OSError, re.escape(str(tmp_path / "plain_file"))
    else:
        bad = directory
        error, match = RuntimeError, "Checkpoint already exists and overwrite=False"
    gc.collect()
    gc.disable()
    try:
        writer = DataStatesWriter(engine=engine)
        for attempt in range(4):  # 4 x 2 MiB: more than the 6 MiB of snapshot cache
            state = _state(seed=30 + attempt)
            response = dcp.async_save(state, checkpoint_id=bad, storage_writer=writer,
                                      no_dist=True)
            response.staging_completion.result(timeout=5)
            with raises_in_dcp(error, match):
                response.upload_completion.result(timeout=60)
            assert engine.live_leases() == 0, f"attempt {attempt}: the failed save held memory"
        for k, w in enumerate([writer, DataStatesWriter(engine=engine)]):
            state = _state(seed=40 + k)
            expected = clone_state(state)
            start = time.monotonic()
            response = dcp.async_save(state, checkpoint_id=tmp_path / f"ok{k}", storage_writer=w,
                                      no_dist=True)
            response.staging_completion.result(timeout=5)
            assert time.monotonic() - start < 5, "the save after failed ones did not start"
            state["big"].zero_()
            response.upload_completion.result(timeout=60)
            assert engine.live_leases() == 0
            assert_state_equal(load_into(expected, tmp_path / f"ok{k}", engine=engine), expected)
    finally:
        gc.enable()
    assert_state_equal(load_into(expected_previous, directory, engine=engine), expected_previous)


# -- a save that fails while writing -------------------------------------------------------------
@pytest.fixture
def faulty(make_engine):
    """An engine writing through a FaultyBackend (disarmed: ``arm(ok)`` makes every write
    after the next ``ok`` fail with EIO; ``disarm()`` makes writes succeed again)."""
    backend = FaultyBackend(ThreadPoolBackend())
    engine = make_engine(host_cache_size="4MiB", io_backend=backend, io_workers=4)
    yield engine, backend
    assert engine.live_leases() == 0, "a save kept host cache memory after it ended"
    engine.close()
    assert backend.live_buffers() == [], "the engine left a buffer registered after close"
    backend.close()


def arm(backend: FaultyBackend, ok: int) -> None:
    backend.fail_write_after = backend.writes + ok


def disarm(backend: FaultyBackend) -> None:
    backend.fail_write_after = None


INJECTED = r"\(injected\)"


def _big_state(seed: int) -> dict:
    # ~1.8 MiB: several flush extents (a 4 MiB cache has 256 KiB extents), so writes fail
    # partway; and more than half of a 4 MiB cache's 3 MiB snapshot pool.
    return {
        "big": rand_tensor((3 * MiB // 2 + 77,), torch.uint8, seed=seed),
        "w": rand_tensor((100, 700), torch.float32, seed=seed + 1),
        "step": seed,
    }


@pytest.mark.parametrize("direct_io", [True, False])
def test_failed_write_keeps_previous_checkpoint(
    tmp_path: Path, make_writer, faulty, direct_io: bool
) -> None:
    engine, backend = faulty
    directory = tmp_path / "ckpt"
    a = _big_state(seed=1)
    expected_a = clone_state(a)
    save(a, directory, make_writer())
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    writer = DataStatesWriter(engine=engine, overwrite=True, direct_io=direct_io)
    b = _big_state(seed=2)
    expected_b = clone_state(b)
    arm(backend, ok=1)  # a buffered save makes only 2 write calls (an O_DIRECT one, 10)
    start = backend.writes
    with raises_in_dcp(OSError, rf"{INJECTED}: .*__0_[0-9a-f]+\.safetensors"):
        save(b, directory, writer)
    assert backend.writes - start > 1, "the failure should come after some data was written"
    disarm(backend)
    assert engine.live_leases() == 0

    # Nothing of B's remains; A is untouched and still loads.
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert_state_equal(load_into(expected_a, directory), expected_a)

    # A failed save into a fresh directory leaves no .metadata and no data file.
    fresh = tmp_path / "fresh"
    arm(backend, ok=0)
    with raises_in_dcp(OSError, INJECTED):
        save(b, fresh, writer)
    disarm(backend)
    assert [p.name for p in fresh.iterdir() if p.name != LOCK_NAME] == []
    assert engine.live_leases() == 0

    # The same writer works again afterwards and replaces A with B.
    save(b, directory, writer)
    assert_state_equal(load_into(expected_b, directory), expected_b)
    assert len(data_files(directory)) == 1


def test_failed_async_save_releases_host_cache(tmp_path: Path, faulty) -> None:
    """A failed flush gives its snapshot's cache back, even while its error object is alive."""
    engine, backend = faulty
    writer = DataStatesWriter(engine=engine)
    state = _big_state(seed=3)
    expected = clone_state(state)
    arm(backend, ok=1)
    first = dcp.async_save(state, checkpoint_id=tmp_path / "a", storage_writer=writer,
                           no_dist=True)
    with pytest.raises(CheckpointException) as info:  # kept alive to the end of the test
        first.upload_completion.result(timeout=60)
    disarm(backend)
    assert re.search(INJECTED, str(info.value))
    assert engine.live_leases() == 0
    assert not (tmp_path / "a" / ".metadata").exists() and data_files(tmp_path / "a") == []

    second = dcp.async_save(state, checkpoint_id=tmp_path / "b", storage_writer=writer,
                            no_dist=True)
    staged_in_time = True
    try:
        second.staging_completion.result(timeout=5)
    except TimeoutError:
        staged_in_time = False
    finally:
        if not staged_in_time:  # end the waiting save rather than leave its thread blocked
            engine.close(timeout=1)
        try:
            second.upload_completion.result(timeout=60)
        except Exception:
            if staged_in_time:
                raise
    assert staged_in_time, "staging waited for cache memory that the failed save never freed"
    assert_state_equal(load_into(expected, tmp_path / "b"), expected)
    assert info.value is not None
