"""``export --format torch``: the whole state dict, nested as saved, in one ``torch.save``
file, written under a temporary name, fsynced, then renamed. No pickled code of the checkpoint
runs: a non-tensor item that ``torch.load(weights_only=True)`` refuses is exported as its
pickle's bytes, with a warning naming it."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._format.directory import fsync_dir, new_token, write_new_with
from .._reader import DataStatesReader
from .._sizes import format_size
from ..tiers._local_dcp import load_whole
from .arguments import command_engine
from .output import inside


def export_torch(args: argparse.Namespace, path: Path, out: Path) -> int:
    """Write checkpoint ``path``'s state dict to the file ``out`` (a file there is replaced)."""
    if out.is_dir():
        print(f"error: output file {out} is a directory: give a file name, e.g. "
              f"{out / 'model.pt'}", file=sys.stderr)
        return 1
    if inside(out.parent, path):
        print(f"error: output file {out} is inside the checkpoint directory {path}: export "
              f"elsewhere", file=sys.stderr)
        return 1
    with command_engine(args) as engine:
        reader = DataStatesReader(path, engine=engine, verify_checksums=not args.no_verify)
        state, refused = load_whole(path, reader)
    assert reader.metadata is not None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise type(exc)(f"cannot make the directory of the output file {out}: "
                        f"{exc.strerror}") from None
    write_new_with(out.parent / f".{out.name}.tmp.{new_token()}", out,
                   lambda f: torch.save(state, f))
    fsync_dir(out.parent)
    for fqn, why in sorted(refused.items()):
        print(f"warning: item '{fqn}' of {path}: torch.load(weights_only=True) refuses its "
              f"pickle ({why}): exported as its bytes, not run (torch.load(io.BytesIO(them), "
              f"weights_only=False) runs it: only if you trust the checkpoint)", file=sys.stderr)
    items, tensors, nbytes = _counts(reader.metadata)
    print(f"exported {items} items ({tensors} tensors, {nbytes} bytes of tensor data, "
          f"{format_size(nbytes)}) to {out}")
    return 0


def _counts(md: Metadata) -> tuple[int, int, int]:
    """Items, tensors and the tensors' bytes of the checkpoint."""
    tensors = [t for t in md.state_dict_metadata.values() if isinstance(t, TensorStorageMetadata)]
    nbytes = sum(math.prod(t.size) * t.properties.dtype.itemsize for t in tensors)
    return len(md.state_dict_metadata), len(tensors), nbytes
