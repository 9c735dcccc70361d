"""Bad input and damaged checkpoints: each fails with an error that names what is wrong."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    MARKS,
    assert_state_equal,
    blank_like,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    rand_tensor,
    save,
)
from fakes import FaultyBackend
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointCorruptError, CheckpointError, DataStatesWriter, Engine
from dcp_datastates.directory import LOCK_NAME
from dcp_datastates.io import ThreadPoolBackend
from dcp_datastates.metadata_file import read_metadata, write_metadata

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # older torch: the version its own writer stamps
    CURRENT_DCP_VERSION = "1.0.0"

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
        RuntimeError,
        rf"Checkpoint already exists and overwrite=False: {re.escape(str(directory))} .*"
        r"overwrite=True",
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
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [".metadata", LOCK_NAME, new_file.name]
    )
    assert_state_equal(load_into(expected, directory, io_backend=io_backend), expected)


def test_overwrite_of_a_filesystem_writer_checkpoint_removes_its_files(
    tmp_path: Path, make_writer, faulty_engine
) -> None:
    """DCP FileSystemWriter's data files (``__0_0.distcp``) and a ``.metadata.tmp.<token>``
    that a killed save left: gone once the new ``.metadata`` is committed, not before (a save
    that fails leaves the previous checkpoint whole: DCP's reader still loads it)."""
    directory = tmp_path / "ckpt"
    theirs = _state(seed=3)
    expected_theirs = clone_state(theirs)
    dcp.save(theirs, storage_writer=FileSystemWriter(directory), no_dist=True)
    distcp = sorted(p.name for p in directory.glob("*.distcp"))
    assert distcp, "DCP's writer should have written .distcp files"
    (directory / ".metadata.tmp.0123456789abcdef").write_bytes(b"a commit that died")

    engine, _ = faulty_engine(fail_write_after=0)
    with pytest.raises((CheckpointException, OSError)):
        save(_state(seed=8), directory, make_writer(overwrite=True, engine=engine))
    assert sorted(p.name for p in directory.glob("*.distcp")) == distcp
    loaded = blank_like(expected_theirs)
    dcp.load(loaded, storage_reader=FileSystemReader(directory), no_dist=True)
    assert_state_equal(loaded, expected_theirs)

    new = _state(seed=9)
    expected = clone_state(new)
    save(new, directory, make_writer(overwrite=True))
    (data,) = data_files(directory)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [".metadata", LOCK_NAME, data.name])
    assert_state_equal(load_into(expected, directory), expected)


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


def _dcp_error(err: BaseException) -> str:
    """The message of the error a DCP call raised (a rank's own, if DCP wrapped it)."""
    if isinstance(err, CheckpointException):
        (err,) = [exc for exc, _ in err.failures.values()]
    return str(err)


def test_default_reader_on_our_checkpoint_points_at_datastates_reader(
    tmp_path: Path, make_writer
) -> None:
    """DCP's FileSystemReader unpickles .metadata with plain pickle: ours refuses it, naming
    the reader to use, while DataStatesReader reads it."""
    directory, expected = _checkpoint(tmp_path, make_writer)
    hint = "storage_reader=dcp_datastates.DataStatesReader()"
    with (directory / ".metadata").open("rb") as f, pytest.raises(CheckpointError) as plain:
        pickle.load(f)
    assert hint in str(plain.value)
    with pytest.raises((CheckpointException, AssertionError)) as info:
        dcp.load(blank_like(expected), checkpoint_id=directory, no_dist=True)
    assert hint in _dcp_error(info.value)
    assert_state_equal(load_into(expected, directory), expected)


@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_older_metadata_formats_still_load(tmp_path: Path, make_writer, container: str) -> None:
    """.metadata as written before: a plain pickle of DCP's Metadata, or torch.save (0.1.0)."""
    directory, expected = _checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    if container == "pickle":
        data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        buf = io.BytesIO()
        torch.save(metadata, buf)
        data = buf.getvalue()
    (directory / ".metadata").write_bytes(data)
    assert read_metadata(directory) == metadata
    assert_state_equal(load_into(expected, directory), expected)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_metadata_that_is_not_a_regular_file(tmp_path: Path, make_writer, kind: str) -> None:
    """Refused at once (a FIFO is not waited on), and a link is not followed even to a good
    copy of the checkpoint's own .metadata."""
    directory, expected = _checkpoint(tmp_path, make_writer)
    md = directory / ".metadata"
    md.rename(tmp_path / "elsewhere")
    if kind == "fifo":
        os.mkfifo(md)
    elif kind == "symlink":
        md.symlink_to(tmp_path / "elsewhere")
    else:
        md.mkdir()
    why = {"fifo": r"is not a regular file \(a FIFO", "symlink": r"is a symbolic link",
           "directory": r"is not a regular file \(a directory\)"}[kind]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(load_into, expected, directory)
        try:
            with raises_in_dcp(CheckpointCorruptError, rf"{re.escape(str(md))} {why}"):
                future.result(timeout=60)
        finally:
            if kind == "fifo" and not future.done():  # a regression: let the open return
                os.close(os.open(md, os.O_WRONLY | os.O_NONBLOCK))


def test_metadata_pointing_outside_the_directory(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], file="../" + data_files(directory)[0].name
    )
    write_metadata(directory, metadata, "test")
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


# -- a data file replaced by a symbolic link -----------------------------------------------------
def test_symlink_at_a_data_file_name_is_refused(
    tmp_path: Path, make_writer, io_backend: str
) -> None:
    """Data files are opened with O_NOFOLLOW: a link planted under a data file's name is not
    followed, even to a file with the very bytes that were saved."""
    directory, old = _checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    elsewhere = tmp_path / "elsewhere.safetensors"
    file.rename(elsewhere)
    file.symlink_to(elsewhere)
    assert file.is_symlink() and file.is_file()  # following the link would find a good file
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"checkpoint {re.escape(str(directory))}: data file {file.name} is a symbolic link "
        rf"\(checkpoint files are never opened through one\) \(item '.*' lives there\)",
    ):
        load_into(old, directory, io_backend=io_backend)
    file.unlink()
    elsewhere.rename(file)  # the real file back in place: the checkpoint loads
    assert_state_equal(load_into(old, directory, io_backend=io_backend), old)


# -- what a save stamps in .metadata -------------------------------------------------------------
def test_metadata_version_is_stamped(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    assert metadata.version == CURRENT_DCP_VERSION
    assert CURRENT_DCP_VERSION == "1.0.0"


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
        Engine(host_cache_size=size, io_backend="threads")


def test_host_cache_size_type() -> None:
    with pytest.raises(TypeError, match="host_cache_size must be an int or a string"):
        Engine(host_cache_size=1.5, io_backend="threads")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_cache_size": "8KiB"}, r"host_cache_size must be at least 16 KiB, got '8KiB'"),
        ({"host_cache_size": 8192}, r"host_cache_size must be at least 16 KiB, got 8192"),
        ({"io_backend": "bogus"},
         r"unknown I/O backend 'bogus'; valid names: auto, uring, threads"),
        ({"io_workers": 0}, r"io_workers must be an integer >= 1, got 0"),
        ({"io_workers": -3}, r"io_workers must be an integer >= 1, got -3"),
        ({"io_workers": 2.0}, r"io_workers must be an integer >= 1, got 2\.0"),
    ],
)
def test_engine_rejects_bad_arguments_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(**{"host_cache_size": "1MiB", "io_backend": "threads", **kwargs}).close()


def test_reader_rejects_unknown_io_backend(tmp_path: Path, make_writer) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    message = r"unknown I/O backend 'bogus'; valid names: auto, uring, threads"
    with pytest.raises((ValueError, CheckpointException), match=message):  # made, or used
        load_into(old, directory, io_backend="bogus")


def _tmpfs_dir() -> Path:
    """A fresh directory on /dev/shm (skips the test where /dev/shm is not tmpfs)."""
    with open("/proc/mounts") as f:
        mounts = {fields[1]: fields[2] for fields in (line.split() for line in f)}
    if mounts.get("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs mount here")
    return Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dcp_datastates_test_"))


def test_direct_io_on_tmpfs_is_refused_at_construction(make_engine) -> None:
    directory = _tmpfs_dir()
    try:
        path = directory / "ckpt"
        with pytest.raises(ValueError, match=rf"{re.escape(str(directory))}.*tmpfs"):
            DataStatesWriter(path, engine=make_engine(io_backend="threads"), direct_io=True)
        assert not path.exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_direct_io_on_tmpfs_is_refused_when_the_path_comes_with_the_save(make_writer) -> None:
    directory = _tmpfs_dir()
    try:
        path = directory / "ckpt"
        with raises_in_dcp(ValueError, rf"{re.escape(str(directory))}.*tmpfs"):
            save(_state(), path, make_writer(direct_io=True))
        assert not (path / ".metadata").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- the engine's lifetime -----------------------------------------------------------------------
def test_engine_close_frees_its_memory_and_refuses_further_use(
    tmp_path: Path, make_engine
) -> None:
    engine = make_engine(host_cache_size="1MiB", io_backend="threads")
    state = _state()
    expected = clone_state(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "a",
                   storage_writer=DataStatesWriter(engine=engine),
                   no_dist=True).upload_completion.result(timeout=60)
    assert engine.cache_bytes() > 0 and engine.live_leases() == 0
    engine.close()
    assert engine.cache_bytes() == 0 and engine.live_leases() == 0
    engine.close()  # idempotent
    closed = r"Engine is closed"
    with pytest.raises(RuntimeError, match=closed):
        engine.reserve(4096)
    with pytest.raises(RuntimeError, match=closed):
        _ = engine.bounce
    with pytest.raises(RuntimeError, match=closed):
        engine.new_save_job()
    with raises_in_dcp(RuntimeError, closed):
        save(state, tmp_path / "b", DataStatesWriter(engine=engine))
    assert not (tmp_path / "b" / ".metadata").exists()
    assert engine.cache_bytes() == 0
    # The checkpoint saved before the close is whole.
    assert_state_equal(load_into(expected, tmp_path / "a", io_backend="threads"), expected)


def test_load_on_a_closed_engine_says_so(tmp_path: Path, make_writer, make_engine) -> None:
    directory, old = _checkpoint(tmp_path, make_writer)
    engine = make_engine(io_backend="threads")
    engine.close()
    with raises_in_dcp(RuntimeError, r"Engine is closed"):
        load_into(old, directory, engine=engine)


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
        with pytest.raises(CheckpointException, match="Checkpoint already exists"):
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
