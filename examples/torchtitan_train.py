"""Run torchtitan's own trainer (llama3, synthetic data) with one of four checkpoint modes.

    python examples/torchtitan_train.py --mode tiers --flavor debugmodel \\
        --training.steps 40 --checkpoint.interval 10 --dump_folder /tmp/titan

``--mode`` is ``none``, ``stock``, ``enable`` or ``tiers`` (see ``torchtitan_config.py``);
``--flavor`` a llama3 flavour (``debugmodel``, ``1B``, ``3B``, ...); ``--attention`` its
attention backend (``flex``, the default, or ``varlen``, CUDA only). Every other argument goes
to torchtitan's command line as is (``--training.steps``, ``--checkpoint.interval``,
``--checkpoint.keep_latest_k``, ``--dump_folder``, ``--comm.init_timeout_seconds``, ...); the
run is then ``torchtitan.train.main()`` with ``--module torchtitan_config --config
datastates_<mode>``, exactly as ``python -m torchtitan.train`` would run it. Run it again with
the same arguments and it resumes from the newest checkpoint in ``--dump_folder``. Started
without torchrun it runs as one rank (the environment of ``torchrun --standalone
--nproc-per-node 1``); under torchrun, on every rank torchrun starts.

torchtitan imports Hugging Face ``datasets`` for its own data loaders; where that package is
not installed (the GPU machine carries only the wheels in ``wheels/``), a stand-in module that
refuses to load anything is registered first: the synthetic loader never calls it. Where the
installed torch lacks ``torch.distributed.set_timeout`` (torchtitan 0.3.0 was made with a torch
nightly that has it), torch's own ``_set_pg_timeout`` stands in for it; where it lacks
``torch.distributed.fsdp.DataParallelMeshDims`` (torch < 2.12), a stand-in name and a
``fully_shard`` that drops torchtitan's ``dp_mesh_dims=None`` do, and a ``create_block_mask``
that drops ``separate_full_blocks=True`` (what older ones always do).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import types
from pathlib import Path

MODES = ("none", "stock", "enable", "tiers")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest (torchtitan's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--flavor", default="debugmodel", help="llama3 flavour")
    parser.add_argument("--attention", default="flex", choices=("flex", "varlen"))
    return parser.parse_known_args(argv)


def committed_steps(folder: Path) -> set[int]:
    """Steps of torchtitan's checkpoint ``folder`` (``step-<N>``) with a committed
    ``.metadata``."""
    from dcp_datastates.integrations.torchtitan import TORCHTITAN_STEP

    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for name in names if (m := TORCHTITAN_STEP.match(name))
            and (folder / name / ".metadata").is_file()}


def stand_in_for_datasets() -> None:
    """Register a ``datasets`` module that loads nothing, where the package is missing."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("Hugging Face datasets is not installed: use the synthetic loader")

    stand_in = types.ModuleType("datasets")
    stand_in.Dataset = type("Dataset", (), {})
    stand_in.IterableDataset = type("IterableDataset", (), {})
    stand_in.load_dataset = refuse
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = refuse
    stand_in.distributed = distributed
    sys.modules.update({"datasets": stand_in, "datasets.distributed": distributed})


def set_timeout_where_missing() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` (a torch nightly's), which the
    torch releases lack: give it torch's own ``_set_pg_timeout``, which does the same."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout


def fsdp_names_where_missing() -> None:
    """torchtitan 0.3.0 passes ``dp_mesh_dims`` (None unless its full-DTensor mode is on) to
    ``fully_shard`` and imports ``DataParallelMeshDims`` (torch >= 2.12): on an older torch,
    a stand-in name and a ``fully_shard`` that drops the argument while it is None."""
    import functools

    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return
    shard = fsdp.fully_shard

    @functools.wraps(shard)
    def fully_shard(module, *args, dp_mesh_dims=None, edp_mesh_dims=None, **kwargs):
        if dp_mesh_dims is not None or edp_mesh_dims is not None:
            raise NotImplementedError("this torch's fully_shard takes no mesh dims")
        return shard(module, *args, **kwargs)

    fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
    fsdp.fully_shard = fully_shard


def block_mask_where_old() -> None:
    """torchtitan 0.3.0 passes ``separate_full_blocks`` to flex attention's
    ``create_block_mask`` (torch >= 2.12); older ones always separate full blocks (its
    default): a ``create_block_mask`` that drops the argument while it asks for that."""
    import functools
    import inspect

    import torch.nn.attention.flex_attention as flex

    make = flex.create_block_mask
    if "separate_full_blocks" in inspect.signature(make).parameters:
        return

    @functools.wraps(make)
    def create_block_mask(*args, separate_full_blocks=True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError("this torch's create_block_mask always separates them")
        return make(*args, **kwargs)

    flex.create_block_mask = create_block_mask


def single_process_world() -> None:
    """Without torchrun: the environment of a one-process torchrun (``--standalone``)."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})


def main(argv: list[str] | None = None) -> None:
    args, titan_args = parse(sys.argv[1:] if argv is None else argv)
    os.environ["TITAN_FLAVOR"], os.environ["TITAN_ATTENTION"] = args.flavor, args.attention
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # torchtitan_config
    stand_in_for_datasets()
    set_timeout_where_missing()
    fsdp_names_where_missing()
    block_mask_where_old()
    single_process_world()
    from torchtitan.train import main as titan_main

    sys.argv = [sys.argv[0], "--module", "torchtitan_config", "--config",
                f"datastates_{args.mode}", *titan_args]
    titan_main()


if __name__ == "__main__":
    main()
