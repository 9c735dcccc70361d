"""A two-rank job that starts an async save and destroys the process group at once, as the last
lines of a torchrun script do; started by ``tests/test_teardown.py``. Not a test module.

Each rank saves items of its own (``rank<r>``) and a tensor both hold alike into
``<root>/ckpt`` with a fresh ``DataStatesWriter()``, does not wait, then calls
``dist.destroy_process_group()`` and exits."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {f"rank{rank}": torch.full((8 << 20,), float(rank)), "both": torch.arange(1000)}
    dcp.async_save(state, checkpoint_id=root / "ckpt", storage_writer=DataStatesWriter())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
