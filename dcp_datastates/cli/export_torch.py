"""``export --format torch``: the whole state dict, nested as saved, in one ``torch.save``
file, written under a temporary name, fsynced, then renamed."""

from __future__ import annotations

import argparse
import math
import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..format.directory import fsync_dir, new_token, write_new_with
from ..reader import DataStatesReader
from ..sizes import format_size
from ..tiers.local_dcp import load_whole
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
        state = load_whole(path, reader)
    assert reader.metadata is not None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise type(exc)(f"cannot make the directory of the output file {out}: "
                        f"{exc.strerror}") from None
    write_new_with(out.parent / f".{out.name}.tmp.{new_token()}", out,
                   lambda f: torch.save(state, f))
    fsync_dir(out.parent)
    if (why := _weights_only_refusal(out)) is not None:
        print(f"warning: {out}: torch.load(weights_only=True) refuses it ({why}); "
              f"torch.load(weights_only=False) loads it, running its pickles: only if you "
              f"trust the checkpoint", file=sys.stderr)
    items, tensors, nbytes = _counts(reader.metadata)
    print(f"exported {items} items ({tensors} tensors, {nbytes} bytes of tensor data, "
          f"{format_size(nbytes)}) to {out}")
    return 0


def _weights_only_refusal(out: Path) -> str | None:
    """Why ``torch.load(out, weights_only=True)`` fails (a non-tensor item of a class it does
    not allow), or None where it loads. Tensors are mapped, not read."""
    try:
        torch.load(out, mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines
                    else type(exc).__name__)
    return None


def _counts(md: Metadata) -> tuple[int, int, int]:
    """Items, tensors and the tensors' bytes of the checkpoint."""
    tensors = [t for t in md.state_dict_metadata.values() if isinstance(t, TensorStorageMetadata)]
    nbytes = sum(math.prod(t.size) * t.properties.dtype.itemsize for t in tensors)
    return len(md.state_dict_metadata), len(tensors), nbytes
