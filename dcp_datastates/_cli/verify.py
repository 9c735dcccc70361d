"""``verify``: every data file's header against ``.metadata``, and every stored byte re-read
through the load job against its checksums; every damaged item named."""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .._engine import Engine
from .._format.data_file import ItemSpec
from .._format.entries import tiling_problems
from .._sizes import format_size
from ..errors import CheckpointError
from ..tiers._steps import RECORD_NAME
from .arguments import add_command, add_quiet, cli_path, command_engine
from .checkpoint import Chunk, load_checkpoint
from .headers import check_file
from .progress import Progress
from .reads import BATCH_BYTES, SLICE_BYTES, Planner, batches, bytes_read, chunk_reads, read

#: Targets start this aligned in the scratch buffer (any dtype can view them).
_ALIGN = 64


class _Read(NamedTuple):
    """A read item, the bytes it hands over, its dtype (None for a bytes item), and how a
    load job's error names it ("file F, item 'fqn'")."""

    item: ReadItem
    nbytes: int
    dtype: torch.dtype | None
    label: str


class ChunkCheck:
    """Re-reads stored chunks through the load job, checksums on, and names each that fails.

    One load job per batch of about ``batch_bytes``, which reads on past damaged items (a
    failed read or checksum) and names each. Where it stops at another failure: when its
    error names one item of the batch, that item is reported and the rest read again; where
    it names several or none, the batch is split. Targets are views of one scratch buffer,
    reused batch after batch.
    """

    def __init__(self, engine: Engine, path: Path, md: Metadata, progress: Progress,
                 batch_bytes: int = BATCH_BYTES, slice_bytes: int = SLICE_BYTES) -> None:
        self.engine, self.path, self.md, self.progress = engine, path, md, progress
        self.batch_bytes, self.slice_bytes = batch_bytes, slice_bytes
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def problems(self, chunks: list[tuple[Chunk, ItemSpec]]) -> list[str]:
        """What a load of ``chunks`` (each with its spec) would refuse, one line per damaged
        item, in their order."""
        reads = [r for c, spec in chunks for r in self._reads(c, spec)]
        order = {id(r): i for i, r in enumerate(reads)}
        found = [f for batch in batches(((r, r.nbytes) for r in reads), self.batch_bytes)
                 for f in self._check(batch)]
        return list(dict.fromkeys(why for _, why in sorted(
            (order[id(r)], why) for r, why in found)))  # a file-wide failure is said once

    def _reads(self, c: Chunk, spec: ItemSpec) -> list[_Read]:
        label = f"file {c.loc.file}, item {c.fqn!r}"
        if spec.dtype is None:
            return [_Read(bytes_read(c.index), spec.nbytes, None, label)]
        size = spec.dtype.itemsize
        items = chunk_reads(c.index, spec.shape, size, c.loc.block, c.index,
                            [0] * len(spec.shape), self.slice_bytes)
        return [_Read(item, math.prod(item.lengths) * size, spec.dtype, label) for item in items]

    def _check(self, batch: list[_Read]) -> list[tuple[_Read, str]]:
        """Each damaged read of ``batch`` with the load job's error about it."""
        found: list[tuple[_Read, str]] = []
        todo = [batch]
        while todo:
            part = todo.pop()
            failed = self._failure(part, found)
            if failed is None:
                continue
            named = [r for r in part if r.label in failed]
            if len(part) == 1 or len(named) == 1:
                bad = part[0] if len(part) == 1 else named[0]
                self.progress.update(bad.nbytes)
                found.append((bad, failed))
                todo.append([r for r in part if r is not bad])
                continue
            split = named if 0 < len(named) < len(part) else part[:len(part) // 2]
            taken = {id(r) for r in split}
            todo += [[r for r in part if id(r) not in taken], split]
        return found

    def _failure(self, batch: list[_Read], found: list[tuple[_Read, str]]) -> str | None:
        """Read ``batch`` with one load job, each damaged item (and its error) put in
        ``found``: None if the job ends, else the error that stopped it."""
        if not batch:
            return None
        targets = self._targets(batch)
        planner = Planner(lambda item: targets[id(item)], self.progress)
        damaged: list = []
        try:
            read(self.engine, self.path, self.md, [r.item for r in batch], planner, verify=True,
                 damaged=damaged)
        except CheckpointError as exc:
            return str(exc)
        of = {id(r.item): r for r in batch}
        for item, error in damaged:
            self.progress.update(of[id(item)].nbytes)
            found.append((of[id(item)], str(error)))
        return None

    def _targets(self, batch: list[_Read]) -> dict[int, torch.Tensor]:
        """A view of the scratch buffer for each tensor item (by ``id``), shaped as it asks."""
        need = sum(_aligned(r.nbytes) for r in batch if r.dtype is not None)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(0, dtype=torch.uint8)  # let the old one go first
            self._scratch = torch.empty(need, dtype=torch.uint8)
        views: dict[torch.dtype, torch.Tensor] = {}
        targets, at = {}, 0
        for r in batch:
            if r.dtype is None:
                continue
            if r.dtype not in views:
                views[r.dtype] = self._scratch.view(r.dtype)
            targets[id(r.item)] = views[r.dtype].as_strided(
                r.item.lengths, _contiguous_strides(r.item.lengths), at // r.dtype.itemsize)
            at += _aligned(r.nbytes)
        return targets


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _cmd_verify(args: argparse.Namespace) -> int:
    """Check every data file's header against ``.metadata``, and re-read every stored byte
    against the checksums in ``.metadata``."""
    path = cli_path(args.path)
    md, chunks = load_checkpoint(path, refuse_filesystem_writer=(
        "it holds no checksums or headers to verify; `export --format torch` reads every item "
        "of it"))
    by_file: dict[str, list[Chunk]] = defaultdict(list)
    for cs in chunks.values():
        for c in cs:
            by_file[c.loc.file].append(c)
    total = sum(c.loc.length for cs in by_file.values() for c in cs)
    progress = Progress(total, "verifying", not args.quiet)
    part = (path / RECORD_NAME).is_file()  # a memory-tier step: one rank's shards only
    problems = tiling_problems(path, md, sorted(md.state_dict_metadata), whole=not part)
    try:
        with command_engine(args) as engine:
            check = ChunkCheck(engine, path, md, progress)
            for name in sorted(by_file):
                cs = sorted(by_file[name], key=lambda c: c.loc.offset)
                found = check_file(path, md, name, cs)
                read_bytes = sum(c.loc.length for c, _ in found.readable)
                progress.update(sum(c.loc.length for c in cs) - read_bytes)  # not to be read
                problems += found.problems + check.problems(found.readable)
    finally:
        progress.close()
    nchunks = sum(len(cs) for cs in by_file.values())
    if problems:
        print(f"FAILED: {path}: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"OK: {path}: {nchunks} stored chunks, {total} bytes ({format_size(total)}) in "
          f"{len(by_file)} files match their headers and checksums" + (
              " (one rank's part of a checkpoint: a memory-tier step, whose sharded tensors "
              "hold that rank's chunks only)" if part else ""))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``verify``."""
    p = add_command(
        sub, "verify", "check every header against .metadata and every checksum",
        "Verify a checkpoint: check each data file's safetensors header against .metadata "
        "(every item's dtype, shape and data offsets, and the file's size), then read every "
        "stored byte and check it against the XXH3-64 block checksums in .metadata. Exits 0 "
        "when everything matches, 1 (naming the file, the item and what differs) on a "
        "mismatch, a missing, truncated or unusable file.")
    add_quiet(p)
    p.set_defaults(func=_cmd_verify)
