"""DCP's side as the benchmarks run it: the pinned stager, and the futures of a response."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def futures(response: object) -> tuple[Future | None, Future]:
    """(snapshot taken, checkpoint durable) of what ``dcp.async_save`` returned; a bare Future
    (DCP staged in line, inside the call) has no snapshot future."""
    return (getattr(response, "staging_completion", None),
            getattr(response, "upload_completion", response))


def async_save_pinned(state: dict, path: Path, gpu: bool) -> object:
    """``dcp.async_save`` with FileSystemWriter and DCP's fastest stager: pinned memory, async
    staging, non-blocking copies (GPU only); on the default process group where there is one.

    A fresh stager per save, closed once durable: reusing one raises KeyError(<class 'type'>)
    in torch 2.11's StateDictStager deep copy (seen on the H100 machine).
    """
    stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=gpu))
    resp = dcp.async_save(state, checkpoint_id=path, storage_writer=FileSystemWriter(path),
                          async_stager=stager, no_dist=not dist.is_initialized())
    futures(resp)[1].add_done_callback(lambda _: stager.close())
    return resp
