"""Checkpoints of DCP's own FileSystemWriter (a run to resume): DataStatesReader loads them
through DCP's FileSystemReader, bit for bit, their ``.metadata`` read without running pickled
code; the command line lists and exports them, and says what to do where it cannot."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import MARKS, assert_state_equal, blank_like, clone_state, raises_in_dcp, rand_tensor
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import CheckpointCorruptError, CheckpointError, DataStatesReader
from dcp_datastates import _cli as cli
from dcp_datastates._cli.inspect import inspect_data
from dcp_datastates._format.metadata_file import FileSystemWriterLocation, read_metadata
from dcp_datastates.errors import StateDictMismatchError

pytestmark = MARKS


def _state() -> dict:
    """Tensors of random bit patterns (NaN payloads too), nested dicts and lists, non-tensors."""
    return {
        "w": rand_tensor((64, 33), torch.float32, 1),
        "half": rand_tensor((17,), torch.float16, 2),
        "model": {
            "b": rand_tensor((33,), torch.bfloat16, 3),
            "mask": rand_tensor((5, 2), torch.bool, 4),
            "layers": [rand_tensor((3, 3), torch.int8, 5), rand_tensor((2,), torch.complex64, 6)],
        },
        "step": 1234,
        "blob": b"\x00\xff raw bytes",
        "cfg": {"lr": 0.25, "name": "run-7"},
    }


@pytest.fixture
def theirs(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint of DCP's FileSystemWriter, and the state it holds."""
    directory = tmp_path / "fsw"
    state = _state()
    expected = clone_state(state)
    dcp.save(state, storage_writer=FileSystemWriter(directory), no_dist=True)
    assert [p.name for p in directory.glob("*.distcp")] == ["__0_0.distcp"]
    return directory, expected


def test_datastates_reader_loads_it_bit_exact(theirs: tuple[Path, dict],
                                              logs: pytest.LogCaptureFixture) -> None:
    directory, expected = theirs
    loaded = blank_like(expected)
    reader = DataStatesReader()
    dcp.load(loaded, checkpoint_id=directory, storage_reader=reader, no_dist=True)
    assert_state_equal(loaded, expected)
    said = [r.getMessage() for r in logs.records]
    assert (f"dcp_datastates: {directory} is a DCP FileSystemWriter checkpoint: reading it with "
            f"DCP's FileSystemReader") in said[0], said
    stats = reader.last_stats()
    assert stats is not None and (stats.backend, stats.verified) == ("FileSystemReader", False)
    md = read_metadata(directory, filesystem_writer=True)
    assert stats.bytes_read == sum(loc.length for loc in md.storage_data.values())


def test_a_state_dict_of_another_model_is_named(theirs: tuple[Path, dict]) -> None:
    directory, expected = theirs
    other = blank_like(expected) | {"w": torch.zeros(3, 3), "extra": torch.zeros(1)}
    with raises_in_dcp(StateDictMismatchError,
                       r"2 of its 11 items differ(?=(.|\n)*'w': the checkpoint holds shape "
                       r"\(64, 33\))(?=(.|\n)*'extra': not in the checkpoint)"):
        dcp.load(other, checkpoint_id=directory, storage_reader=DataStatesReader(),
                 no_dist=True)


class _Opens:
    """Unpickles by creating the file ``path`` (pickled code that runs where it is loaded)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def test_its_metadata_is_read_without_running_pickles(theirs: tuple[Path, dict],
                                                      tmp_path: Path) -> None:
    """A ``.metadata`` as FileSystemWriter writes it (a plain pickle) carrying code: refused,
    naming what is not allowed, and the code never ran (a plain ``pickle.load`` runs it)."""
    directory, expected = theirs
    md = read_metadata(directory, filesystem_writer=True)
    marker = tmp_path / "ran"
    md.storage_meta.modules = [_Opens(marker)]
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with raises_in_dcp(CheckpointCorruptError, r"(io|builtins)\.open is not allowed in checkpoint"):
        dcp.load(blank_like(expected), checkpoint_id=directory,
                 storage_reader=DataStatesReader(), no_dist=True)
    assert not marker.exists()
    with (directory / ".metadata").open("rb") as f:
        pickle.load(f)
    assert marker.exists()  # the payload is live


def test_a_location_outside_the_directory_is_refused(theirs: tuple[Path, dict]) -> None:
    directory, expected = theirs
    md = read_metadata(directory, filesystem_writer=True)
    index = next(i for i in md.storage_data if i.fqn == "model.b")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index],
                                                 relative_path="../__0_0.distcp")
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    with raises_in_dcp(CheckpointCorruptError,
                       r"\.metadata: item 'model\.b' has an invalid location \(file "
                       r"'\.\./__0_0\.distcp', offset"):
        dcp.load(blank_like(expected), checkpoint_id=directory,
                 storage_reader=DataStatesReader(), no_dist=True)


def test_steps_that_need_a_datastates_checkpoint_refuse_it(theirs: tuple[Path, dict]) -> None:
    """``read_metadata`` (as the copy to a durable tier calls it) refuses it, saying what it
    is and what loads it; asked to, it reads DCP's locations."""
    directory, _ = theirs
    with pytest.raises(CheckpointError, match=(
            r"is a DCP FileSystemWriter checkpoint \(dcp\.save without a storage_writer\), not "
            r"a DataStatesWriter one: .* DataStatesReader loads it")):
        read_metadata(directory)
    md = read_metadata(directory, filesystem_writer=True)
    assert {type(loc) for loc in md.storage_data.values()} == {FileSystemWriterLocation}
    assert md.storage_meta.checkpoint_id == str(directory)  # a PosixPath, as a string


def test_per_rank_metadata_is_named(tmp_path: Path) -> None:
    """``dcp.save(use_collectives=False)`` leaves ``__0.metadata``, no ``.metadata``."""
    directory = tmp_path / "local"
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(directory), no_dist=True,
             use_collectives=False)
    with raises_in_dcp(FileNotFoundError,
                       rf"{directory} holds a DCP checkpoint of per-rank metadata \(__0\.metadata"
                       rf": dcp\.save\(use_collectives=False\)\) .* load it with torch\.distributed"
                       rf"\.checkpoint\.FileSystemReader"):
        dcp.load({"w": torch.zeros(3)}, checkpoint_id=directory,
                 storage_reader=DataStatesReader(), no_dist=True)


# -- the command line ----------------------------------------------------------------------------
def test_inspect_lists_it(theirs: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = theirs
    data = inspect_data(directory)
    assert data["writer"] == "FileSystemWriter"
    items = {i["fqn"]: i for i in data["items"]}
    assert set(items) == {"w", "half", "model.b", "model.mask", "model.layers.0",
                          "model.layers.1", "step", "blob", "cfg.lr", "cfg.name"}
    assert items["w"] | {"bytes": 0} == {"fqn": "w", "kind": "tensor", "dtype": "float32",
                                         "shape": [64, 33], "chunks": 1, "bytes": 0,
                                         "files": ["__0_0.distcp"]}
    size = (directory / "__0_0.distcp").stat().st_size
    assert data["files"] == [{"name": "__0_0.distcp", "size": size, "problem": None,
                              "items": 10}]
    assert cli.main(["inspect", str(directory)]) == 0
    assert "a checkpoint of DCP's FileSystemWriter" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "why"), [
    (["verify"], "it holds no checksums or headers to verify; `export --format torch` reads"),
    (["export"], "the safetensors export reads DataStatesWriter checkpoints; `export --format "
                 "torch` exports this one"),
])
def test_verify_and_the_safetensors_export_say_what_to_do(
    theirs: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    args: list[str], why: str
) -> None:
    directory, _ = theirs
    out = tmp_path / "hf"
    code = cli.main([*args, "-q", str(directory), *([str(out)] if args == ["export"] else [])])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: {directory} is a DCP FileSystemWriter checkpoint (dcp.save "
                          f"without a storage_writer), not a DataStatesWriter one: {why}"), err
    assert "Traceback" not in err and not out.exists()


def test_export_torch_writes_it_out(theirs: tuple[Path, dict], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    directory, expected = theirs
    out = tmp_path / "model.pt"
    assert cli.main(["export", "--format", "torch", str(directory), str(out)]) == 0, \
        capsys.readouterr().err
    assert_state_equal(torch.load(out, weights_only=True), expected)


# -- several ranks, several files: loaded whole in one process -----------------------------------
def _full() -> dict[str, torch.Tensor]:
    return {"rows": rand_tensor((7, 5), torch.float32, 11),
            "cols": rand_tensor((4, 6), torch.bfloat16, 12)}


def _rank_save(rank: int, store_path: str, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = _full()
        state = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                 "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]), "step": 9}
        dcp.save(state, storage_writer=FileSystemWriter(ckpt))
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_of_two_ranks_loads_whole(tmp_path: Path) -> None:
    """Chunks in two data files, each tensor stitched back (resharded) by DCP's planner."""
    directory = tmp_path / "sharded"
    mp.spawn(_rank_save, args=(str(tmp_path / "store"), str(directory)), nprocs=2, join=True)
    assert sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp",
                                                                  "__1_0.distcp"]
    expected = _full() | {"step": 9}
    loaded = blank_like(expected)
    dcp.load(loaded, checkpoint_id=directory, storage_reader=DataStatesReader(), no_dist=True)
    assert_state_equal(loaded, expected)
