"""Per-block checksums of item bytes (xxHash XXH3-64), so partial reads can be verified too."""

from __future__ import annotations

import ctypes

import xxhash

from .errors import CheckpointCorruptError

#: Bytes covered by one checksum; an item shorter than this has a single checksum.
BLOCK_BYTES = 16 << 20


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at address ``addr`` (the caller keeps it alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def block_checksums(addr: int, nbytes: int, block: int = BLOCK_BYTES) -> list[int]:
    """XXH3-64 of each ``block``-byte block of ``nbytes`` at ``addr`` (one for an empty item)."""
    if nbytes == 0:
        return [xxhash.xxh3_64_intdigest(b"")]
    mem = memory_at(addr, nbytes)
    return [xxhash.xxh3_64_intdigest(mem[i : i + block]) for i in range(0, nbytes, block)]


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
    for k in range(lo // block, -(-hi // block)):
        b0, b1 = k * block, min((k + 1) * block, length)
        hasher = xxhash.xxh3_64()
        for start, data in segments:
            s0, s1 = max(b0, start), min(b1, start + len(data))
            if s0 < s1:
                hasher.update(data[s0 - start : s1 - start])
        if k >= len(expected) or hasher.intdigest() != expected[k]:
            raise CheckpointCorruptError(
                f"{what}: checksum mismatch in item bytes {b0}..{b1}; the data file is corrupt"
            )
