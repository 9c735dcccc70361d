"""Checksums: libdcp_hash.so gives xxHash's own XXH3-64 digests, block by block, so checkpoints
written with either implementation verify with the other."""

from __future__ import annotations

import ctypes

import pytest
import torch
import xxhash
from helpers import MARKS

from dcp_datastates._format import checksums
from dcp_datastates.errors import CheckpointCorruptError

pytestmark = MARKS
BLOCK = 1 << 16


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return torch.randint(0, 256, (5 * BLOCK + 123,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))


def reference(mem: memoryview, block: int) -> list[int]:
    if not len(mem):
        return [xxhash.xxh3_64_intdigest(b"")]
    return [xxhash.xxh3_64_intdigest(mem[i : i + block]) for i in range(0, len(mem), block)]


def test_native_library_is_built_and_loaded() -> None:
    if not checksums.NATIVE_PATH.is_file():
        pytest.skip("libdcp_hash.so not built (no xxhash.h here)")
    assert checksums.native() is not None


@pytest.mark.parametrize("nbytes", [0, 1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 123])
def test_block_digests_equal_xxhash(data: torch.Tensor, nbytes: int) -> None:
    mem = memoryview(data.numpy()).cast("B")[:nbytes]
    assert checksums.block_checksums(data.data_ptr(), nbytes, BLOCK) == reference(mem, BLOCK)


def test_verify_span_takes_native_and_split_blocks_and_names_the_bad_one(
        data: torch.Tensor) -> None:
    n = data.numel()
    sums = tuple(checksums.block_checksums(data.data_ptr(), n, BLOCK))
    whole = checksums.memory_at(data.data_ptr(), n)
    checksums.verify_span([(0, whole)], sums, BLOCK, n, "item")
    cut = BLOCK + 100  # a block assembled from two segments
    checksums.verify_span([(0, whole[:cut]), (cut, whole[cut:])], sums, BLOCK, n, "item")
    copy = bytearray(whole)
    copy[2 * BLOCK + 7] ^= 1
    bad = memoryview(copy)
    with pytest.raises(CheckpointCorruptError,
                       match=rf"item: checksum mismatch in item bytes {2 * BLOCK}\.\.{3 * BLOCK}"):
        checksums.verify_span([(0, bad)], sums, BLOCK, n, "item")
    ctypes.memset(data.data_ptr(), 0, 0)  # the fixture's bytes are untouched


@pytest.mark.parametrize("share", [BLOCK, 2 * BLOCK, 7 * BLOCK])
def test_dealt_blocks_give_each_item_its_own_checksums(data: torch.Tensor, share: int) -> None:
    """Items dealt into tasks of ``share`` bytes, a large one split at its block boundaries:
    the tasks' checksums, put back together in order, are each item's own."""
    base, n = data.data_ptr(), data.numel()
    regions = [(base, n), (base, 0), (base + 5, BLOCK + 1), (base, 3), (base + 9, 3 * BLOCK)]
    tasks = checksums.deal_blocks(regions, share, BLOCK)
    assert all(sum(p[2] for p in t) <= share for t in tasks)
    assert len(tasks) > 1
    got: list[list[int]] = [[] for _ in regions]
    for task in tasks:
        for k, addr, nbytes in task:
            got[k] += checksums.block_checksums(addr, nbytes, BLOCK)
    assert got == [checksums.block_checksums(a, m, BLOCK) for a, m in regions]


def test_regions_checksums_are_each_regions_own(data: torch.Tensor) -> None:
    base, n = data.data_ptr(), data.numel()
    regions = [(base, n), (base, 0), (base + 5, BLOCK + 1), (base + 9, 3)]
    assert checksums.regions_checksums(regions, BLOCK) == [
        checksums.block_checksums(a, m, BLOCK) for a, m in regions]
    assert checksums.regions_checksums([], BLOCK) == []
