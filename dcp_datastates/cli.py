"""``python -m dcp_datastates``: inspect, verify and export DataStates checkpoints; persist
what a job left in its memory tiers."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .checksums import memory_at
from .errors import CheckpointCorruptError, CheckpointError
from .file_format import (
    PAD_PREFIX,
    SAFETENSORS_DTYPES,
    ItemSpec,
    entry_key,
    entry_mismatch,
    export_header,
    layout_mismatch,
    read_file_header,
)
from .jobs.load import check_locations, stored_spec
from .jobs.save import entry_name
from .metadata_file import ItemLocation, open_regular, read_metadata
from .sizes import format_size, parse_size


@dataclass(frozen=True)
class _Chunk:
    """One stored piece of an item: its DCP index and its location."""

    index: MetadataIndex
    loc: ItemLocation

    @property
    def fqn(self) -> str:
        return self.index.fqn

    @property
    def offsets(self) -> tuple[int, ...] | None:
        """The chunk's offsets in the full tensor (None for bytes items)."""
        return None if self.index.offset is None else tuple(self.index.offset)


def _path(arg: str) -> Path:
    return Path(os.path.expanduser(arg))


def _load(path: Path) -> tuple[Metadata, dict[str, list[_Chunk]]]:
    """The checkpoint's metadata and its stored chunks grouped by fqn."""
    md = read_metadata(path)
    check_locations(path, md)
    chunks: dict[str, list[_Chunk]] = defaultdict(list)
    for index, loc in md.storage_data.items():
        chunks[index.fqn].append(_Chunk(index, loc))
    return md, chunks


def _spec(path: Path, md: Metadata, c: _Chunk) -> ItemSpec:
    """The chunk as ``.metadata`` describes it (raises where ``.metadata`` contradicts itself)."""
    tensor = isinstance(md.state_dict_metadata.get(c.fqn), TensorStorageMetadata)
    return stored_spec(md, c.index, c.loc, tensor, f"{path}: {_where(c)}")


def _tiling_problem(tmd: TensorStorageMetadata) -> str | None:
    """How a tensor's chunks in ``.metadata`` fail to tile its global shape (a DCP save's
    always do): one lying outside it, two overlapping, or a part no chunk covers."""
    size = tuple(tmd.size)
    boxes = []
    for c in tmd.chunks:
        off, n = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(size) or len(n) != len(size) or any(
                o < 0 or k < 0 or o + k > d for o, k, d in zip(off, n, size, strict=True)):
            return (f"chunk at {list(off)} of shape {list(n)} lies outside the tensor's shape "
                    f"{list(size)}")
        boxes.append((off, n))
    boxes.sort()
    for i, (o, n) in enumerate(boxes):
        for o2, n2 in boxes[i + 1:]:
            if size and o2[0] >= o[0] + n[0]:
                break  # sorted: no later chunk reaches back into this one
            if math.prod(n) and math.prod(n2) and all(
                    a < b + m and b < a + k for a, k, b, m in zip(o, n, o2, n2, strict=True)):
                return f"chunks at {list(o)} and {list(o2)} overlap"
    covered, numel = sum(math.prod(n) for _, n in boxes), math.prod(size)
    if covered != numel:
        return f"chunks cover {covered} of its {numel} elements"
    return None


def _tiling_problems(path: Path, md: Metadata, fqns: Iterable[str]) -> list[str]:
    """``_tiling_problem`` of each tensor of ``fqns``, as "<path>: item '<fqn>': <why>"."""
    problems = []
    for fqn in fqns:
        tmd = md.state_dict_metadata.get(fqn)
        if isinstance(tmd, TensorStorageMetadata) and (why := _tiling_problem(tmd)) is not None:
            problems.append(f"{path}: item {fqn!r}: {why}")
    return problems


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
        size, problem = _file_size(path / name)
        files_out.append({"name": name, "size": size, "problem": problem,
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


def _file_size(f: Path) -> tuple[int | None, str | None]:
    """(size, None) of a usable data file, else (None, what is wrong with it)."""
    try:
        fd = open_regular(f)
    except OSError as exc:
        return None, exc.strerror
    try:
        return os.fstat(fd).st_size, None
    finally:
        os.close(fd)


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
    data = _inspect_data(_path(args.path))
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
        size = "-" if f["size"] is None else f"{f['size']} ({format_size(f['size'])})"
        frows.append([f["name"], size, str(f["items"])])
    print(_table(frows, {2}))
    for f in data["files"]:
        if f["problem"] is not None:
            print(f"warning: data file {f['name']} {f['problem']}", file=sys.stderr)
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
    """Problems found in one stored chunk's bytes: truncation and checksum mismatches."""
    loc = c.loc
    if loc.offset + loc.length > size:
        progress.update(loc.length)
        return [f"{_where(c)}: truncated: needs file bytes {loc.offset}.."
                f"{loc.offset + loc.length}, the file has {size}"]
    problems = []
    for k, b0, b1 in _blocks(loc):
        mem = buf[: b1 - b0]
        got = _pread_into(fd, mem, loc.offset + b0)
        progress.update(b1 - b0)
        if got != b1 - b0 or xxhash.xxh3_64_intdigest(mem) != loc.checksums[k]:
            problems.append(f"{_where(c)}: checksum mismatch in item bytes {b0}..{b1} "
                            f"(file bytes {loc.offset + b0}..{loc.offset + b1})")
    return problems


def _header_problems(path: Path, md: Metadata, name: str, fd: int, size: int,
                     cs: list[_Chunk]) -> list[str]:
    """Where file ``name``'s safetensors header disagrees with ``.metadata``: each item's
    dtype, shape and data offsets, entries ``.metadata`` does not know, the file's size."""
    try:
        data_start, header = read_file_header(fd, size, f"file {name}")
    except CheckpointCorruptError as exc:
        return [str(exc)]
    problems = []
    if (why := layout_mismatch(header, data_start, size)) is not None:
        problems.append(f"file {name}: {why}")
    for c in cs:
        try:
            why = entry_mismatch(header, data_start, _spec(path, md, c), c.loc.offset)
        except CheckpointCorruptError as exc:  # .metadata contradicts itself
            problems.append(str(exc))
            continue
        if why is not None:
            problems.append(f"{_where(c)}: header does not match .metadata: {why}")
    known = {entry_key(entry_name(c.index)) for c in cs}
    problems += [f"file {name}: the header has an entry {key!r} that .metadata does not list"
                 for key in header if key != "__metadata__" and key not in known
                 and not key.startswith(PAD_PREFIX)]
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every data file's header against ``.metadata``, and re-read every stored byte
    against the checksums in ``.metadata``."""
    path = _path(args.path)
    md, chunks = _load(path)
    by_file: dict[str, list[_Chunk]] = defaultdict(list)
    for cs in chunks.values():
        for c in cs:
            by_file[c.loc.file].append(c)
    total = sum(c.loc.length for cs in by_file.values() for c in cs)
    block = max((c.loc.block for cs in by_file.values() for c in cs), default=1)
    buf = memoryview(bytearray(min(block, max(total, 1))))
    progress = _Progress(total, "verifying", not args.quiet)
    problems = _tiling_problems(path, md, sorted(md.state_dict_metadata))
    try:
        for name in sorted(by_file):
            cs = sorted(by_file[name], key=lambda c: c.loc.offset)
            try:
                fd = open_regular(path / name)
            except OSError as exc:
                problems.append(f"file {name} {exc.strerror} ({len(cs)} stored chunks live "
                                f"there)")
                progress.update(sum(c.loc.length for c in cs))
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                size = os.fstat(fd).st_size
                problems += _header_problems(path, md, name, fd, size, cs)
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
          f"{len(by_file)} files match their headers and checksums")
    return 0


# -- export -------------------------------------------------------------------------------------
def _read_chunk(path: Path, c: _Chunk, fds: dict[str, int], verify: bool) -> torch.Tensor:
    """A stored chunk's bytes as a uint8 tensor, checked against its checksums."""
    loc = c.loc
    if loc.file not in fds:
        try:
            fds[loc.file] = open_regular(path / loc.file)
        except OSError as exc:
            raise CheckpointCorruptError(
                f"{path}: {_where(c)}: the data file {exc.strerror}") from None
    buf = torch.empty(loc.length, dtype=torch.uint8)
    mem = memory_at(buf.data_ptr(), loc.length)
    if _pread_into(fds[loc.file], mem, loc.offset) != loc.length:
        raise CheckpointCorruptError(f"{path}: {_where(c)}: data file is truncated")
    if verify:
        for k, b0, b1 in _blocks(loc):
            if xxhash.xxh3_64_intdigest(mem[b0:b1]) != loc.checksums[k]:
                raise CheckpointCorruptError(
                    f"{path}: {_where(c)}: checksum mismatch in item bytes {b0}..{b1}")
    return buf


def _assemble(path: Path, md: Metadata, fqn: str, stored: list[_Chunk],
              fds: dict[str, int], verify: bool) -> torch.Tensor:
    """The full tensor ``fqn``, every stored chunk copied into place."""
    tmd = md.state_dict_metadata[fqn]
    full = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    where = {c.offsets: c for c in stored}
    covered = 0
    for chunk in tmd.chunks:
        c = where.get(tuple(chunk.offsets))
        if c is None:
            raise CheckpointCorruptError(
                f"{path}: .metadata has no location for chunk {list(chunk.offsets)} of {fqn!r}")
        spec = _spec(path, md, c)
        data = _read_chunk(path, c, fds, verify).view(spec.dtype).view(spec.shape)
        dst = full
        for dim, (o, n) in enumerate(zip(chunk.offsets, spec.shape, strict=True)):
            dst = dst.narrow(dim, o, n)
        dst.copy_(data)
        covered += math.prod(spec.shape)
    if covered != full.numel():
        raise CheckpointCorruptError(f"{path}: chunks of {fqn!r} cover {covered} of "
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


def _write_new(dest: Path, parts: Iterable[bytes | memoryview]) -> None:
    """Write ``dest`` under a temporary name, then rename it into place: whatever was at
    ``dest`` (a link, a FIFO) is replaced, never written through."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _inside(out: Path, path: Path) -> bool:
    """Whether ``out`` is the directory ``path`` or lies inside it: by name with links
    resolved, and by identity (device, inode) of each existing directory on ``out``'s way up,
    which also sees the checkpoint under another name (a bind mount)."""
    out, path = out.resolve(), path.resolve()
    if out == path or path in out.parents:
        return True
    try:
        st = path.stat()
    except OSError:
        return False
    for d in (out, *out.parents):
        try:
            o = d.stat()
        except OSError:
            continue  # not made yet
        if (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


#: What an export writes: a previous export's files of these names, not written again, go.
_EXPORT_NAME = re.compile(
    r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def _remove_stale(out: Path, written: set[str]) -> list[str]:
    """Delete an earlier export's files in ``out`` that this one did not write (a stale
    ``model.safetensors`` beside a new index would be loaded first); return their names."""
    stale = sorted(p.name for p in out.iterdir()
                   if _EXPORT_NAME.match(p.name) and p.name not in written)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    return stale


def cmd_export(args: argparse.Namespace) -> int:
    """Write full tensors as Hugging Face-style safetensors file(s)."""
    path, out = _path(args.path), _path(args.out)
    max_bytes = parse_size(args.max_shard_size, name="--max-shard-size")
    if _inside(out, path):
        print(f"error: output directory {out} is inside the checkpoint directory {path}: "
              f"export elsewhere", file=sys.stderr)
        return 1
    md, chunks = _load(path)
    selected: dict[str, str] = {}  # out name -> fqn
    skipped_bytes, skipped_dtype = [], []
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        if not fqn.startswith(args.prefix):
            continue
        if not isinstance(smd, TensorStorageMetadata):
            skipped_bytes.append(fqn)
        elif smd.properties.dtype not in SAFETENSORS_DTYPES:
            skipped_dtype.append(f"{fqn} ({_dtype_name(smd.properties.dtype)})")
        else:
            selected[fqn[len(args.prefix):]] = fqn
    if skipped_bytes:
        print(f"note: skipped {len(skipped_bytes)} non-tensor item(s): "
              f"{', '.join(skipped_bytes)}", file=sys.stderr)
    if skipped_dtype:
        print(f"warning: skipped {len(skipped_dtype)} tensor(s) with dtypes safetensors cannot "
              f"hold: {', '.join(skipped_dtype)}", file=sys.stderr)
    if not selected:
        print(f"error: {path}: no tensors to export", file=sys.stderr)
        return 1
    if problems := _tiling_problems(path, md, selected.values()):
        raise CheckpointCorruptError("\n  ".join(problems))
    specs = {}
    for name, fqn in selected.items():
        t = md.state_dict_metadata[fqn]
        dtype = t.properties.dtype
        specs[name] = ItemSpec(name, dtype, tuple(t.size), math.prod(t.size) * dtype.itemsize)
    shards = _plan_shards({name: spec.nbytes for name, spec in specs.items()}, max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    out.mkdir(parents=True, exist_ok=True)
    total = sum(spec.nbytes for spec in specs.values())
    progress = _Progress(total, "exporting", not args.quiet)
    fds: dict[str, int] = {}

    def shard_bytes(shard: list[str]) -> Iterator[bytes | memoryview]:
        """The file's header, then each full tensor, largest elements first (all aligned)."""
        order = sorted((specs[n] for n in shard), key=lambda s: (-s.dtype.itemsize, s.name))
        yield export_header(order, {"format": "pt"})
        for spec in order:
            fqn = selected[spec.name]
            full = _assemble(path, md, fqn, chunks.get(fqn, []), fds, not args.no_verify)
            yield memory_at(full.data_ptr(), spec.nbytes) if spec.nbytes else b""
            progress.update(spec.nbytes)

    try:
        for file, shard in zip(names, shards, strict=True):
            _write_new(out / file, shard_bytes(shard))
    finally:
        progress.close()
        for fd in fds.values():
            os.close(fd)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, s in zip(names, shards, strict=True) for n in s}}
        _write_new(out / "model.safetensors.index.json",
                   [(json.dumps(index, indent=2) + "\n").encode()])
        names.append("model.safetensors.index.json")
    if stale := _remove_stale(out, set(names)):
        print(f"note: removed {len(stale)} file(s) of an earlier export from {out}: "
              f"{', '.join(stale)}", file=sys.stderr)
    print(f"exported {len(selected)} tensors, {total} bytes ({format_size(total)}) to {out} "
          f"in {len(shards)} file(s): {', '.join(names[:len(shards)])}")
    return 0


# -- persist ------------------------------------------------------------------------------------
def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {text!r}")
    return step


def cmd_persist(args: argparse.Namespace) -> int:
    """Persist a step committed in memory tiers (a job that died) into the durable tier."""
    from .engine import Engine
    from .tiers.offline import persist_job

    memory = [_path(m) for m in args.memory]
    durable = _path(args.durable)
    engine = args.engine if args.engine is not None else Engine()
    try:
        outcome = persist_job(engine, memory, durable, args.step, partial=args.partial)
    finally:
        if args.engine is None:
            engine.close()
    for note in outcome.notes:
        print(f"note: {note}", file=sys.stderr)
    if not outcome.written:
        print(f"nothing to persist: {outcome.reason}")
        return 0
    ranks = sorted(src.rank for src in outcome.written)
    what = (f"step {outcome.step} ({len(ranks)} of {outcome.world_size} rank(s), "
            f"{format_size(outcome.bytes)}) in {outcome.seconds:.2f} s")
    if outcome.committed:
        print(f"persisted {what} to {outcome.target}; it is committed")
        return 0
    print(f"wrote the part(s) of rank(s) {', '.join(map(str, ranks))} of {what} to "
          f"{outcome.target}; it is committed once rank(s) "
          f"{', '.join(map(str, outcome.missing))} add theirs (run this command with --step "
          f"{outcome.step} --partial where their memory tiers are)")
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

    p = add("verify", "check every header against .metadata and every checksum",
            "Verify a checkpoint: check each data file's safetensors header against .metadata "
            "(every item's dtype, shape and data offsets, and the file's size), then read every "
            "stored byte and check it against the XXH3-64 block checksums in .metadata. Exits 0 "
            "when everything matches, 1 (naming the file, the item and what differs) on a "
            "mismatch, a missing, truncated or unusable file.")
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

    p = sub.add_parser(
        "persist", help="persist a step that a job left in its memory tiers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Persist a checkpoint that CheckpointManager committed into memory tiers but did\n"
            "not persist (the process died, or persist=None) to the durable tier, as the next\n"
            "manager on the same directories would: every rank's part is copied to\n"
            "DURABLE_DIR/step_<N> (step-<N> in a torchtitan folder set up by the adapter)\n"
            "and their metadata merged into one .metadata, committed last. Without --step:\n"
            "the newest step complete in the memory tiers given, if it is newer than every\n"
            "step committed in DURABLE_DIR.\n\n"
            "MEMORY_DIR is one rank's memory tier (holding step_<N> directories, e.g.\n"
            "/dev/shm/dcp_datastates/<hash>/rank_0) or a job's memory root holding rank_<r>\n"
            "tiers (/dev/shm/dcp_datastates/<hash>); give several to name the tiers of every\n"
            "rank. A rank's part comes from its own tier, else from a peer's replica of it\n"
            "(replicate=True), else from a part already in DURABLE_DIR/step_<N>. With the\n"
            "ranks spread over several nodes and no replicas, run it on each node with\n"
            "--step N --partial: each writes its ranks' parts, the last commits the step.\n\n"
            "Everything is checked before anything is written. Run it when no job is using\n"
            "these directories. Exits 0 when the step is persisted or nothing was needed,\n"
            "1 (naming the path) for a missing directory, a step not committed, a rank\n"
            "missing or damaged."))
    p.add_argument("memory", nargs="+", metavar="MEMORY_DIR",
                   help="a rank's memory tier, or a job's memory root of rank_<r> tiers")
    p.add_argument("durable", metavar="DURABLE_DIR",
                   help="the durable tier (CheckpointManager's durable_dir; created if its "
                        "parent exists)")
    p.add_argument("--step", type=_step, default=None,
                   help="the step to persist (default: the newest complete one)")
    p.add_argument("--partial", action="store_true",
                   help="write the parts found even if other ranks' are missing (needs --step)")
    p.set_defaults(func=cmd_persist)
    return parser


def main(argv: Sequence[str] | None = None, *, engine: Any = None) -> int:
    """Run the command line; return the exit code. ``engine``: the Engine that ``persist``
    copies with (default: one of its own)."""
    args = build_parser().parse_args(argv)
    args.engine = engine
    try:
        return args.func(args)
    except (OSError, ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
