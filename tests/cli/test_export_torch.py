"""``export --format torch``: a DataStatesWriter checkpoint's whole state dict in one
``torch.save`` file that ``torch.load(weights_only=True)`` loads, written through a temporary
name; checksums checked as it reads."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import MARKS, assert_state_equal, rand_tensor

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._format.metadata_file import read_metadata

pytestmark = MARKS


def _state() -> dict:
    """Tensors of several dtypes (some safetensors cannot hold), nested dicts and lists, and
    non-tensor items."""
    return {
        "model": {
            "w": rand_tensor((64, 32), torch.float32, 1),
            "b": rand_tensor((32,), torch.bfloat16, 2),
            "blocks": [{"h": rand_tensor((4, 4), torch.float16, 3)},
                       {"h": rand_tensor((4, 4), torch.float16, 4)}],
        },
        "opt": {"c": rand_tensor((3, 2), torch.complex128, 5),
                "f8": rand_tensor((8,), torch.float8_e4m3fn, 6),
                "mask": rand_tensor((7,), torch.bool, 7), "ids": torch.arange(10)},
        "step": 7,
        "lr": 0.125,
        "name": "run-3",
        "blob": b"\x00\x01 bytes",
        "milestones": [10, 20, 30],
        "none": None,
    }


def _save(state: dict, path: Path) -> Path:
    with Engine(host_cache_size="16MiB", io_backend="threads") as engine:
        dcp.save(state, checkpoint_id=path, storage_writer=DataStatesWriter(engine=engine),
                 no_dist=True)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(_state(), tmp_path_factory.mktemp("ckpt") / "step_7")


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["export", "--format", "torch", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_torch_round_trips_every_item(ckpt: Path, tmp_path: Path) -> None:
    """Through ``python -m dcp_datastates``: nested as saved, bit for bit, non-tensors too."""
    out = tmp_path / "out" / "model.pt"
    res = subprocess.run([sys.executable, "-m", "dcp_datastates", "export", "--format", "torch",
                          str(ckpt), str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    tensor_bytes = sum(t.nbytes for t in [*_state()["model"].values(), *_state()["opt"].values()]
                       if isinstance(t, torch.Tensor)) + 2 * 4 * 4 * 2
    assert res.stdout == (f"exported 14 items (8 tensors, {tensor_bytes} bytes of tensor data, "
                          f"{tensor_bytes / 1024:.2f} KiB) to {out}\n")
    assert res.stderr == ""
    assert_state_equal(torch.load(out, weights_only=True), _state())
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.pt"]


def test_an_existing_file_is_replaced_through_a_rename(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the safetensors export replaces its files: a hard link to the old file keeps its
    bytes, and no temporary file is left."""
    out = tmp_path / "model.pt"
    (tmp_path / "mine").write_bytes(b"keep me")
    os.link(tmp_path / "mine", out)
    code, _, err = _export(capsys, str(ckpt), str(out))
    assert code == 0, err
    assert (tmp_path / "mine").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.pt"]
    assert_state_equal(torch.load(out, weights_only=True), _state())


@pytest.mark.parametrize("what", ["a directory", "inside the checkpoint", "with --prefix"])
def test_outputs_it_does_not_write(ckpt: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str], what: str) -> None:
    before = sorted(p.name for p in ckpt.iterdir())
    out = {"a directory": tmp_path, "inside the checkpoint": ckpt / "model.pt",
           "with --prefix": tmp_path / "model.pt"}[what]
    extra = ["--prefix", "model."] if what == "with --prefix" else []
    code, _, err = _export(capsys, *extra, str(ckpt), str(out))
    assert code == 1
    assert err == {
        "a directory": f"error: output file {out} is a directory: give a file name, e.g. "
                       f"{out / 'model.pt'}\n",
        "inside the checkpoint": f"error: output file {out} is inside the checkpoint directory "
                                 f"{ckpt}: export elsewhere\n",
        "with --prefix": "error: --prefix and --max-shard-size apply to --format safetensors "
                         "only: --format torch writes the whole state dict to one file\n",
    }[what]
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert not (tmp_path / "model.pt").exists()


def test_a_damaged_chunk_is_refused(ckpt: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Checksums are checked as it reads: nothing is written; --no-verify exports as stored."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    loc = next(v for k, v in read_metadata(bad).storage_data.items() if k.fqn == "model.w")
    raw = bytearray((bad / loc.file).read_bytes())
    raw[loc.offset + 100] ^= 0x01
    (bad / loc.file).write_bytes(raw)
    out = tmp_path / "out" / "model.pt"
    code, _, err = _export(capsys, str(bad), str(out))
    assert code == 1
    assert f"file {loc.file}, item 'model.w'" in err and "checksum mismatch" in err, err
    assert not out.parent.exists()
    code, _, err = _export(capsys, "--no-verify", str(bad), str(out))
    assert code == 0, err
    got = torch.load(out, weights_only=True)
    assert not torch.equal(got["model"]["w"].view(torch.uint8),
                           _state()["model"]["w"].view(torch.uint8))
    assert_state_equal(got["opt"], _state()["opt"])


class Thing:
    """A non-tensor item that ``torch.load(weights_only=True)`` does not allow."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Thing) and other.value == self.value


class Planted:
    """A bytes item whose pickle, run, would make the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _refused_warning(fqn: str, ckpt: Path, what: str) -> str:
    return (f"warning: item '{fqn}' of {ckpt}: torch.load(weights_only=True) refuses its "
            f"pickle (WeightsUnpickler error: Unsupported global: GLOBAL {what} was not an "
            f"allowed global by default): exported as its bytes, not run")


def test_a_crafted_bytes_item_is_exported_as_its_bytes_never_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose bytes items' pickles run code (a planted ``exec``) or need a class
    (``Thing``): nothing runs; each is exported as its pickle's bytes, named in a warning;
    tensors and the items ``weights_only`` allows are exported as saved, and the file loads
    with ``torch.load(weights_only=True)``."""
    marker = tmp_path / "pwned"
    state = {"w": rand_tensor((5,), torch.float32, 9), "step": 3, "evil": Planted(marker),
             "cfg": {"thing": Thing(3)}}
    w = state["w"].clone()
    ckpt = _save(state, tmp_path / "ckpt")
    stored = {k.fqn: (ckpt / v.file).read_bytes()[v.offset:v.offset + v.length]
              for k, v in read_metadata(ckpt).storage_data.items()}
    out = tmp_path / "model.pt"
    code, stdout, err = _export(capsys, str(ckpt), str(out))
    assert code == 0, err
    assert not marker.exists(), "the export ran the checkpoint's pickled code"
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(_refused_warning("cfg.thing", ckpt, f"{__name__}.Thing")), err
    assert lines[1].startswith(_refused_warning("evil", ckpt, "exec")), err
    assert stdout.startswith("exported 4 items (1 tensors")
    got = torch.load(out, weights_only=True)
    assert not marker.exists()
    assert sorted(got) == ["cfg", "evil", "step", "w"] and got["step"] == 3
    assert torch.equal(got["w"], w)
    assert got["evil"] == stored["evil"] and got["cfg"]["thing"] == stored["cfg.thing"]
    assert torch.load(io.BytesIO(got["cfg"]["thing"]), weights_only=False) == Thing(3)
