"""Bad input and damaged checkpoints: each fails with an error that names what is wrong."""

from __future__ import annotations

import dataclasses
import errno
import gc
import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    MARKS,
    assert_state_equal,
    clone_state,
    data_files,
    join_init_threads,
    load_into,
    raises_in_dcp,
    rand_tensor,
    save,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import dcp_datastates.writer as writer_mod
from dcp_datastates import CheckpointCorruptError, DataStatesReader, DataStatesWriter
from dcp_datastates.io import get_backend
from dcp_datastates.metadata_file import read_metadata, write_metadata

MiB = 1 << 20

pytestmark = MARKS


def _state(seed: int = 0) -> dict:
    return {
        "w": rand_tensor((300, 257), torch.float32, seed=seed),
        "b": rand_tensor((257,), torch.bfloat16, seed=seed + 1),
        "cfg": {"lr": 0.1 * (seed + 1), "name": f"run{seed}"},
    }


def _checkpoint(tmp_path: Path, make_writer, seed: int = 0) -> tuple[Path, dict]:
    directory = tmp_path / "ckpt"
    state = _state(seed)
    save(state, directory, make_writer())
    return directory, clone_state(state)


def _locations(directory: Path) -> dict:
    return {idx.fqn: loc for idx, loc in read_metadata(directory).storage_data.items()}


# -- saving over an existing checkpoint ----------------------------------------------------------
def test_save_into_existing_checkpoint_needs_overwrite(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with raises_in_dcp(
        FileExistsError, rf"{re.escape(str(directory))} already holds a checkpoint.*overwrite=True"
    ):
        save(_state(seed=5), directory, make_writer())
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert_state_equal(load_into(old, directory), old)


def test_overwrite_replaces_checkpoint_and_removes_old_files(
    tmp_path: Path, make_writer, io_backend: str
) -> None:
    directory, _ = _checkpoint(tmp_path, make_writer)
    (old_file,) = data_files(directory)
    new = _state(seed=7)
    expected = clone_state(new)
    save(new, directory, make_writer(overwrite=True, io_backend=io_backend))
    (new_file,) = data_files(directory)
    assert new_file.name != old_file.name and not old_file.exists()
    assert {loc.file for loc in _locations(directory).values()} == {new_file.name}
    assert sorted(p.name for p in directory.iterdir()) == sorted([".metadata", new_file.name])
    assert_state_equal(load_into(expected, directory, io_backend=io_backend), expected)


# -- loading what is not a (whole) checkpoint ----------------------------------------------------
@pytest.mark.parametrize("exists", [True, False])
def test_load_without_metadata(tmp_path: Path, exists: bool) -> None:
    directory = tmp_path / "nothing"
    if exists:
        directory.mkdir()
    with raises_in_dcp(
        BaseException, rf"{re.escape(str(directory))} is not a checkpoint: \.metadata is missing"
    ):
        load_into({"w": torch.zeros(1)}, directory)


def test_garbage_metadata(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    (directory / ".metadata").write_bytes(b"\x80\x05 this is not a pickle" * 10)
    with raises_in_dcp(
        BaseException, rf"{re.escape(str(directory / '.metadata'))}: .*checkpoint metadata"
    ):
        load_into(old, directory)


def test_metadata_of_another_storage_writer(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    with raises_in_dcp(
        BaseException,
        rf"{re.escape(str(tmp_path / '.metadata'))}: .*another storage writer",
    ):
        load_into(state, tmp_path)


def test_metadata_pointing_outside_the_directory(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], file="../" + data_files(directory)[0].name
    )
    write_metadata(directory, metadata)
    with raises_in_dcp(BaseException, r"item 'w' has an invalid location"):
        load_into(old, directory)


def test_missing_data_file(tmp_path: Path, make_writer, io_backend: str) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    file.unlink()
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"checkpoint {re.escape(str(directory))}: data file {file.name} is missing \(item '",
    ):
        load_into(old, directory, io_backend=io_backend)


def test_truncated_data_file(tmp_path: Path, make_writer, io_backend: str) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    locations = _locations(directory)
    fqn, last = max(locations.items(), key=lambda kv: kv[1].offset + kv[1].length)
    cut = last.offset + last.length - 1
    assert all(loc.offset + loc.length <= cut for k, loc in locations.items() if k != fqn)
    with open(file, "r+b") as f:
        f.truncate(cut)
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"data file {file.name} is truncated: item '{re.escape(fqn)}' needs bytes "
        rf"{last.offset}\.\.{last.offset + last.length}, the file has {cut}",
    ):
        load_into(old, directory, io_backend=io_backend)


def _flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


@pytest.mark.parametrize("fqn", ["w", "b", "cfg.name"])
def test_flipped_byte_is_detected(tmp_path: Path, make_writer, io_backend: str, fqn: str) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    loc = _locations(directory)[fqn]
    _flip(file, loc.offset + loc.length // 2)
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"checkpoint {re.escape(str(directory))}, file {file.name}, item '{fqn}': checksum "
        rf"mismatch in item bytes 0\.\.{loc.length}",
    ):
        load_into(old, directory, io_backend=io_backend)


def test_flipped_byte_loads_without_verification(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    loc = _locations(directory)["w"]
    _flip(file, loc.offset + 1000)
    loaded = load_into(old, directory, verify_checksums=False)
    expected = clone_state(old)
    expected["w"].reshape(-1).view(torch.uint8)[1000] ^= 0x01
    assert_state_equal(loaded, expected)


# -- bad arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("12 parsecs", r"host_cache_size='12 parsecs' is not a size"),
        ("", r"host_cache_size='' is not a size"),
        ("-1MiB", r"host_cache_size='-1MiB' is not a size"),
        (-4096, r"host_cache_size must not be negative, got -4096"),
    ],
)
def test_bad_host_cache_size(size, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataStatesWriter(host_cache_size=size)
    with pytest.raises(ValueError, match=message):
        DataStatesReader(host_cache_size=size)


def test_host_cache_size_type(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="host_cache_size must be an int or a string"):
        DataStatesWriter(host_cache_size=1.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_cache_size": "8KiB"}, r"host_cache_size must be at least 16 KiB, got 8192 bytes"),
        ({"io_backend": "bogus"}, r"unknown I/O backend 'bogus'; valid names: auto, uring"),
    ],
)
def test_writer_rejects_bad_arguments_at_construction(kwargs: dict, message: str) -> None:
    try:
        with pytest.raises(ValueError, match=message):
            DataStatesWriter(**{"host_cache_size": "1MiB", **kwargs}).close()
    finally:
        join_init_threads()


def test_reader_rejects_unknown_io_backend(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    message = r"unknown I/O backend 'bogus'; valid names: auto, uring, threads"
    with pytest.raises((ValueError, CheckpointException), match=message):  # made, or used
        load_into(old, directory, io_backend="bogus")


def test_close_right_after_construction_frees_the_engine(monkeypatch) -> None:
    """close() before the background cache allocation finished must not leak that cache."""
    real_init = writer_mod._Engine.__init__

    def slow_init(self, *args, **kwargs):
        time.sleep(0.2)  # allocating and pinning a large cache takes a while
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(writer_mod._Engine, "__init__", slow_init)
    writer = DataStatesWriter(host_cache_size="1MiB", io_backend="threads")
    writer.close()
    join_init_threads()
    assert writer._engine is None  # no host cache or flush threads left behind


# -- a save that fails while writing -------------------------------------------------------------
class _FailingWrites:
    """Make the shared "threads" backend fail with EIO after ``ok`` successful writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.backend = get_backend("threads")
        self.real = self.backend.write
        self.monkeypatch = monkeypatch
        self.calls = 0

    def arm(self, ok: int) -> None:
        counter = itertools.count()

        def write(fd, path, reqs):
            self.calls = next(counter) + 1
            if self.calls > ok:
                raise OSError(errno.EIO, "injected I/O error", path)
            return self.real(fd, path, reqs)

        self.monkeypatch.setattr(self.backend, "write", write)

    def disarm(self) -> None:
        self.monkeypatch.setattr(self.backend, "write", self.real)


@pytest.fixture
def failing_writes(monkeypatch: pytest.MonkeyPatch) -> _FailingWrites:
    return _FailingWrites(monkeypatch)


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
    tmp_path: Path, make_writer, failing_writes: _FailingWrites, direct_io: bool
) -> None:
    directory = tmp_path / "ckpt"
    a = _big_state(seed=1)
    expected_a = clone_state(a)
    save(a, directory, make_writer())
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    writer = make_writer(overwrite=True, io_backend="threads", direct_io=direct_io)
    b = _big_state(seed=2)
    expected_b = clone_state(b)
    failing_writes.arm(ok=2)
    with raises_in_dcp(OSError, r"injected I/O error: .*__0_[0-9a-f]+\.safetensors"):
        save(b, directory, writer)
    assert failing_writes.calls > 2, "the failure should come after some data was written"
    failing_writes.disarm()

    # Nothing of B's remains; A is untouched and still loads.
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert_state_equal(load_into(expected_a, directory), expected_a)

    # A failed save into a fresh directory leaves no .metadata and no data file.
    fresh = tmp_path / "fresh"
    failing_writes.arm(ok=1)
    with raises_in_dcp(OSError, r"injected I/O error"):
        save(b, fresh, writer)
    failing_writes.disarm()
    assert list(fresh.iterdir()) == []

    # The same writer works again afterwards and replaces A with B.
    save(b, directory, writer)
    assert_state_equal(load_into(expected_b, directory), expected_b)
    assert len(data_files(directory)) == 1


def test_failed_async_save_releases_host_cache(
    tmp_path: Path, make_writer, failing_writes: _FailingWrites
) -> None:
    """A failed flush gives its snapshot's cache back even while its error object is alive."""
    writer = make_writer(host_cache_size="4MiB", io_backend="threads")
    state = _big_state(seed=3)
    expected = clone_state(state)
    failing_writes.arm(ok=1)
    first = dcp.async_save(state, checkpoint_id=tmp_path / "a", storage_writer=writer,
                           no_dist=True)
    first_error = ""
    try:
        first.upload_completion.result(timeout=60)
    except CheckpointException as e:  # keep only the text: the exception pins the snapshot
        first_error = str(e)
    failing_writes.disarm()
    assert "injected I/O error" in first_error
    assert not (tmp_path / "a" / ".metadata").exists() and data_files(tmp_path / "a") == []

    second = dcp.async_save(state, checkpoint_id=tmp_path / "b", storage_writer=writer,
                            no_dist=True)
    staged_in_time = True
    try:
        second.staging_completion.result(timeout=5)
    except TimeoutError:
        staged_in_time = False
    finally:
        # Unblock the stager whatever happened, so no thread is left waiting.
        first = None
        gc.collect()
        deadline = time.monotonic() + 5
        while not second.staging_completion.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not second.staging_completion.done():
            for region in list(writer.engine.stager._by_addr.values()):
                region.release()
        second.upload_completion.result(timeout=60)
    assert staged_in_time, "staging waited for cache regions that the failed save never freed"
    assert_state_equal(load_into(expected, tmp_path / "b"), expected)


def test_failed_save_on_one_thread_does_not_block_saves_on_another(
    tmp_path: Path, make_writer
) -> None:
    directory, _ = _checkpoint(tmp_path, make_writer)
    writer = make_writer()
    saver = ThreadPoolExecutor(1, thread_name_prefix="long-lived-saver")
    other = ThreadPoolExecutor(1, thread_name_prefix="other-saver")
    state = _state(seed=9)
    expected = clone_state(state)
    try:
        failed = saver.submit(save, _state(seed=8), directory, writer)  # no overwrite=True
        with pytest.raises(CheckpointException, match="already holds a checkpoint"):
            failed.result(timeout=60)
        second = other.submit(save, state, tmp_path / "fresh", writer)
        finished = True
        try:
            second.result(timeout=5)
        except FutureTimeout:
            finished = False
    finally:
        saver.shutdown(wait=True)  # the owner thread exits: a waiting save takes the turn over
        other.shutdown(wait=True)
    assert finished, "the save on another thread waited for the failed save's turn"
    assert_state_equal(load_into(expected, tmp_path / "fresh"), expected)
