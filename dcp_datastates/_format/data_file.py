"""The data file: a valid safetensors file whose large tensors start on 4 KiB boundaries.

Layout: an 8-byte little-endian header length, a JSON header padded with spaces so the data
starts 4 KiB aligned, then the data. Large tensors come first, each starting 4 KiB aligned (a
zero-filled ``U8`` padding entry fills any gap, since safetensors forbids holes); small tensors
follow, packed by element size so each stays naturally aligned; bytes items come last, so their
sizes (known only once they are serialized) move no tensor. Items safetensors has no dtype
for (DCP bytes items, complex128, ...) are stored as ``U8`` byte arrays and listed in the
header's ``__metadata__`` under ``raw_items``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointCorruptError, brief
from .align import ALIGN

FORMAT_NAME = "dcp_datastates"
FORMAT_VERSION = "1"
PAD_PREFIX = "__dcp_datastates_pad_"
#: Prepended to item names that would clash with ``__metadata__`` or the padding entries.
ESCAPE_PREFIX = "__dcp_datastates_item__"
#: Items at least this large start 4 KiB aligned and can be written straight from the cache.
LARGE_ITEM_BYTES = 64 << 10
#: Largest header the reader accepts (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20
#: Bytes read at first to check a data file's header (most headers are much shorter).
HEAD_BYTES = 64 << 10

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
RAW_PICKLE = "pickle"


class ItemSpec(NamedTuple):  # a tuple: made for every item of every save and load, cheaply
    """One item to place: its header name, torch dtype (None for bytes items), shape, size."""

    name: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Where an item (or a padding entry, ``spec is None``) sits, relative to the data start."""

    spec: ItemSpec | None
    begin: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.begin + self.nbytes


@dataclass(frozen=True)
class FileLayout:
    """The header bytes and every placement, in file order."""

    header: bytes
    placements: list[Placement]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + (self.placements[-1].end if self.placements else 0)


def plan_layout(items: list[ItemSpec], header_len: int | None = None) -> FileLayout:
    """Place ``items`` (:func:`place`) and build the header that describes them."""
    return file_layout(place(items), header_len)


def file_layout(placements: list[Placement], header_len: int | None = None) -> FileLayout:
    """The layout of ``placements`` (made by :func:`place_tensors` and :func:`place_bytes`)
    with the header that describes them.

    ``header_len`` pads the header to that many bytes (a multiple of 4 KiB, at least the
    header's own length), so a layout with the same tensors keeps the same data start.
    """
    names = [p.spec.name for p in placements if p.spec is not None]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"two items would share the file entry name(s) {dup}")
    return FileLayout(_header_bytes(placements, header_len), placements)


def place(items: list[ItemSpec]) -> list[Placement]:
    """Where each item (and each padding entry) sits, relative to the data start: the tensors
    (:func:`place_tensors`), then the bytes items (:func:`place_bytes`)."""
    placements = place_tensors([i for i in items if i.dtype is not None])
    end = placements[-1].end if placements else 0
    return placements + place_bytes([i for i in items if i.dtype is None], end)


def itemsize_of(spec: ItemSpec) -> int:
    """A tensor item's element size (TypeError for a bytes item)."""
    if spec.dtype is None:
        raise TypeError(f"{spec.name} is a bytes item, not a tensor")
    return spec.dtype.itemsize


def place_tensors(tensors: list[ItemSpec]) -> list[Placement]:
    """Where each tensor (and each padding entry) sits, relative to the data start: the one
    function that decides it, for the snapshot and the data file alike. Large tensors first,
    in the order given, each 4 KiB aligned; then small ones packed by element size."""
    large = [i for i in tensors if i.nbytes >= LARGE_ITEM_BYTES]
    small = sorted(  # by element size, largest first: each stays naturally aligned
        (i for i in tensors if i.nbytes < LARGE_ITEM_BYTES), key=lambda i: -itemsize_of(i)
    )
    placements: list[Placement] = []
    cursor = 0
    for item in large:
        placements.append(Placement(item, cursor, item.nbytes))
        cursor += item.nbytes
        gap = -cursor % ALIGN
        if gap:
            placements.append(Placement(None, cursor, gap))
            cursor += gap
    for item in small:
        placements.append(Placement(item, cursor, item.nbytes))
        cursor += item.nbytes
    return placements


def place_bytes(raw: list[ItemSpec], cursor: int) -> list[Placement]:
    """Bytes items after the tensors, which end at ``cursor``: they start on a block of their
    own (they are written later, once serialized)."""
    placements: list[Placement] = []
    if raw and cursor % ALIGN:
        placements.append(Placement(None, cursor, -cursor % ALIGN))
        cursor += placements[-1].nbytes
    for item in raw:
        placements.append(Placement(item, cursor, item.nbytes))
        cursor += item.nbytes
    return placements


def _header_bytes(placements: list[Placement], header_len: int | None) -> bytes:
    entries: dict[str, object] = {}
    raw: dict[str, str] = {}
    for k, p in enumerate(placements):
        spec = p.spec
        if spec is None:
            entries[f"{PAD_PREFIX}{k}"] = _entry("U8", [p.nbytes], p.begin, p.end)
            continue
        key, dtype, shape = _header_entry(spec)
        if spec.dtype not in SAFETENSORS_DTYPES:
            raw[key] = RAW_PICKLE if spec.dtype is None else str(spec.dtype)
        entries[key] = _entry(dtype, shape, p.begin, p.end)
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
    if raw:
        meta["raw_items"] = json.dumps(raw, sort_keys=True)
    return _encode_header(meta, entries, ALIGN, header_len)


def _encode_header(meta: dict[str, str], entries: dict[str, object], align: int,
                  header_len: int | None = None) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces so the data starts
    ``align``-aligned, or at ``header_len`` (a multiple of ``align``) when given."""
    body = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % align)
    if header_len is not None:
        if header_len < 8 + len(body) or header_len % align:
            raise ValueError(f"a header of {8 + len(body)} bytes cannot fill {header_len}")
        body += b" " * (header_len - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def _header_entry(spec: ItemSpec) -> tuple[str, str, list[int]]:
    """An item's header key, safetensors dtype and shape (raw items: ``U8`` bytes)."""
    dtype = SAFETENSORS_DTYPES.get(spec.dtype) if spec.dtype is not None else None
    if dtype is None:
        return entry_key(spec.name), "U8", [spec.nbytes]
    return entry_key(spec.name), dtype, list(spec.shape)


def entry_key(name: str) -> str:
    """The header key of an item: its name, escaped if it could clash with a reserved key."""
    reserved = name == "__metadata__" or name.startswith((PAD_PREFIX, ESCAPE_PREFIX))
    return ESCAPE_PREFIX + name if reserved else name


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def export_header(specs: list[ItemSpec], meta: dict[str, str]) -> bytes:
    """A plain safetensors header for ``specs`` stored back to back in that order."""
    entries: dict[str, object] = {}
    begin = 0
    for spec in specs:
        key, dtype, shape = _header_entry(spec)
        entries[key] = _entry(dtype, shape, begin, begin + spec.nbytes)
        begin += spec.nbytes
    return _encode_header(meta, entries, 8)


def entry_mismatch(header: dict[str, object], data_start: int, spec: ItemSpec,
                   offset: int) -> str | None:
    """How the header's entry for ``spec`` (stored at file ``offset``) differs from what
    ``.metadata`` says: "dtype 'I32' in the header, 'F32' in .metadata"; None if it agrees."""
    key, dtype, shape = _header_entry(spec)
    entry = header.get(key)
    begin = offset - data_start
    want = _entry(dtype, shape, begin, begin + spec.nbytes)
    if entry == want:  # the usual case, compared at C speed
        return None
    if not isinstance(entry, dict):
        return f"the header has no entry {key!r}"
    diffs = [f"{k} {entry.get(k)!r} in the header, {v!r} in .metadata"
             for k, v in want.items() if entry.get(k) != v]
    return "; ".join(diffs) or None


def layout_mismatch(header: dict[str, Any], data_start: int, file_size: int) -> str | None:
    """What is wrong with how a file's entries lay out its data (its header checked by
    ``read_header``): entries must tile the data, no overlap and no hole (safetensors' rule),
    and end where the file does. None if nothing is."""
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in header.items()
                   if k != "__metadata__")
    end, prev = 0, None
    for begin, stop, name in spans:
        if begin != end:
            how = "overlaps" if begin < end else "leaves a hole after"
            return (f"entry {name!r} (data offsets [{begin}, {stop}]) {how} "
                    f"{'the data start' if prev is None else f'entry {prev!r}'} (ending at {end})")
        end, prev = stop, name
    if data_start + end == file_size:
        return None
    return (f"the file has {file_size} bytes where its header ({data_start} bytes) and the "
            f"data it describes make {data_start + end}")


def read_file_header(fd: int, file_size: int, what: str) -> tuple[int, dict[str, object]]:
    """``read_header`` of an open data file: reads its first bytes, and a long header whole."""
    head = os.pread(fd, HEAD_BYTES, 0)
    try:
        return read_header(head, what, file_size)
    except CheckpointCorruptError:
        if len(head) < HEAD_BYTES:
            raise
    (n,) = struct.unpack("<Q", head[:8])
    return read_header(os.pread(fd, 8 + min(n, MAX_HEADER_BYTES), 0), what, file_size)


def read_header(head: bytes, path: str, file_size: int) -> tuple[int, dict[str, object]]:
    """Parse and check a data file's header; return (data start, the JSON header).

    ``head`` holds at least the first 8 bytes of the file, and the whole header when it is
    shorter than ``len(head) - 8``; call again with more bytes when ``CheckpointCorruptError``
    says so. Raises ``CheckpointCorruptError`` naming ``path`` for anything malformed.
    """
    if len(head) < 8 or file_size < 8:
        raise CheckpointCorruptError(f"{path}: file too short ({file_size} bytes) for a header")
    (size,) = struct.unpack("<Q", head[:8])
    if size > MAX_HEADER_BYTES or 8 + size > file_size:
        raise CheckpointCorruptError(
            f"{path}: header length {size} is impossible for a file of {file_size} bytes"
        )
    if len(head) < 8 + size:
        raise CheckpointCorruptError(f"{path}: header needs {8 + size} bytes, got {len(head)}")
    try:
        header = json.loads(head[8 : 8 + size].decode("utf-8"), object_pairs_hook=_unique_keys,
                            parse_constant=_no_constant)
    except _DuplicateKey as exc:
        raise CheckpointCorruptError(f"{path}: header has the key {exc.args[0]!r} twice") from None
    except (ValueError, RecursionError) as exc:  # bad UTF-8 / JSON, huge ints, deep nesting
        raise CheckpointCorruptError(f"{path}: header is not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: header is not a JSON object")
    data_start = 8 + size
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointCorruptError(
                    f"{path}: header's __metadata__ is not an object of strings: {entry!r:.200}")
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)  # bools are not offsets
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointCorruptError(
                f"{path}: entry {name!r} has data offsets {offsets!r}, not [begin, end]"
            )
        if offsets[1] > file_size - data_start:
            raise CheckpointCorruptError(
                f"{path} is truncated: item {name!r} needs bytes {data_start + offsets[0]}.."
                f"{data_start + offsets[1]}, the file has {file_size}"
            )
        if (why := _entry_problem(entry, offsets)) is not None:
            raise CheckpointCorruptError(f"{path}: entry {name!r} {why}")
    return data_start, header


#: Bytes per element of each safetensors dtype this package writes.
_DTYPE_BYTES = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}


def bounded_numel(shape: Sequence[int], limit: int) -> int | None:
    """The product of ``shape`` (non-negative ints), or None where it exceeds ``limit``: found
    without ever multiplying numbers larger than ``limit``, so that sizes read from a file
    cost no more than their count, however large they are."""
    if 0 in shape:
        return 0
    numel = 1
    for d in shape:
        if d > limit:
            return None
        numel *= d
        if numel > limit:
            return None
    return numel


def _entry_problem(entry: dict, offsets: list[int]) -> str | None:
    """What makes a header entry one safetensors refuses (its offsets are checked already)."""
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        return f"has dtype {brief(dtype, 100)}, not a safetensors dtype this package writes"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"has shape {brief(shape)}, not a list of sizes"
    nbytes, size = offsets[1] - offsets[0], _DTYPE_BYTES[dtype]
    numel = bounded_numel(shape, nbytes // size)
    if numel is None or numel * size != nbytes:
        made = "more than that" if numel is None else numel * size
        return (f"has {nbytes} data bytes where its dtype {dtype} and shape {brief(shape)} "
                f"make {made}")
    return None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object as a dict, refusing a key given twice (parsers disagree on which wins)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")
