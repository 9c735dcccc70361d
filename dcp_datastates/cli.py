"""``python -m dcp_datastates``: inspect, verify and export DataStates checkpoints."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import stat
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .errors import CheckpointCorruptError, CheckpointError
from .file_format import SAFETENSORS_DTYPES
from .metadata_file import ItemLocation, read_metadata
from .sizes import format_size, parse_size


@dataclass(frozen=True)
class _Chunk:
    """One stored piece of an item: its chunk offsets (None for bytes items) and location."""

    fqn: str
    offsets: tuple[int, ...] | None
    loc: ItemLocation


def _load(path: Path) -> tuple[Metadata, dict[str, list[_Chunk]]]:
    """The checkpoint's metadata and its stored chunks grouped by fqn."""
    md = read_metadata(path)
    chunks: dict[str, list[_Chunk]] = defaultdict(list)
    for index, loc in md.storage_data.items():
        if not isinstance(loc, ItemLocation):
            raise CheckpointCorruptError(
                f"{path}/.metadata: item {index.fqn!r} has no DataStates location; was this "
                f"checkpoint written by another storage writer?"
            )
        if "/" in loc.file or loc.file in ("", ".", ".."):
            raise CheckpointCorruptError(f"{path}/.metadata: bad file name {loc.file!r}")
        offsets = None if index.offset is None else tuple(index.offset)
        chunks[index.fqn].append(_Chunk(index.fqn, offsets, loc))
    return md, chunks


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- inspect ------------------------------------------------------------------------------------
def _inspect_data(path: Path) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-able data."""
    md, chunks = _load(path)
    items = []
    per_file: dict[str, int] = defaultdict(int)
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        stored = chunks.get(fqn, [])
        files = sorted({c.loc.file for c in stored})
        for f in files:
            per_file[f] += 1
        tensor = isinstance(smd, TensorStorageMetadata)
        items.append({
            "fqn": fqn,
            "kind": "tensor" if tensor else "bytes",
            "dtype": _dtype_name(smd.properties.dtype) if tensor else None,
            "shape": list(smd.size) if tensor else None,
            "chunks": len(stored),
            "bytes": sum(c.loc.length for c in stored),
            "files": files,
        })
    files_out = []
    for name in sorted(per_file):
        f = path / name
        files_out.append({"name": name, "size": f.stat().st_size if f.is_file() else None,
                          "items": per_file[name]})
    totals = {
        "items": len(items),
        "tensors": sum(i["kind"] == "tensor" for i in items),
        "chunks": sum(i["chunks"] for i in items),
        "bytes": sum(i["bytes"] for i in items),
        "files": len(files_out),
        "file_bytes": sum(f["size"] or 0 for f in files_out),
    }
    return {"path": str(path), "items": items, "files": files_out, "totals": totals}


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the items, the data files and the totals."""
    data = _inspect_data(Path(args.path))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [["fqn", "kind", "dtype", "shape", "chunks", "bytes", "file(s)"]]
    for i in data["items"]:
        shape = "-" if i["shape"] is None else str(i["shape"])
        rows.append([i["fqn"], i["kind"], i["dtype"] or "-", shape, str(i["chunks"]),
                     str(i["bytes"]), ",".join(i["files"])])
    print(_table(rows, {4, 5}))
    print()
    frows = [["file", "size", "items"]]
    for f in data["files"]:
        size = "MISSING" if f["size"] is None else f"{f['size']} ({format_size(f['size'])})"
        frows.append([f["name"], size, str(f["items"])])
    print(_table(frows, {2}))
    t = data["totals"]
    print(f"\ntotal: {t['items']} items ({t['tensors']} tensors, {t['chunks']} chunks), "
          f"{t['bytes']} item bytes ({format_size(t['bytes'])}) in {t['files']} files "
          f"of {t['file_bytes']} bytes ({format_size(t['file_bytes'])})")
    return 0


# -- verify -------------------------------------------------------------------------------------
class _Progress:
    """A byte-count progress bar on stderr: tqdm when installed, else a percentage line."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                                unit_divisor=1024, file=sys.stderr)
            except ImportError:
                self._show()

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            self._show()

    def _show(self) -> None:
        tty = sys.stderr.isatty()
        pct = 100 * self.done // self.total if self.total else 100
        if pct != self.shown and (tty or pct // 10 != self.shown // 10):
            self.shown = pct
            end = "\r" if tty else "\n"
            print(f"{self.desc}: {pct:3d}% ({format_size(self.done)} of "
                  f"{format_size(self.total)})", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)


def _pread_into(fd: int, mem: memoryview, offset: int) -> int:
    """Fill ``mem`` from ``offset``; return the bytes read (fewer only at end of file)."""
    got = 0
    while got < len(mem):
        n = os.preadv(fd, [mem[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _blocks(loc: ItemLocation) -> Iterator[tuple[int, int, int]]:
    """(block number, first byte, end byte) of each checksum block of an item."""
    if loc.length == 0:
        yield 0, 0, 0
    for k, b0 in enumerate(range(0, loc.length, loc.block)):
        yield k, b0, min(b0 + loc.block, loc.length)


def _where(c: _Chunk) -> str:
    at = "" if c.offsets is None else f" (chunk at {list(c.offsets)})"
    return f"file {c.loc.file}, item {c.fqn!r}{at}"


def _verify_chunk(fd: int, size: int, c: _Chunk, buf: memoryview,
                  progress: _Progress) -> list[str]:
    """Problems found in one stored chunk: truncation and checksum mismatches."""
    loc = c.loc
    problems = []
    nblocks = max(1, -(-loc.length // loc.block))
    if len(loc.checksums) != nblocks:
        problems.append(f"{_where(c)}: .metadata has {len(loc.checksums)} checksums for "
                        f"{nblocks} blocks")
    if loc.offset + loc.length > size:
        problems.append(f"{_where(c)}: truncated: needs file bytes {loc.offset}.."
                        f"{loc.offset + loc.length}, the file has {size}")
        progress.update(loc.length)
        return problems
    for k, b0, b1 in _blocks(loc):
        mem = buf[: b1 - b0]
        got = _pread_into(fd, mem, loc.offset + b0)
        progress.update(b1 - b0)
        ok = got == b1 - b0 and k < len(loc.checksums)
        if not ok or xxhash.xxh3_64_intdigest(mem) != loc.checksums[k]:
            problems.append(f"{_where(c)}: checksum mismatch in item bytes {b0}..{b1} "
                            f"(file bytes {loc.offset + b0}..{loc.offset + b1})")
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-read every stored byte and check it against the checksums in ``.metadata``."""
    path = Path(args.path)
    _, chunks = _load(path)
    by_file: dict[str, list[_Chunk]] = defaultdict(list)
    for cs in chunks.values():
        for c in cs:
            by_file[c.loc.file].append(c)
    total = sum(c.loc.length for cs in by_file.values() for c in cs)
    block = max((c.loc.block for cs in by_file.values() for c in cs), default=1)
    buf = memoryview(bytearray(min(block, max(total, 1))))
    progress = _Progress(total, "verifying", not args.quiet)
    problems: list[str] = []
    try:
        for name in sorted(by_file):
            cs = sorted(by_file[name], key=lambda c: c.loc.offset)
            try:
                fd = _open_data(path / name)
            except OSError as exc:
                problems += [f"{_where(c)}: data file missing or unreadable "
                             f"({exc.strerror})" for c in cs]
                progress.update(sum(c.loc.length for c in cs))
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                size = os.fstat(fd).st_size
                for c in cs:
                    if c.loc.length > len(buf):
                        buf = memoryview(bytearray(min(c.loc.length, c.loc.block)))
                    problems += _verify_chunk(fd, size, c, buf, progress)
            finally:
                os.close(fd)
    finally:
        progress.close()
    nchunks = sum(len(cs) for cs in by_file.values())
    if problems:
        print(f"FAILED: {path}: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"OK: {path}: {nchunks} stored chunks, {total} bytes ({format_size(total)}) in "
          f"{len(by_file)} files match their checksums")
    return 0


# -- export -------------------------------------------------------------------------------------
def _open_data(path: Path) -> int:
    """Open a data file for reading: no symlinks, and a regular file (a FIFO must not hang)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def _read_chunk(path: Path, c: _Chunk, fds: dict[str, int], verify: bool) -> torch.Tensor:
    """A stored chunk's bytes as a uint8 tensor, checked against its checksums."""
    loc = c.loc
    if loc.file not in fds:
        try:
            fds[loc.file] = _open_data(path / loc.file)
        except OSError as exc:
            raise CheckpointCorruptError(
                f"{path}: {_where(c)}: data file missing or unusable ({exc.strerror})") from None
    buf = torch.empty(loc.length, dtype=torch.uint8)
    mem = memoryview(buf.numpy()).cast("B")
    if _pread_into(fds[loc.file], mem, loc.offset) != loc.length:
        raise CheckpointCorruptError(f"{path}: {_where(c)}: data file is truncated")
    if verify:
        for k, b0, b1 in _blocks(loc):
            if k >= len(loc.checksums) or xxhash.xxh3_64_intdigest(mem[b0:b1]) != loc.checksums[k]:
                raise CheckpointCorruptError(
                    f"{path}: {_where(c)}: checksum mismatch in item bytes {b0}..{b1}")
    return buf


def _assemble(path: Path, md: TensorStorageMetadata, stored: list[_Chunk],
              fds: dict[str, int], verify: bool) -> torch.Tensor:
    """The full tensor, every stored chunk copied into place."""
    dtype = md.properties.dtype
    full = torch.empty(tuple(md.size), dtype=dtype)
    where = {c.offsets: c for c in stored}
    covered = 0
    for chunk in md.chunks:
        c = where.get(tuple(chunk.offsets))
        if c is None:
            raise CheckpointCorruptError(
                f"{path}: .metadata has no location for chunk {list(chunk.offsets)} of "
                f"{stored[0].fqn if stored else '?'}")
        sizes = tuple(chunk.sizes)
        if math.prod(sizes) * dtype.itemsize != c.loc.length:
            raise CheckpointCorruptError(f"{path}: {_where(c)}: {c.loc.length} bytes stored for "
                                         f"a {dtype} chunk of shape {list(sizes)}")
        data = _read_chunk(path, c, fds, verify).view(dtype).view(sizes)
        dst = full
        for dim, (o, n) in enumerate(zip(chunk.offsets, sizes, strict=True)):
            dst = dst.narrow(dim, o, n)
        dst.copy_(data)
        covered += math.prod(sizes)
    if covered != full.numel():
        raise CheckpointCorruptError(f"{path}: chunks of {stored[0].fqn!r} cover {covered} of "
                                     f"{full.numel()} elements")
    return full


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_bytes`` (one tensor may exceed it)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes.items():
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def cmd_export(args: argparse.Namespace) -> int:
    """Write full tensors as Hugging Face-style safetensors file(s)."""
    from safetensors.torch import save_file

    path, out = Path(args.path), Path(args.out)
    max_bytes = parse_size(args.max_shard_size, name="--max-shard-size")
    md, chunks = _load(path)
    selected: dict[str, tuple[str, TensorStorageMetadata]] = {}  # out name -> (fqn, md)
    skipped_bytes, skipped_dtype = [], []
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        if not fqn.startswith(args.prefix):
            continue
        if not isinstance(smd, TensorStorageMetadata):
            skipped_bytes.append(fqn)
        elif smd.properties.dtype not in SAFETENSORS_DTYPES:
            skipped_dtype.append(f"{fqn} ({_dtype_name(smd.properties.dtype)})")
        else:
            selected[fqn[len(args.prefix):]] = (fqn, smd)
    if skipped_bytes:
        print(f"note: skipped {len(skipped_bytes)} non-tensor item(s): "
              f"{', '.join(skipped_bytes)}", file=sys.stderr)
    if skipped_dtype:
        print(f"warning: skipped {len(skipped_dtype)} tensor(s) with dtypes safetensors cannot "
              f"hold: {', '.join(skipped_dtype)}", file=sys.stderr)
    if not selected:
        print(f"error: {path}: no tensors to export", file=sys.stderr)
        return 1
    nbytes = {name: math.prod(smd.size) * smd.properties.dtype.itemsize
              for name, (_, smd) in selected.items()}
    shards = _plan_shards(nbytes, max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    out.mkdir(parents=True, exist_ok=True)
    total = sum(nbytes.values())
    progress = _Progress(total, "exporting", not args.quiet)
    fds: dict[str, int] = {}
    try:
        for file, shard in zip(names, shards, strict=True):
            tensors = {}
            for name in shard:
                fqn, smd = selected[name]
                tensors[name] = _assemble(path, smd, chunks.get(fqn, []), fds, not args.no_verify)
                progress.update(nbytes[name])
            save_file(tensors, str(out / file), metadata={"format": "pt"})
    finally:
        progress.close()
        for fd in fds.values():
            os.close(fd)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, s in zip(names, shards, strict=True) for n in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"exported {len(selected)} tensors, {total} bytes ({format_size(total)}) to {out} "
          f"in {len(shards)} file(s): {', '.join(names)}")
    return 0


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dcp_datastates`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m dcp_datastates",
        description="Tools for checkpoints written by dcp_datastates.DataStatesWriter.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=description)
        p.add_argument("path", metavar="PATH", help="checkpoint directory (holds .metadata)")
        return p

    p = add("inspect", "list the items and data files of a checkpoint",
            "Inspect a checkpoint: list every item (fqn, kind, dtype, global shape, number of "
            "stored chunks, bytes, data file(s)), then each data file with its size and item "
            "count, then totals. Reads only .metadata and file sizes.")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "re-read all data and check every checksum",
            "Verify a checkpoint: read every stored byte and check it against the XXH3-64 "
            "block checksums in .metadata. Exits 0 when everything matches, 1 (with file, item "
            "and byte range of each problem) on a mismatch, a missing or a truncated file.")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)

    p = add("export", "write full tensors as Hugging Face-style safetensors",
            "Export a checkpoint to consolidated safetensors: every tensor is stitched from its "
            "stored chunks into its full global shape. Writes model.safetensors, or, above "
            "--max-shard-size, model-0000i-of-0000N.safetensors files plus "
            "model.safetensors.index.json. Non-tensor items and dtypes safetensors cannot hold "
            "are skipped with a note.")
    p.add_argument("out", metavar="OUT", help="output directory (created if needed)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest output file, e.g. 5GB, 500MiB, bytes (default: 5GB)")
    p.add_argument("--prefix", default="",
                   help="export only keys starting with this prefix, with it stripped "
                        "(e.g. 'model.')")
    p.add_argument("--no-verify", action="store_true", help="skip checksum checks while reading")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
