"""``export``: full tensors, stitched from their stored chunks by the load job, written as
Hugging Face-style safetensors file(s), durably; or, with ``--format torch``, the whole state
dict in one ``torch.save`` file (:mod:`.export_torch`)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .._engine import Engine
from .._format.checksums import memory_at
from .._format.data_file import SAFETENSORS_DTYPES, ItemSpec, export_header, itemsize_of
from .._format.entries import tiling_problems
from .._sizes import format_size, parse_size
from ..errors import CheckpointCorruptError
from .arguments import add_command, add_quiet, cli_path, command_engine, note
from .checkpoint import (
    Chunk,
    chunk_spec,
    dtype_name,
    file_size,
    load_checkpoint,
    where,
)
from .export_torch import export_torch
from .output import OutputDir, inside
from .progress import Progress
from .reads import BATCH_BYTES, Planner, batches, chunk_reads, read

#: What an export writes: a previous export's files of these names go.
EXPORT_NAMES = re.compile(
    r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
INDEX_NAME = "model.safetensors.index.json"
#: The files a loader opens first (the others are shards the index names).
ENTRY_NAMES = frozenset({"model.safetensors", INDEX_NAME})
DEFAULT_SHARD_SIZE = "5GB"


@dataclass
class _Source:
    """What an export reads: the checkpoint, the tensors chosen (out name -> fqn and spec)."""

    engine: Engine
    path: Path
    md: Metadata
    fqns: dict[str, str]
    specs: dict[str, ItemSpec]
    verify: bool
    progress: Progress


def _read_tensors(src: _Source, names: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors ``names``, every stored chunk read into place by one load job."""
    full: dict[str, torch.Tensor] = {}
    reads: list[ReadItem] = []
    for fqn in (src.fqns[name] for name in names):
        tmd = _tensor_md(src.md, fqn)
        full[fqn] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        reads += _tensor_reads(src.md, fqn, tmd)
    planner = Planner(lambda item: _narrow(full[item.dest_index.fqn], item), src.progress)
    read(src.engine, src.path, src.md, reads, planner, src.verify)
    return {name: full[src.fqns[name]] for name in names}


def _tensor_md(md: Metadata, fqn: str) -> TensorStorageMetadata:
    """The metadata of tensor ``fqn`` (the items exported are tensors)."""
    tmd = md.state_dict_metadata[fqn]
    if not isinstance(tmd, TensorStorageMetadata):
        raise TypeError(f"{fqn!r} is not a tensor item")
    return tmd


def _tensor_reads(md: Metadata, fqn: str, tmd: TensorStorageMetadata) -> list[ReadItem]:
    """Read items of each stored chunk of tensor ``fqn``, for a target of its full shape."""
    whole = MetadataIndex(fqn, [0] * len(tmd.size))
    reads = []
    for chunk in tmd.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        loc = md.storage_data.get(index)  # none: the load job names it
        reads += chunk_reads(index, chunk.sizes, tmd.properties.dtype.itemsize,
                             1 if loc is None else loc.block, whole, chunk.offsets)
    return reads


def _narrow(t: torch.Tensor, item: ReadItem) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
        t = t.narrow(dim, o, n)
    return t


def _shard_bytes(src: _Source, shard: list[str]) -> Iterator[bytes | memoryview]:
    """A file's header, then each full tensor, largest elements first (all aligned); tensors
    read a batch at a time."""
    order = sorted((src.specs[n] for n in shard), key=lambda s: (-itemsize_of(s), s.name))
    yield export_header(order, {"format": "pt"})
    for batch in batches(((s.name, s.nbytes) for s in order), BATCH_BYTES):
        tensors = _read_tensors(src, batch)
        for name in batch:
            nbytes = src.specs[name].nbytes
            yield memory_at(tensors[name].data_ptr(), nbytes) if nbytes else b""
        del tensors  # before the next batch is read


def _select(args: argparse.Namespace, md: Metadata) -> dict[str, str]:
    """The tensors to export (out name -> fqn); a note (non-tensor items) or a warning (dtypes
    safetensors lacks) on stderr for what is skipped."""
    selected: dict[str, str] = {}
    skipped_bytes, skipped_dtype = [], []
    prefix = args.prefix
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        if not fqn.startswith(prefix):
            continue
        if not isinstance(smd, TensorStorageMetadata):
            skipped_bytes.append(fqn)
        elif smd.properties.dtype not in SAFETENSORS_DTYPES:
            skipped_dtype.append(f"{fqn} ({dtype_name(smd.properties.dtype)})")
        else:
            selected[fqn[len(prefix):]] = fqn
    if skipped_bytes:
        note(args, f"skipped {len(skipped_bytes)} non-tensor item(s): {', '.join(skipped_bytes)}")
    if skipped_dtype:
        print(f"warning: skipped {len(skipped_dtype)} tensor(s) with dtypes safetensors cannot "
              f"hold: {', '.join(skipped_dtype)}", file=sys.stderr)
    return selected


def _check_chunks(path: Path, md: Metadata, chunks: list[Chunk]) -> None:
    """Refuse, naming it, a chunk whose bytes ``.metadata`` does not describe as its shape's,
    or whose data file is missing, not a regular file or too short for it: before any tensor
    is allocated (a shape declared in ``.metadata`` is no reason to allocate it)."""
    sizes: dict[str, int] = {}
    for c in chunks:
        chunk_spec(path, md, c)
        if c.loc.file not in sizes:
            size, problem = file_size(path / c.loc.file)
            if problem is not None or size is None:
                raise CheckpointCorruptError(f"{path}: {where(c)}: the data file {problem}")
            sizes[c.loc.file] = size
        end = c.loc.offset + c.loc.length
        if end > sizes[c.loc.file]:
            raise CheckpointCorruptError(
                f"{path}: {where(c)}: truncated: needs file bytes {c.loc.offset}..{end}, the "
                f"data file has {sizes[c.loc.file]}")


def _specs(md: Metadata, fqns: dict[str, str]) -> dict[str, ItemSpec]:
    """Each exported tensor as its output file holds it."""
    specs = {}
    for name, fqn in fqns.items():
        t = _tensor_md(md, fqn)
        dtype = t.properties.dtype
        specs[name] = ItemSpec(name, dtype, tuple(t.size), math.prod(t.size) * dtype.itemsize)
    return specs


def _write(src: _Source, out: OutputDir, max_bytes: int) -> list[str]:
    """Write the shard file(s), and the index where there are several; return their names."""
    shards = batches(((name, spec.nbytes) for name, spec in src.specs.items()), max_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    for file, shard in zip(names, shards, strict=True):
        out.write(file, _shard_bytes(src, shard))
    if len(shards) > 1:
        total = sum(spec.nbytes for spec in src.specs.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, s in zip(names, shards, strict=True) for n in s}}
        out.write(INDEX_NAME, [(json.dumps(index, indent=2) + "\n").encode()])
    return names


def _cmd_export(args: argparse.Namespace) -> int:
    """Write full tensors as Hugging Face-style safetensors file(s), or (``--format torch``)
    the state dict as a ``torch.save`` file."""
    path, out_path = cli_path(args.path), cli_path(args.out)
    if args.format == "torch":
        if args.prefix or args.max_shard_size is not None:
            print("error: --prefix and --max-shard-size apply to --format safetensors only: "
                  "--format torch writes the whole state dict to one file", file=sys.stderr)
            return 1
        return export_torch(args, path, out_path)
    max_bytes = parse_size(args.max_shard_size or DEFAULT_SHARD_SIZE, name="--max-shard-size")
    if inside(out_path, path):
        print(f"error: output directory {out_path} is inside the checkpoint directory {path}: "
              f"export elsewhere", file=sys.stderr)
        return 1
    md, chunks = load_checkpoint(path, refuse_filesystem_writer=(
        "the safetensors export reads DataStatesWriter checkpoints; `export --format torch` "
        "exports this one"))
    fqns = _select(args, md)
    if not fqns:
        print(f"error: {path}: no tensors to export", file=sys.stderr)
        return 1
    if problems := tiling_problems(path, md, fqns.values()):
        raise CheckpointCorruptError("\n  ".join(problems))
    _check_chunks(path, md, [c for fqn in fqns.values() for c in chunks.get(fqn, [])])
    specs = _specs(md, fqns)
    total = sum(spec.nbytes for spec in specs.values())
    with OutputDir(out_path) as out:
        progress = Progress(total, "exporting", not args.quiet)
        try:
            with command_engine(args) as engine:
                src = _Source(engine, path, md, fqns, specs, not args.no_verify, progress)
                names = _write(src, out, max_bytes)
        finally:
            progress.close()
        stale = out.publish(EXPORT_NAMES, ENTRY_NAMES)
    if stale:
        note(args, f"removed {len(stale)} file(s) of an earlier export from {out_path}: "
                   f"{', '.join(stale)}")
    print(f"exported {len(fqns)} tensors, {total} bytes ({format_size(total)}) to {out_path} "
          f"in {len(names)} file(s): {', '.join(names)}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    p = add_command(
        sub, "export", "write full tensors as Hugging Face-style safetensors, or torch.save",
        "Export a checkpoint to consolidated safetensors: every tensor is stitched from its "
        "stored chunks into its full global shape. Writes model.safetensors, or, above "
        "--max-shard-size, model-0000i-of-0000N.safetensors files plus "
        "model.safetensors.index.json. Non-tensor items and dtypes safetensors cannot hold "
        "are skipped with a note. With --format torch, writes the whole state dict instead "
        "(nested as it was saved, every dtype, non-tensor items included) to the file OUT "
        "with torch.save, loadable by torch.load(OUT, weights_only=True) where its non-tensor "
        "items are plain Python objects; it is built in memory. --format torch also exports "
        "checkpoints of DCP's own FileSystemWriter.")
    p.add_argument("out", metavar="OUT", help="output directory (created if needed); with "
                                              "--format torch, the output file (replaced)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                   help="safetensors files (default), or one torch.save file")
    p.add_argument("--max-shard-size", default=None,
                   help=f"largest output file, e.g. 5GB, 500MiB, bytes (default: "
                        f"{DEFAULT_SHARD_SIZE})")
    p.add_argument("--prefix", default="",
                   help="export only keys starting with this prefix, with it stripped "
                        "(e.g. 'model.')")
    p.add_argument("--no-verify", action="store_true", help="skip checksum checks while reading")
    add_quiet(p)
    p.set_defaults(func=_cmd_export)
