""".metadata as files hold it: enum members pickled the way CPython 3.11.0-3.11.2 pickle them,
and a seal that makes every damaged byte visible."""

from __future__ import annotations

import enum
import io
import os
import pickle
import pickletools
from pathlib import Path

import pytest
import torch
from conftest import MARKS, assert_state_equal, clone_state, load_into, save
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    TensorProperties,
)

from dcp_datastates import CheckpointCorruptError, Engine, cli
from dcp_datastates.metadata_file import (
    read_metadata,
    sealed,
    written_by_datastates,
)

pytestmark = MARKS


def _state() -> dict:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.int64), "step": 3}


@pytest.fixture
def checkpoint(tmp_path: Path, make_writer) -> tuple[Path, dict]:
    directory = tmp_path / "ckpt"
    state = _state()
    save(state, directory, make_writer())
    return directory, clone_state(state)


def _verify(capsys: pytest.CaptureFixture[str], directory: Path) -> tuple[int, str]:
    with Engine(host_cache_size="16MiB", io_backend="threads") as engine:
        code = cli.main(["verify", "-q", str(directory)], engine=engine)
    out = capsys.readouterr()
    return code, out.out + out.err


class _As3112(pickle.Pickler):
    """Pickles as CPython 3.11.0-3.11.2 do: an enum member is ``builtins.getattr(cls, name)``
    (the ``__reduce_ex__`` of their ``Enum``)."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj._name_)
        return NotImplemented


class _Call:
    """Pickles as ``fn(*args)``: what the writer pickles, ``written_by_datastates(metadata)``,
    or whatever a hostile file may call."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _as_3112(obj: object) -> bytes:
    buf = io.BytesIO()
    _As3112(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _calls_getattr(data: bytes) -> bool:
    """Whether the pickle ``data`` fetches ``builtins.getattr``."""
    strings = [arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    return ("builtins", "getattr") in zip(strings, strings[1:], strict=False)


# -- CPython 3.11.0-3.11.2 -----------------------------------------------------------------------
@pytest.mark.parametrize("seal", ["sealed", "written before seals"])
def test_metadata_pickled_by_python_3_11_2_loads(checkpoint, capsys, seal: str) -> None:
    """Every tensor's memory format is an enum member, which 3.11.0-3.11.2 pickle as
    ``builtins.getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')``: such a ``.metadata``
    (as this package writes it there, or as it wrote it before seals) loads and verifies."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    data = _as_3112(_Call(written_by_datastates, metadata))
    assert _calls_getattr(data), "the pickle should hold builtins.getattr as 3.11.2's does"
    (directory / ".metadata").write_bytes(sealed(data) if seal == "sealed" else data)
    assert read_metadata(directory) == metadata
    assert_state_equal(load_into(expected, directory), expected)
    code, out = _verify(capsys, directory)
    assert code == 0 and out.startswith(f"OK: {directory}: 3 stored chunks"), out


_NOT_A_MODULE_GLOBAL = b"cbuiltins\ngetattr\n(ctorch\nserialization\nVload\ntR."


@pytest.mark.parametrize(("call", "refused"), [
    (lambda: _Call(getattr, TensorProperties, "__init__"),
     "TensorProperties, '__init__')"),  # the class the unpickler gives for it
    (lambda: _Call(getattr, torch.Size, "count"), "builtins.getattr(Size, 'count')"),
    (lambda: _Call(getattr, torch.float32, "__class__"), "builtins.getattr(dtype, '__class__')"),
    (lambda: _Call(getattr, _MEM_FORMAT_ENCODING, "TORCH_NO_FORMAT"),
     "builtins.getattr(_MEM_FORMAT_ENCODING, 'TORCH_NO_FORMAT')"),
    (lambda: _Call(getattr, _MEM_FORMAT_ENCODING, "__class__"),
     "builtins.getattr(_MEM_FORMAT_ENCODING, '__class__')"),
    (lambda: _Call(getattr, _MEM_FORMAT_ENCODING, "_member_map_"),
     "builtins.getattr(_MEM_FORMAT_ENCODING, '_member_map_')"),
    (lambda: _Call(getattr, _MEM_FORMAT_ENCODING, 0),
     "builtins.getattr(_MEM_FORMAT_ENCODING, 0)"),
    (lambda: _NOT_A_MODULE_GLOBAL, "torch.serialization is not allowed"),
], ids=["class", "torch.Size", "dtype", "no member", "dunder", "sunder", "not a str", "module"])
def test_getattr_of_anything_else_is_refused(checkpoint, call, refused: str) -> None:
    """Only a member of an allowed enum, by its name: no other class or object, no other
    attribute (dunder, sunder, no member), no module."""
    directory, _ = checkpoint
    obj = call()
    data = obj if isinstance(obj, bytes) else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    (directory / ".metadata").write_bytes(sealed(data))
    with pytest.raises(CheckpointCorruptError) as info:
        read_metadata(directory)
    assert str(info.value).startswith(f"{directory / '.metadata'}: cannot read checkpoint "
                                      f"metadata ("), info.value
    assert refused in str(info.value)


# -- every damaged byte is seen ------------------------------------------------------------------
def test_every_bit_flip_of_metadata_is_refused(checkpoint) -> None:
    """Each single-bit flip of ``.metadata`` is refused as it is read (by a load and by
    ``verify`` alike): none unpickles into metadata that verifies but does not load."""
    directory, expected = checkpoint
    path = directory / ".metadata"
    good = path.read_bytes()
    fd = os.open(path, os.O_WRONLY)
    try:
        for at in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[at] ^ 1 << bit]), at)
                with pytest.raises(CheckpointCorruptError, match=r"\.metadata: ") as info:
                    read_metadata(directory)
                assert str(path) in str(info.value), (at, bit)
            os.pwrite(fd, good[at:at + 1], at)
    finally:
        os.close(fd)
    assert path.read_bytes() == good
    assert_state_equal(load_into(expected, directory), expected)
