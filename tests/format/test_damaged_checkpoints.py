"""Damaged checkpoints and saves over an existing one: each fails with an error that names what
is wrong (no or garbage ``.metadata``, a data file missing, truncated, flipped or replaced by
a link, a checkpoint saved without ``overwrite``)."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    blank_like,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    save,
    small_checkpoint,
    small_state,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointCorruptError, CheckpointError
from dcp_datastates._format.directory import LOCK_NAME
from dcp_datastates._format.metadata_file import read_metadata, write_metadata

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # older torch: the version its own writer stamps
    CURRENT_DCP_VERSION = "1.0.0"

MiB = 1 << 20

pytestmark = MARKS


def _locations(directory: Path) -> dict:
    return {idx.fqn: loc for idx, loc in read_metadata(directory).storage_data.items()}


# -- saving over an existing checkpoint ----------------------------------------------------------
def test_save_into_existing_checkpoint_needs_overwrite(tmp_path: Path, make_writer) -> None:
    directory, old = small_checkpoint(tmp_path, make_writer)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with raises_in_dcp(
        RuntimeError,
        rf"Checkpoint already exists and overwrite=False: {re.escape(str(directory))} .*"
        r"overwrite=True",
    ):
        save(small_state(seed=5), directory, make_writer())
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert_state_equal(load_into(old, directory), old)


def test_overwrite_replaces_checkpoint_and_removes_old_files(
    tmp_path: Path, make_writer, io_backend: str
) -> None:
    directory, _ = small_checkpoint(tmp_path, make_writer)
    (old_file,) = data_files(directory)
    new = small_state(seed=7)
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
    theirs = small_state(seed=3)
    expected_theirs = clone_state(theirs)
    dcp.save(theirs, storage_writer=FileSystemWriter(directory), no_dist=True)
    distcp = sorted(p.name for p in directory.glob("*.distcp"))
    assert distcp, "DCP's writer should have written .distcp files"
    (directory / ".metadata.tmp.0123456789abcdef").write_bytes(b"a commit that died")

    engine, _ = faulty_engine(fail_write_after=0)
    with pytest.raises((CheckpointException, OSError)):
        save(small_state(seed=8), directory, make_writer(overwrite=True, engine=engine))
    assert sorted(p.name for p in directory.glob("*.distcp")) == distcp
    loaded = blank_like(expected_theirs)
    dcp.load(loaded, storage_reader=FileSystemReader(directory), no_dist=True)
    assert_state_equal(loaded, expected_theirs)

    new = small_state(seed=9)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
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
    directory, expected = small_checkpoint(tmp_path, make_writer)
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
    directory, expected = small_checkpoint(tmp_path, make_writer)
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
    directory, expected = small_checkpoint(tmp_path, make_writer)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], file="../" + data_files(directory)[0].name
    )
    write_metadata(directory, metadata, "test")
    with raises_in_dcp(BaseException, r"item 'w' has an invalid location"):
        load_into(old, directory)


def test_missing_data_file(tmp_path: Path, make_writer, io_backend: str) -> None:
    directory, old = small_checkpoint(tmp_path, make_writer)
    (file,) = data_files(directory)
    file.unlink()
    with raises_in_dcp(
        CheckpointCorruptError,
        rf"checkpoint {re.escape(str(directory))}: data file {file.name} is missing \(item '",
    ):
        load_into(old, directory, io_backend=io_backend)


def test_truncated_data_file(tmp_path: Path, make_writer, io_backend: str) -> None:
    directory, old = small_checkpoint(tmp_path, make_writer)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
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
    directory, old = small_checkpoint(tmp_path, make_writer)
    metadata = read_metadata(directory)
    assert metadata.version == CURRENT_DCP_VERSION
    assert CURRENT_DCP_VERSION == "1.0.0"
