"""Unit tests: the host cache allocator, the data-file layout and header checks, size strings."""

from __future__ import annotations

import json
import re
import struct
import threading
import time

import pytest
import torch
from conftest import MARKS

from dcp_datastates import CheckpointCorruptError, parse_size
from dcp_datastates.file_format import (
    LARGE_ITEM_BYTES,
    PAD_PREFIX,
    ItemSpec,
    plan_layout,
    read_header,
)
from dcp_datastates.host_cache import HostCache
from dcp_datastates.sizes import format_size

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096

pytestmark = MARKS


@pytest.fixture(scope="module")
def cache() -> HostCache:
    return HostCache(1 * MiB)


@pytest.fixture
def pool(cache: HostCache):
    """The snapshot pool, checked to be empty before and after each test."""
    assert cache.snapshots.used == 0
    yield cache.snapshots
    assert cache.snapshots.used == 0, "a test leaked regions"


# -- HostCache / Pool ----------------------------------------------------------------------------
def test_cache_is_page_aligned_and_split_in_two_pools(cache: HostCache) -> None:
    assert cache.addr % PAGE == 0
    assert cache.nbytes == 1 * MiB
    assert cache.snapshots.capacity + cache.bounce.capacity == cache.nbytes
    assert 0 < cache.bounce.capacity < cache.snapshots.capacity
    assert cache.bounce.capacity % PAGE == 0 and cache.snapshots.capacity % PAGE == 0


@pytest.mark.parametrize("size", [0, 1, 100, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17])
def test_regions_are_aligned_and_rounded(pool, size: int) -> None:
    regions = [pool.try_allocate(size) for _ in range(3)]
    try:
        for r in regions:
            assert r is not None
            assert r.addr % PAGE == 0 and r.offset % PAGE == 0
            assert r.nbytes == size
            assert r.capacity == max(PAGE, -(-size // PAGE) * PAGE)
            assert r.as_tensor().numel() == size
            if size:
                assert r.as_tensor().data_ptr() == r.addr
        spans = sorted((r.offset, r.offset + r.capacity) for r in regions)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlap"
        assert pool.used == sum(r.capacity for r in regions)
    finally:
        for r in regions:
            r.release()


def test_release_is_idempotent(pool) -> None:
    r = pool.allocate(10)
    r.release()
    r.release()
    assert pool.used == 0 and r.released


def test_zero_tail_clears_only_the_tail(pool, cache: HostCache) -> None:
    r = pool.allocate(100)
    try:
        r.as_tensor(r.capacity).fill_(0xFF)
        r.zero_tail()
        mem = r.as_tensor(r.capacity)
        assert (mem[:100] == 0xFF).all()
        assert (mem[100:] == 0).all()
    finally:
        r.release()


def test_free_blocks_coalesce(pool) -> None:
    quarter = pool.capacity // 4
    assert quarter % PAGE == 0
    a, b, c, d = (pool.allocate(quarter) for _ in range(4))
    assert pool.try_allocate(1) is None  # full
    a.release()
    c.release()
    # Two separate free quarters: half the pool does not fit yet.
    assert pool.try_allocate(2 * quarter) is None
    b.release()  # merges with both neighbours: a + b + c is one free block
    abc = pool.try_allocate(3 * quarter)
    assert abc is not None and abc.offset == a.offset
    abc.release()
    d.release()
    whole = pool.try_allocate(pool.capacity)  # everything back in one block
    assert whole is not None and whole.offset == a.offset
    whole.release()


def test_coalesce_in_reverse_release_order(pool) -> None:
    regions = [pool.allocate(PAGE * 3) for _ in range(5)]
    for r in reversed(regions):
        r.release()
    whole = pool.try_allocate(pool.capacity)
    assert whole is not None
    whole.release()


def test_allocate_blocks_until_a_release(pool) -> None:
    hog = pool.allocate(pool.capacity)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.allocate(5 * PAGE)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got, "allocate should wait while the pool is full"
    hog.release()
    waiter.join(10)
    assert not waiter.is_alive()
    (region,) = got
    assert region.capacity == 5 * PAGE
    region.release()


def test_oversize_request(pool) -> None:
    capacity = re.escape(format_size(pool.capacity))
    with pytest.raises(ValueError, match=rf"does not fit in the snapshot pool of {capacity}"):
        pool.allocate(pool.capacity + 1)
    assert pool.try_allocate(pool.capacity + 1) is None
    assert pool.used == 0


def test_cache_too_small() -> None:
    with pytest.raises(ValueError, match="host_cache_size must be at least 16 KiB"):
        HostCache(16 * KiB - 1)


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
    # Contiguous tiling, padding entries only after large items.
    cursor = 0
    for p in layout.placements:
        assert p.begin == cursor
        cursor = p.end
    assert layout.file_size == layout.data_start + cursor
    # The header is what safetensors reads.
    (n,) = struct.unpack("<Q", layout.header[:8])
    header = json.loads(layout.header[8 : 8 + n])
    pads = [k for k in header if k.startswith(PAD_PREFIX)]
    assert len(pads) == 1 and header[pads[0]]["dtype"] == "U8"
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


# -- sizes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nbytes"),
    [(4096, 4096), ("4096", 4096), ("16GiB", 16 << 30), ("512 MiB", 512 << 20),
     ("1.5KiB", 1536), ("2gb", 2 * 10**9), ("7B", 7), ("0", 0)],
)
def test_parse_size(text, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "1e3", "-5", "1.2.3MiB", ""])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=rf"cache={text!r} is not a size"):
        parse_size(text, name="cache")


def test_parse_size_rejects_negative_and_bool() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        parse_size(-1)
    with pytest.raises(TypeError, match="must be an int or a string"):
        parse_size(True)
