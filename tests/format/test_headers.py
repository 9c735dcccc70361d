"""A data file whose safetensors header disagrees with `.metadata`: `verify` and a load both
refuse it, naming the file, the item and what differs."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import MARKS, clone_state, data_files, load_into, raises_in_dcp, rand_tensor, save
from safetensors import safe_open

from dcp_datastates import CheckpointCorruptError
from dcp_datastates import _cli as cli
from dcp_datastates._format.metadata_file import read_metadata, write_metadata

pytestmark = MARKS


@pytest.fixture
def checkpoint(tmp_path: Path, make_writer) -> tuple[Path, Path, dict]:
    """(directory, its data file, the saved state)."""
    directory = tmp_path / "ckpt"
    state = {"w": rand_tensor((300, 257), torch.float32, seed=1),
             "b": rand_tensor((257,), torch.bfloat16, seed=2), "cfg": {"lr": 0.1}}
    expected = clone_state(state)
    save(state, directory, make_writer())
    (file,) = data_files(directory)
    return directory, file, expected


def _edit_header(file: Path, key: str, edit: Callable[[dict], None]) -> None:
    """Apply ``edit`` to the header entry ``key``, keeping the header's length (JSON allows
    the trailing spaces that pad it)."""
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header[key])
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= n
    raw[8 : 8 + n] = body.ljust(n)
    file.write_bytes(raw)


def _shift(entry: dict) -> None:
    entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]


W_BYTES = 300 * 257 * 4
EDITS = {  # edit of w's entry -> what the error says differs
    "dtype": (lambda e: e.update(dtype="I32"), "dtype 'I32' in the header, 'F32' in .metadata"),
    "shape": (lambda e: e.update(shape=[257, 300]),
              "shape [257, 300] in the header, [300, 257] in .metadata"),
    "offsets": (_shift, f"data_offsets [4, {W_BYTES + 4}] in the header, [0, {W_BYTES}] in "
                        f".metadata"),
}


def _verify(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["verify", "-q", str(directory)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("what", EDITS)
def test_edited_header_entry_is_caught(
    checkpoint, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """The data bytes are untouched (their checksums still match): only the header lies."""
    directory, file, expected = checkpoint
    edit, diff = EDITS[what]
    _edit_header(file, "w", edit)
    if what == "dtype":  # what another safetensors reader would now hand out
        with safe_open(file, "pt") as f:
            assert f.get_tensor("w").dtype == torch.int32
    code, err = _verify(directory, capsys)
    assert code == 1, err
    assert f"file {file.name}, item 'w' (chunk at [0, 0]): header does not match .metadata: " \
           f"{diff}" in err
    assert "checksum" not in err and "'b'" not in err  # only what differs is named
    for verify in (True, False):
        with raises_in_dcp(
            CheckpointCorruptError,
            rf"checkpoint {re.escape(str(directory))}, file {re.escape(file.name)}, item 'w': "
            rf"the data file's header does not match \.metadata: {re.escape(diff)}",
        ):
            load_into(expected, directory, verify_checksums=verify)


def test_renamed_header_entry_is_caught(checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    directory, file, expected = checkpoint
    raw = file.read_bytes()
    assert raw.count(b'"b":') == 1
    file.write_bytes(raw.replace(b'"b":', b'"z":'))
    code, err = _verify(directory, capsys)
    assert code == 1
    assert f"file {file.name}, item 'b' (chunk at [0]): header does not match .metadata: the " \
           f"header has no entry 'b'" in err
    assert f"file {file.name}: the header has an entry 'z' that .metadata does not list" in err
    with raises_in_dcp(CheckpointCorruptError, r"item 'b': .*the header has no entry 'b'"):
        load_into(expected, directory)


def test_file_longer_than_its_header_says(checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    directory, file, expected = checkpoint
    size = file.stat().st_size
    with file.open("ab") as f:
        f.write(b"\0" * 100)
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    why = (f"the file has {size + 100} bytes where its header ({8 + n} bytes) and the data it "
           f"describes make {size}")
    code, err = _verify(directory, capsys)
    assert code == 1 and f"file {file.name}: {why}" in err
    with raises_in_dcp(CheckpointCorruptError,
                       rf"data file {re.escape(file.name)}: {re.escape(why)}"):
        load_into(expected, directory)


def test_metadata_contradicting_itself_is_named_by_verify(
    checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """A location whose length does not fit the tensor's dtype and shape (the header is right)."""
    directory, file, _ = checkpoint
    metadata = read_metadata(directory)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    loc = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(loc, length=loc.length - 4)
    write_metadata(directory, metadata, "test")
    code, err = _verify(directory, capsys)
    assert code == 1
    assert f"{directory}: file {file.name}, item 'w' (chunk at [0, 0]): {W_BYTES - 4} bytes " \
           f"stored for a torch.float32 chunk of shape [300, 257]" in err


def _rewrite_header(file: Path, edit: Callable[[str], str]) -> None:
    """Replace the header's JSON text by ``edit(text)``, padded to the same length."""
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    body = edit(raw[8 : 8 + n].decode().rstrip(" ")).encode()
    assert len(body) <= n
    raw[8 : 8 + n] = body.ljust(n)
    file.write_bytes(raw)


def _edit_json(edit: Callable[[dict], None]) -> Callable[[str], str]:
    def apply(text: str) -> str:
        header = json.loads(text)
        edit(header)
        return json.dumps(header, separators=(",", ":"))
    return apply


def _pad_key(header: dict) -> str:
    return next(k for k in header if k.startswith("__dcp_datastates_pad_"))


def _grow_pad(header: dict) -> None:
    """The padding entry claims 4 more bytes (shape and offsets agree): it overlaps the next."""
    e = header[_pad_key(header)]
    e["shape"] = [e["shape"][0] + 4]
    e["data_offsets"] = [e["data_offsets"][0], e["data_offsets"][1] + 4]


def _pad_shape_only(header: dict) -> None:
    e = header[_pad_key(header)]
    e["shape"] = [e["shape"][0] + 1]


#: Edits that leave every entry .metadata describes equal (by Python's ==) to what it says,
#: yet make the file something safetensors refuses.
NOT_SAFETENSORS = {
    "float shape": (_edit_json(lambda h: h["w"].update(shape=[300.0, 257.0])), "'w'"),
    "NaN in the JSON": (lambda t: t.replace('"format_version":"1"', '"format_version":NaN'),
                        "NaN"),
    "__metadata__ not strings": (_edit_json(lambda h: h["__metadata__"].update(n=1)),
                                 "__metadata__"),
    "__metadata__ not an object": (_edit_json(lambda h: h.update(__metadata__=[1])),
                                   "__metadata__"),
    "padding overlaps the next entry": (_edit_json(_grow_pad), "overlap"),
    "padding shape disagrees with its bytes": (_edit_json(_pad_shape_only),
                                               "__dcp_datastates_pad_"),
}


@pytest.mark.parametrize("what", NOT_SAFETENSORS)
def test_header_that_safetensors_refuses_is_caught(
    checkpoint, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """``verify`` says OK only for data files that are valid safetensors files (the README
    promises ``safe_open`` reads them), and a load refuses the rest too."""
    directory, file, expected = checkpoint
    edit, named = NOT_SAFETENSORS[what]
    _rewrite_header(file, edit)
    with pytest.raises(Exception):  # noqa: B017 - whatever safetensors raises
        with safe_open(file, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    code, err = _verify(directory, capsys)
    assert code == 1, err
    assert f"file {file.name}" in err and named in err, err
    with raises_in_dcp(CheckpointCorruptError, rf"data file {re.escape(file.name)}: .*"
                                               rf"{re.escape(named)}"):
        load_into(expected, directory)


def test_header_with_a_duplicate_key_is_caught(
    checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two entries under one name: parsers that keep the first and parsers that keep the last
    would hand out different tensors, so the header is refused."""
    directory, file, expected = checkpoint
    _rewrite_header(file, lambda t: t.replace(
        "{", '{"w":{"dtype":"I32","shape":[300,257],"data_offsets":[0,308400]},', 1))
    code, err = _verify(directory, capsys)
    assert code == 1, err
    assert f"file {file.name}: header has the key 'w' twice" in err
    with raises_in_dcp(CheckpointCorruptError, r"header has the key 'w' twice"):
        load_into(expected, directory)


@pytest.mark.parametrize(("dims", "named"), [
    ([10**1000] * 1000, "shape [<an integer of 3322 bits>, <an integer of 3322 bits>"),
    ([2**40] * 50_000, "shape [1099511627776, 1099511627776"),
], ids=["1000 dims of 1000 digits", "50000 dims of 2**40"])
def test_header_shape_of_many_large_dims_fails_at_once(
    checkpoint, capsys: pytest.CaptureFixture[str], dims: list[int], named: str
) -> None:
    """A header of a megabyte or so whose entry has a shape of many large dimensions (their
    product alone takes minutes): ``verify`` and a load refuse it within a second, naming the
    file, the entry and its shape, before multiplying them out."""
    directory, file, expected = checkpoint
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["w"]["shape"] = dims
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    file.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    assert len(body) > 400_000
    why = f"file {file.name}: entry 'w' has {W_BYTES} data bytes where its dtype F32 and {named}"
    start = time.monotonic()
    code, err = _verify(directory, capsys)
    assert time.monotonic() - start < 1.0
    assert code == 1 and why in err, err
    start = time.monotonic()
    with raises_in_dcp(CheckpointCorruptError, re.escape(why)):
        load_into(expected, directory)
    assert time.monotonic() - start < 1.0
