""".metadata as files hold it: enum members pickled the way CPython 3.11.0-3.11.2 pickle them,
a seal that makes every damaged byte visible, items and locations a load could not use, and a
commit whose directory sync fails."""

from __future__ import annotations

import enum
import errno
import io
import os
import pickle
import pickletools
import re
import stat
import time
from pathlib import Path

import pytest
import torch
from helpers import MARKS, assert_state_equal, clone_state, load_into, raises_in_dcp, save
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    MetadataIndex,
    TensorProperties,
)

from dcp_datastates import CheckpointCorruptError, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._format.entries import check_locations
from dcp_datastates._format.metadata_file import (
    read_metadata,
    sealed,
    write_metadata,
    written_by_datastates,
)
from dcp_datastates.errors import CheckpointError

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


def test_metadata_names_the_writers_classes_at_the_file_formats_path(checkpoint) -> None:
    """A checkpoint's ``.metadata`` names ``written_by_datastates`` and ``ItemLocation`` at the
    file format's path, ``dcp_datastates.format.metadata_file``, wherever the package keeps
    its modules (they once moved with them: every checkpoint written before the move was
    refused), and a plain ``pickle.load`` (DCP's default reader) finds them there and fails
    saying to use DataStatesReader."""
    directory, expected = checkpoint
    data = (directory / ".metadata").read_bytes()
    assert b"dcp_datastates.format.metadata_file" in data
    assert b"dcp_datastates._format" not in data
    with pytest.raises(CheckpointError, match="DataStatesReader"):
        pickle.loads(data)
    assert_state_equal(load_into(expected, directory), expected)


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
                    check_locations(directory, read_metadata(directory))
                assert str(path) in str(info.value), (at, bit)
            os.pwrite(fd, good[at:at + 1], at)
    finally:
        os.close(fd)
    assert path.read_bytes() == good
    assert_state_equal(load_into(expected, directory), expected)


def test_what_verify_accepts_loads(checkpoint, capsys) -> None:
    """A tensor's location keyed without its chunk's offsets (what one bit flip once made of
    a ``.metadata`` that verified, then failed to load with "no location"): verify refuses it
    as the load does, naming the item."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    metadata.storage_data = {MetadataIndex(i.fqn) if i.fqn == "b" else i: loc
                             for i, loc in metadata.storage_data.items()}
    write_metadata(directory, metadata, "0123456789abcdef")
    why = (f"{directory / '.metadata'}: a location names item 'b', which the metadata does not "
           f"hold")
    code, out = _verify(capsys, directory)
    assert code == 1 and f"error: {why}" in out, out
    with raises_in_dcp(CheckpointCorruptError, why):
        load_into(expected, directory)


def _drop(obj: object, name: str) -> None:
    object.__delattr__(obj, name)  # frozen dataclasses too


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses too


def _b(md) -> object:
    return next(i for i in md.storage_data if i.fqn == "b")


_MALFORMED = {
    "no state_dict_metadata": (lambda md: _drop(md, "state_dict_metadata"),
                               "no field 'state_dict_metadata'"),
    "properties None": (lambda md: _set(md.state_dict_metadata["w"], "properties", None),
                        "item 'w': properties is a NoneType, not TensorProperties"),
    "dtype a str": (lambda md: _set(md.state_dict_metadata["w"].properties, "dtype", "f4"),
                    "item 'w', properties: dtype is a str, not a torch.dtype"),
    "chunk sizes a str": (lambda md: _set(md.state_dict_metadata["w"].chunks[0], "sizes", "23"),
                          "item 'w', chunk 0: sizes is a str, not a tuple"),
    "chunk an int": (lambda md: _set(md.state_dict_metadata["w"], "chunks", [5]),
                     "item 'w', chunk 0 is a int, not a ChunkStorageMetadata"),
    "item an int": (lambda md: md.state_dict_metadata.update(w=5),
                    "item 'w' is a int, not a tensor or bytes item"),
    "fqn a Size": (lambda md: _set(_b(md), "fqn", torch.Size([1])),
                   "a location's key is MetadataIndex(fqn=torch.Size([1])"),
    "no length": (lambda md: _drop(md.storage_data[_b(md)], "length"),
                  "item 'b' has an invalid location (file '__0_"),
}


@pytest.mark.parametrize("how", list(_MALFORMED))
def test_malformed_metadata_is_refused_naming_the_file(checkpoint, capsys, make_engine,
                                                       how: str) -> None:
    """Objects of the allowed classes with fields a load cannot use (missing, of another
    kind): every command and a load refuse them, naming the file and the field, without a
    traceback."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    tamper, why = _MALFORMED[how]
    tamper(metadata)
    write_metadata(directory, metadata, "0123456789abcdef")
    engine = make_engine(host_cache_size="16MiB", io_backend="threads")
    for args in (["inspect"], ["verify", "-q"], ["export", "-q"]):
        out_dir = [str(directory.parent / "hf")] if args[0] == "export" else []
        code = cli.main([*args, str(directory), *out_dir], engine=engine)
        err = capsys.readouterr().err
        assert code == 1 and err.startswith(f"error: {directory / '.metadata'}: "), (args, err)
        assert why in err, (args, err)
    with raises_in_dcp(CheckpointCorruptError, re.escape(why)):
        load_into(expected, directory, engine=engine)


_HUGE = 10**5000  # more digits than Python prints
_SHOWN = f"<an integer of {_HUGE.bit_length()} bits>"


@pytest.mark.parametrize(("field", "value", "why"), [
    ("size", _HUGE, f"item 'w': its size [2, 3, {_SHOWN}, {_SHOWN}"),
    ("sizes", _HUGE, f"item 'w', chunk 0: its sizes [2, 3, {_SHOWN}"),
    ("offsets", _HUGE, f"item 'w', chunk 0: its offsets [0, 0, {_SHOWN}"),
    ("size", 2**62, "item 'w': its size [2, 3, 4611686018427387904, 4611686018427387904"),
], ids=["size", "chunk sizes", "chunk offsets", "size within 64 bits"])
def test_huge_sizes_in_metadata_fail_at_once(checkpoint, capsys, make_engine, field: str,
                                             value: int, why: str) -> None:
    """Sizes of 5000 digits (or each within 64 bits, but not their product), in thousands of
    dimensions: refused as ``.metadata`` is read, within a second, naming the file, the item
    and the field, before any arithmetic with them (their product alone would take hours),
    the integers too long to print shown by their size."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    w = metadata.state_dict_metadata["w"]
    (chunk,) = w.chunks
    more = {"size": 1, "offsets": 0, "sizes": 1} | {field: value}
    _set(w, "size", (*w.size, *(more["size"],) * 2000))
    for name in ("offsets", "sizes"):
        _set(chunk, name, (*getattr(chunk, name), *(more[name],) * 2000))
    write_metadata(directory, metadata, "0123456789abcdef")
    engine = make_engine(host_cache_size="16MiB", io_backend="threads")
    for args in (["inspect"], ["verify", "-q"], ["export", "-q"]):
        out_dir = [str(directory.parent / "hf")] if args[0] == "export" else []
        start = time.monotonic()
        code = cli.main([*args, str(directory), *out_dir], engine=engine)
        assert time.monotonic() - start < 1.0, args
        err = capsys.readouterr().err
        assert code == 1 and err.startswith(f"error: {directory / '.metadata'}: {why}"), err
    start = time.monotonic()
    with raises_in_dcp(CheckpointCorruptError, re.escape(why)):
        load_into(expected, directory, engine=engine)
    assert time.monotonic() - start < 1.0


# -- the commit's last sync ----------------------------------------------------------------------
def test_a_failed_directory_sync_after_the_rename_says_the_checkpoint_is_in_place(
    checkpoint,
) -> None:
    """The rename is done, so the new checkpoint is there (and loads): the error says so,
    rather than that the save failed and left the previous one."""
    directory, expected = checkpoint
    metadata = read_metadata(directory)
    metadata.storage_meta.save_id = "fedcba9876543210"

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error (injected)")
        os.fsync(fd)

    with pytest.raises(OSError) as info:
        write_metadata(directory, metadata, "fedcba9876543210", fsync=fsync)
    assert info.value.errno == errno.EIO
    assert str(info.value) == (
        f"[Errno 5] {directory}: the new checkpoint is committed (.metadata is in place and "
        f"loads; it replaced any earlier one there), but syncing the directory failed "
        f"(Input/output error (injected)): a crash of the machine before the file system "
        f"writes it back may lose it")
    assert read_metadata(directory).storage_meta.save_id == "fedcba9876543210"
    assert not list(directory.glob(".metadata.tmp.*"))
    assert_state_equal(load_into(expected, directory), expected)
