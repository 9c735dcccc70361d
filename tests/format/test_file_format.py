"""The data file's layout (``plan_layout``: aligned large tensors, padding, the safetensors
header) and the checks of a header read back (``read_header``)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from dcp_datastates import CheckpointCorruptError
from dcp_datastates._format.data_file import (
    LARGE_ITEM_BYTES,
    PAD_PREFIX,
    ItemSpec,
    plan_layout,
    read_header,
)

PAGE = 4096


# -- file layout ---------------------------------------------------------------------------------
def _spec(name: str, dtype: torch.dtype | None, n: int) -> ItemSpec:
    size = 1 if dtype is None else torch.empty((), dtype=dtype).element_size()
    return ItemSpec(name, dtype, (n,), n * size)


def test_plan_layout_alignment() -> None:
    items = [
        _spec("small_u8", torch.uint8, 3),
        _spec("large_odd", torch.float32, LARGE_ITEM_BYTES // 4 + 1),
        _spec("small_f64", torch.float64, 5),
        _spec("bytes", None, 77),
        _spec("large_even", torch.bfloat16, LARGE_ITEM_BYTES),
        _spec("small_f16", torch.float16, 3),
        _spec("empty", torch.int32, 0),
    ]
    layout = plan_layout(items)
    assert layout.data_start % PAGE == 0
    where = {p.spec.name: p for p in layout.placements if p.spec is not None}
    assert set(where) == {i.name for i in items}
    for name in ("large_odd", "large_even"):
        assert (layout.data_start + where[name].begin) % PAGE == 0, name
    for p in layout.placements:  # small items naturally aligned
        if p.spec is not None and p.spec.dtype is not None:
            assert p.begin % torch.empty((), dtype=p.spec.dtype).element_size() == 0
    # Bytes items come last, starting on a block of their own (their size is known late).
    assert (layout.data_start + where["bytes"].begin) % PAGE == 0
    assert all(p.end <= where["bytes"].begin for n, p in where.items() if n != "bytes")
    # Contiguous tiling, padding entries only after large items and before the bytes items.
    cursor = 0
    for k, p in enumerate(layout.placements):
        assert p.begin == cursor
        cursor = p.end
        if p.spec is None:
            before = layout.placements[k - 1].spec
            after = layout.placements[k + 1].spec
            assert before.nbytes >= LARGE_ITEM_BYTES or after.dtype is None, (before, after)
    assert layout.file_size == layout.data_start + cursor
    # The header is what safetensors reads.
    (n,) = struct.unpack("<Q", layout.header[:8])
    header = json.loads(layout.header[8 : 8 + n])
    pads = [k for k in header if k.startswith(PAD_PREFIX)]
    assert len(pads) == 2 and all(header[k]["dtype"] == "U8" for k in pads)
    assert header["large_odd"] == {
        "dtype": "F32", "shape": [LARGE_ITEM_BYTES // 4 + 1],
        "data_offsets": [where["large_odd"].begin, where["large_odd"].end],
    }
    assert json.loads(header["__metadata__"]["raw_items"]) == {"bytes": "pickle"}


def test_plan_layout_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match=r"share the file entry name\(s\) \['x'\]"):
        plan_layout([_spec("x", torch.uint8, 1), _spec("x", torch.int8, 2)])


# -- read_header ---------------------------------------------------------------------------------
PATH = "/ckpt/__0_abc.safetensors"


def _file(header: object, data_len: int = 16, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + bytes(data_len)


def test_read_header_accepts_a_layout() -> None:
    layout = plan_layout([_spec("a", torch.float32, 10), _spec("b", torch.int8, 3)])
    content = layout.header + bytes(layout.file_size - layout.data_start)
    start, header = read_header(content, PATH, len(content))
    assert start == layout.data_start
    assert header["a"]["data_offsets"] == [0, 40]


def test_read_header_rejects_huge_length() -> None:
    content = struct.pack("<Q", 2**60) + b"{}"
    with pytest.raises(CheckpointCorruptError, match=rf"{PATH}: header length {2**60} is imposs"):
        read_header(content, PATH, len(content))


def test_read_header_rejects_length_past_the_file() -> None:
    content = _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})
    with pytest.raises(CheckpointCorruptError, match=rf"{PATH}: header length \d+ is impossible"):
        read_header(content[:20], PATH, 20)


def test_read_header_rejects_offsets_past_the_end() -> None:
    content = _file({"a": {"dtype": "U8", "shape": [17], "data_offsets": [0, 17]}}, data_len=16)
    with pytest.raises(
        CheckpointCorruptError,
        match=rf"{PATH} is truncated: item 'a' needs bytes 70\.\.87, the file has 86",
    ):
        read_header(content, PATH, len(content))


@pytest.mark.parametrize("offsets", [[5, 2], [-1, 3], [0], "0-4", [0, 1.5]])
def test_read_header_rejects_bad_offsets(offsets) -> None:
    content = _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": offsets}})
    with pytest.raises(CheckpointCorruptError, match=rf"{PATH}: entry 'a' has data offsets"):
        read_header(content, PATH, len(content))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": ', "header is not valid UTF-8 JSON"),
        (b'{"a": "\xff\xfe"}', "header is not valid UTF-8 JSON"),
        (b"[1, 2, 3]", "header is not a JSON object"),
    ],
)
def test_read_header_rejects_bad_json(raw: bytes, message: str) -> None:
    content = _file(None, raw=raw)
    with pytest.raises(CheckpointCorruptError, match=rf"{PATH}: {message}"):
        read_header(content, PATH, len(content))


def test_read_header_rejects_short_file() -> None:
    with pytest.raises(CheckpointCorruptError, match=rf"{PATH}: file too short \(5 bytes\)"):
        read_header(b"\x01\x02\x03\x04\x05", PATH, 5)
