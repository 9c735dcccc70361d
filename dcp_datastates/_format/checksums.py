"""Per-block checksums of item bytes (xxHash XXH3-64), so partial reads can be verified too.

Blocks are hashed by ``libdcp_hash.so`` (built beside the io_uring shim) where it is there:
ctypes releases the GIL around it, so blocks are hashed on every I/O thread at once, next to
the training loop. Without it, the xxhash Python package (which holds the GIL) does the same.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import xxhash

from ..errors import CheckpointCorruptError

#: Bytes covered by one checksum; an item shorter than this has a single checksum.
BLOCK_BYTES = 16 << 20


log = logging.getLogger("dcp_datastates")
NATIVE_PATH = Path(__file__).resolve().parent.parent / "_lib" / "libdcp_hash.so"


@functools.cache
def native() -> ctypes.CDLL | None:
    """``libdcp_hash.so``, loaded once (None where it was not built; logged once)."""
    try:
        lib = ctypes.CDLL(str(NATIVE_PATH))
    except OSError as exc:
        log.info("dcp_datastates: checksums with the xxhash package (holds the GIL): %s", exc)
        return None
    lib.dsh_xxh3_blocks.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_uint64)]
    lib.dsh_xxh3_blocks.restype = None
    if hasattr(lib, "dsh_xxh3_regions"):  # not in a library built before it was added
        lib.dsh_xxh3_regions.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64),
                                         ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_uint64)]
        lib.dsh_xxh3_regions.restype = None
    return lib


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at address ``addr`` (the caller keeps it alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def block_checksums(addr: int, nbytes: int, block: int = BLOCK_BYTES) -> list[int]:
    """XXH3-64 of each ``block``-byte block of ``nbytes`` at ``addr`` (one for an empty item)."""
    lib = native()
    if lib is not None:
        out = (ctypes.c_uint64 * max(1, -(-nbytes // block)))()
        lib.dsh_xxh3_blocks(addr or None, nbytes, block, out)
        return list(out)
    if nbytes == 0:
        return [xxhash.xxh3_64_intdigest(b"")]
    mem = memory_at(addr, nbytes)
    return [xxhash.xxh3_64_intdigest(mem[i : i + block]) for i in range(0, nbytes, block)]


def regions_checksums(regions: list[tuple[int, int]],
                      block: int = BLOCK_BYTES) -> list[list[int]]:
    """:func:`block_checksums` of each memory region (address, bytes), in one native call
    where the library has it (the GIL is taken back once, not once per region)."""
    lib = native()
    if lib is None or not hasattr(lib, "dsh_xxh3_regions") or not regions:
        return [block_checksums(a, n, block) for a, n in regions]
    counts = [max(1, -(-n // block)) for _, n in regions]
    addrs = (ctypes.c_uint64 * len(regions))(*(a for a, _ in regions))
    sizes = (ctypes.c_size_t * len(regions))(*(n for _, n in regions))
    out = (ctypes.c_uint64 * sum(counts))()
    lib.dsh_xxh3_regions(len(regions), addrs, sizes, block, out)
    flat, at, sums = list(out), 0, []
    for count in counts:
        sums.append(flat[at : at + count])
        at += count
    return sums


def deal_blocks(regions: list[tuple[int, int]], share: int,
                block: int = BLOCK_BYTES) -> list[list[tuple[int, int, int]]]:
    """Memory ``regions`` (address, bytes) dealt into tasks of about ``share`` bytes (a
    multiple of ``block``) of pieces (region index, address, bytes), in region order: a region
    is split only at its block boundaries, so that the checksums of its pieces, in order, are
    its own. An empty region is one piece."""
    tasks: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for index, (addr, nbytes) in enumerate(regions):
        done = 0
        while True:
            left = nbytes - done
            if left <= room:
                tasks[-1].append((index, addr + done, left))
                room -= left
                break
            take = room - room % block
            if take:
                tasks[-1].append((index, addr + done, take))
                done += take
            tasks.append([])
            room = share
    return [t for t in tasks if t]


def _digest(data: memoryview) -> int:
    """XXH3-64 of ``data`` (natively where the buffer is writable, so its address is known)."""
    if native() is not None and len(data) and not data.readonly:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(data))
        return block_checksums(addr, len(data), len(data))[0]
    return xxhash.xxh3_64_intdigest(data)


def verify_span(
    segments: list[tuple[int, memoryview]],
    expected: tuple[int, ...],
    block: int,
    length: int,
    what: str,
) -> None:
    """Check whole checksum blocks assembled from ``segments``.

    Each segment is (item byte offset, bytes); together they must cover a range of the item
    that starts and ends on block boundaries (or the item's end). Raises
    ``CheckpointCorruptError`` naming ``what`` at the first block that does not match.
    """
    lo = segments[0][0]
    hi = segments[-1][0] + len(segments[-1][1])
    if lo == hi:
        if length == 0 and expected != (xxhash.xxh3_64_intdigest(b""),):
            raise CheckpointCorruptError(f"{what}: checksum mismatch for the empty item")
        return
    if len(segments) == 1 and not segments[0][1].readonly and native() is not None:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(segments[0][1]))
        digests = block_checksums(addr, hi - lo, block)  # one native call for the span
    else:
        digests = None
    for k in range(lo // block, -(-hi // block)):
        b0, b1 = k * block, min((k + 1) * block, length)
        if digests is not None:
            _expect(digests[k - lo // block], expected, k, what, b0, b1)
            continue
        parts = [data[s0 - start : s1 - start] for start, data in segments
                 for s0, s1 in [(max(b0, start), min(b1, start + len(data)))] if s0 < s1]
        if len(parts) == 1:
            digest = _digest(parts[0])
        else:
            hasher = xxhash.xxh3_64()
            for part in parts:
                hasher.update(part)
            digest = hasher.intdigest()
        _expect(digest, expected, k, what, b0, b1)


def _expect(digest: int, expected: tuple[int, ...], k: int, what: str, b0: int, b1: int) -> None:
    if k >= len(expected) or digest != expected[k]:
        raise CheckpointCorruptError(
            f"{what}: checksum mismatch in item bytes {b0}..{b1}; the data file is corrupt")
