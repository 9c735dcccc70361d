"""``inspect``: the items, the data files and the totals of a checkpoint, from ``.metadata``
and the files' sizes."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._format.metadata_file import written_by_filesystem_writer
from .._sizes import format_size
from .arguments import add_command, cli_path
from .checkpoint import dtype_name, file_size, load_checkpoint
from .tables import table


def inspect_data(path: Path) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-able data."""
    md, chunks = load_checkpoint(path)
    items: list[dict[str, Any]] = []
    per_file: dict[str, int] = defaultdict(int)
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        stored = chunks.get(fqn, [])
        files = sorted({c.file for c in stored})
        for f in files:
            per_file[f] += 1
        tensor = smd if isinstance(smd, TensorStorageMetadata) else None
        items.append({
            "fqn": fqn,
            "kind": "tensor" if tensor is not None else "bytes",
            "dtype": dtype_name(tensor.properties.dtype) if tensor is not None else None,
            "shape": list(tensor.size) if tensor is not None else None,
            "chunks": len(stored),
            "bytes": sum(c.loc.length for c in stored),
            "files": files,
        })
    files_out: list[dict[str, Any]] = []
    for name in sorted(per_file):
        size, problem = file_size(path / name)
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
    writer = "FileSystemWriter" if written_by_filesystem_writer(md) else "DataStatesWriter"
    return {"path": str(path), "writer": writer, "items": items, "files": files_out,
            "totals": totals}


def _cmd_inspect(args: argparse.Namespace) -> int:
    """Print the items, the data files and the totals."""
    data = inspect_data(cli_path(args.path))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [["fqn", "kind", "dtype", "shape", "chunks", "bytes", "file(s)"]]
    for i in data["items"]:
        shape = "-" if i["shape"] is None else str(i["shape"])
        rows.append([i["fqn"], i["kind"], i["dtype"] or "-", shape, str(i["chunks"]),
                     str(i["bytes"]), ",".join(i["files"])])
    print(table(rows, {4, 5}))
    print()
    frows = [["file", "size", "items"]]
    for f in data["files"]:
        size = "-" if f["size"] is None else f"{f['size']} ({format_size(f['size'])})"
        frows.append([f["name"], size, str(f["items"])])
    print(table(frows, {2}))
    for f in data["files"]:
        if f["problem"] is not None:
            print(f"warning: data file {f['name']} {f['problem']}", file=sys.stderr)
    if data["writer"] == "FileSystemWriter":
        print("note: a checkpoint of DCP's FileSystemWriter (no checksums): DataStatesReader "
              "loads it through DCP's FileSystemReader", file=sys.stderr)
    t = data["totals"]
    print(f"\ntotal: {t['items']} items ({t['tensors']} tensors, {t['chunks']} chunks), "
          f"{t['bytes']} item bytes ({format_size(t['bytes'])}) in {t['files']} files "
          f"of {t['file_bytes']} bytes ({format_size(t['file_bytes'])})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``inspect``."""
    p = add_command(
        sub, "inspect", "list the items and data files of a checkpoint",
        "Inspect a checkpoint: list every item (fqn, kind, dtype, global shape, number of "
        "stored chunks, bytes, data file(s)), then each data file with its size and item "
        "count, then totals. Reads only .metadata and file sizes. Checkpoints of DCP's own "
        "FileSystemWriter are listed too.")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_inspect)
