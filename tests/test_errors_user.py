"""Errors a new user meets, each saying what to do: an option that moved to the engine, a
misspelt option, a state dict of another model, DCP's default reader on our checkpoint, an engine
passed where the path goes, bad arguments of the engine and of O_DIRECT, an engine used after
``close()``."""

from __future__ import annotations

import inspect
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    blank_like,
    clone_state,
    load_into,
    raises_in_dcp,
    save,
    small_checkpoint,
    small_state,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_datastates import (
    CheckpointError,
    CheckpointManager,
    DataStatesReader,
    DataStatesWriter,
    Engine,
)
from dcp_datastates._jobs.save import new_save_job
from dcp_datastates.errors import StateDictMismatchError

HINT = "storage_reader=dcp_datastates.DataStatesReader()"

pytestmark = MARKS


def _make(cls: type, tmp_path: Path, **kw: object) -> object:
    return cls(memory_dir=tmp_path / "memory", **kw) if cls is CheckpointManager else cls(
        tmp_path, **kw)


@pytest.mark.parametrize("cls", [DataStatesWriter, DataStatesReader, CheckpointManager])
@pytest.mark.parametrize("option", ["host_cache_size", "io_workers", "io_backend"])
def test_an_option_of_the_engine_names_where_it_went(tmp_path: Path, cls: type,
                                                     option: str) -> None:
    with pytest.raises(TypeError) as info:
        _make(cls, tmp_path, **{option: 4})
    assert str(info.value).startswith(
        f"{cls.__name__}() got {option}=, an option of the engine: pass "
        f"engine=Engine({option}=...)")
    assert not (tmp_path / "memory").exists()  # refused before anything was made


#: What each of FileSystemWriter's options says in its place.
FILESYSTEM_OPTIONS = {
    "thread_count": "the engine's I/O threads write: pass engine=Engine(io_workers=...)",
    "sync_files": "not needed, every data file and .metadata is fsynced before the checkpoint "
                  "is committed",
    "single_file_per_rank": "not needed, each rank writes one data file",
    "per_thread_copy_ahead": "not needed, a save is snapshotted into the engine's host cache "
                             "(sized by Engine(host_cache_size=...))",
    "cache_staged_state_dict": "not needed, the engine's host cache is made once and reused by "
                               "every save",
    "serialization_format": "not needed, data files are safetensors",
}


def test_every_option_of_filesystem_writer_is_answered() -> None:
    """Each public keyword of DCP's FileSystemWriter is the writer's own or says what
    replaces it (below)."""
    theirs = {p for p in inspect.signature(FileSystemWriter).parameters
              if p != "path" and not p.startswith("_")}
    assert theirs == set(FILESYSTEM_OPTIONS) | {"overwrite"}
    assert "overwrite" in inspect.signature(DataStatesWriter).parameters


@pytest.mark.parametrize("cls", [DataStatesWriter, DataStatesReader])
@pytest.mark.parametrize("option", sorted(FILESYSTEM_OPTIONS))
def test_an_option_of_filesystem_writer_says_what_replaces_it(tmp_path: Path, cls: type,
                                                              option: str) -> None:
    with pytest.raises(TypeError) as info:
        cls(tmp_path, **{option: 1})
    assert str(info.value).startswith(
        f"{cls.__name__}() got {option}=, an option of DCP's FileSystemWriter: "
        f"{FILESYSTEM_OPTIONS[option]}")


@pytest.mark.parametrize(("cls", "typo", "meant"), [
    (DataStatesWriter, "overwite", "overwrite"),
    (DataStatesReader, "verify_checksum", "verify_checksums"),
    (CheckpointManager, "max_overhed", "max_overhead"),
    (CheckpointManager, "keep_memroy", "keep_memory"),
    (Engine, "io_worker", "io_workers"),
])
def test_a_misspelt_option_gets_a_suggestion(tmp_path: Path, cls: type, typo: str,
                                             meant: str) -> None:
    with pytest.raises(TypeError, match=re.escape(
            f"{cls.__name__}() got an unexpected keyword argument {typo!r}; "
            f"did you mean {meant!r}?")):
        cls(**{typo: 1}) if cls is Engine else _make(cls, tmp_path, **{typo: 1})


def test_an_unknown_option_lists_the_real_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=re.escape(
            "DataStatesReader() got an unexpected keyword argument 'zzz'; it takes "
            "['path', 'engine', 'verify_checksums', 'direct_io', 'rank_part']")):
        DataStatesReader(tmp_path, zzz=1)


def test_other_type_errors_and_the_signature_stay(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="positional"):
        DataStatesWriter(tmp_path, None)  # engine is keyword-only: Python's own error
    assert list(inspect.signature(DataStatesWriter).parameters) == [
        "path", "engine", "overwrite", "direct_io"]


def _model(layers: int, width: int) -> dict:
    return {"model": {f"layer{i}.weight": torch.full((width, 4), float(i))
                      for i in range(layers)}, "step": 7}


def _saved(tmp_path: Path, make_writer) -> tuple[Path, dict]:
    state = _model(8, 4)
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", storage_writer=make_writer(),
             no_dist=True)
    return tmp_path / "ckpt", state


def test_a_state_dict_of_another_model_names_what_differs(tmp_path: Path, make_writer) -> None:
    directory, _ = _saved(tmp_path, make_writer)
    other = _model(3, 6)  # wider layers, fewer of them
    other["model"] |= {f"head{i}.bias": torch.zeros(2, dtype=torch.bfloat16) for i in range(4)}
    expected = "\n  ".join([
        f"the state dict does not match checkpoint {directory}: 7 of its 8 items differ",
        *(f"'model.layer{i}.weight': the checkpoint holds shape (4, 4) torch.float32, the "
          f"state dict expects shape (6, 4) torch.float32" for i in range(3)),
        *(f"'model.head{i}.bias': not in the checkpoint (the state dict expects shape (2,) "
          f"torch.bfloat16)" for i in range(2)),
        "... and 2 more",
        "the checkpoint holds 5 items the state dict does not ask for: 'model.layer3.weight', "
        "'model.layer4.weight', 'model.layer5.weight', 'model.layer6.weight', "
        "'model.layer7.weight' (a checkpoint of another model?)",
    ])
    with raises_in_dcp(StateDictMismatchError, "^" + re.escape(expected) + "$"):
        dcp.load(other, storage_reader=DataStatesReader(directory), no_dist=True)


def test_a_partial_load_still_skips_missing_items(tmp_path: Path, make_writer) -> None:
    directory, state = _saved(tmp_path, make_writer)
    out = blank_like(state)
    out["extra"] = torch.ones(3)
    dcp.load(out, storage_reader=DataStatesReader(directory), no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert_state_equal(out["model"], state["model"])
    assert torch.equal(out["extra"], torch.ones(3))


def test_the_manager_names_what_differs(tmp_path: Path) -> None:
    with Engine(host_cache_size="4MiB", io_backend="threads") as engine, CheckpointManager(
            memory_dir=tmp_path / "memory", engine=engine) as manager:
        manager.save(1, _model(2, 4))
        manager.wait()
        with pytest.raises(StateDictMismatchError, match=re.escape(
                f"checkpoint {tmp_path / 'memory' / 'step_1'}: 1 of its 2 items differ\n  "
                "'model.layer0.weight': the checkpoint holds shape (4, 4) torch.float32, the "
                "state dict expects shape (5, 4) torch.float32\n  the checkpoint holds 1 items "
                "the state dict does not ask for: 'model.layer1.weight'")):
            manager.load(_model(1, 5))


def test_dcp_default_reader_raises_use_datastates_reader(tmp_path: Path, make_writer) -> None:
    """On every torch version: those that only log an error of ``read_metadata`` (then raise
    a bare "metadata is None") get a stand-in whose first use raises the error."""
    directory, state = _saved(tmp_path, make_writer)
    with raises_in_dcp(CheckpointError, re.escape(HINT)):
        dcp.load(blank_like(state), checkpoint_id=directory, no_dist=True)
    reader = FileSystemReader(directory)
    metadata = reader.read_metadata()  # what an older torch keeps after logging nothing
    with pytest.raises(CheckpointError, match=re.escape(HINT)):
        reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(blank_like(state), metadata, True)
    with pytest.raises(CheckpointError, match=re.escape(HINT)):
        planner.create_local_plan()
    assert HINT in repr(metadata)


URL_ERROR = ("checkpoint directory 's3://bucket/ckpt' is a URL: dcp_datastates saves to and "
             "loads from a file system path (local or mounted)")


def test_a_url_is_refused_not_written_as_a_local_directory(
    tmp_path: Path, make_writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint_id="s3://bucket/ckpt"`` once saved into ``./s3:/bucket/ckpt``: the writer
    and the reader refuse URLs, saying why, whichever way they are given; nothing is
    written, and the snapshot an async save staged is released."""
    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/ckpt"
    state = {"w": torch.arange(4.0)}
    writer = make_writer()
    with raises_in_dcp(ValueError, re.escape(URL_ERROR)):
        dcp.save(state, checkpoint_id=url, storage_writer=writer, no_dist=True)
    response = dcp.async_save(state, checkpoint_id=url, storage_writer=make_writer(),
                              no_dist=True)
    with raises_in_dcp(ValueError, re.escape(URL_ERROR)):
        response.upload_completion.result(timeout=60)
    assert writer.engine.live_leases() == 0
    with raises_in_dcp(ValueError, re.escape(URL_ERROR)):
        dcp.load(blank_like(state), checkpoint_id=url, storage_reader=DataStatesReader(),
                 no_dist=True)
    for cls in (DataStatesWriter, DataStatesReader):
        with pytest.raises(ValueError, match=re.escape(URL_ERROR)):
            cls(url)
        assert not cls.validate_checkpoint_id(url)
    assert DataStatesWriter.validate_checkpoint_id(str(tmp_path / "s3"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cls", [DataStatesWriter, DataStatesReader, CheckpointManager])
def test_an_engine_passed_positionally_says_engine_equals(cls: type, engine: Engine) -> None:
    """``DataStatesWriter(engine)``: the engine went where the path goes; the error says to
    pass it as ``engine=`` (not "expected str, bytes or os.PathLike object")."""
    with pytest.raises(TypeError, match=r"engine=engine"):
        cls(engine)


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
    directory, old = small_checkpoint(tmp_path, make_writer)
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
            save(small_state(), path, make_writer(direct_io=True))
        assert not (path / ".metadata").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- the engine's lifetime -----------------------------------------------------------------------
def test_engine_close_frees_its_memory_and_refuses_further_use(
    tmp_path: Path, make_engine
) -> None:
    engine = make_engine(host_cache_size="1MiB", io_backend="threads")
    state = small_state()
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
        _ = engine.arenas.bounce
    with pytest.raises(RuntimeError, match=closed):
        new_save_job(engine)
    with raises_in_dcp(RuntimeError, closed):
        save(state, tmp_path / "b", DataStatesWriter(engine=engine))
    assert not (tmp_path / "b" / ".metadata").exists()
    assert engine.cache_bytes() == 0
    # The checkpoint saved before the close is whole.
    assert_state_equal(load_into(expected, tmp_path / "a", io_backend="threads"), expected)


def test_load_on_a_closed_engine_says_so(tmp_path: Path, make_writer, make_engine) -> None:
    directory, old = small_checkpoint(tmp_path, make_writer)
    engine = make_engine(io_backend="threads")
    engine.close()
    with raises_in_dcp(RuntimeError, r"Engine is closed"):
        load_into(old, directory, engine=engine)
