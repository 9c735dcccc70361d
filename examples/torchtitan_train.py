"""Run torchtitan's own trainer (llama3, synthetic data) with one of four checkpoint modes.

    python examples/torchtitan_train.py --mode tiers --flavor debugmodel \\
        --training.steps 40 --checkpoint.interval 10 --dump_folder /tmp/titan

``--mode`` is ``none``, ``stock``, ``enable`` or ``tiers`` (see ``torchtitan_config.py``);
``--flavor`` a llama3 flavour (``debugmodel``, ``1B``, ``3B``, ...; 0.2.x gets 0.3's ``1B`` and
``3B`` from ``torchtitan_config_02.py``); ``--attention`` its attention backend (``flex``, the
default, ``sdpa`` with ``--cpu``; ``sdpa`` with 0.2.x; ``varlen`` with 0.3 on CUDA);
``--dump_folder`` torchtitan's output folder (``--job.dump_folder`` in 0.2.x). Every other argument
goes to torchtitan's command line as is (``--training.steps``, ``--checkpoint.interval``,
``--checkpoint.keep_latest_k``, ``--checkpoint.memory_dir``,
``--parallelism.data_parallel_shard_degree``, ``--comm.init_timeout_seconds``, ...). Run it again
with the same arguments and it resumes from the newest checkpoint in ``--dump_folder``. Started
without torchrun it runs as one rank (the environment of ``torchrun --standalone --nproc-per-node
1``); under torchrun, on every rank torchrun starts.

Both torchtitan releases the adapter supports run, each through its own entry:

* 0.3.x: ``torchtitan.train.main()`` with ``--module torchtitan_config --config
  datastates_<mode>``, exactly as ``python -m torchtitan.train`` would run it;
* 0.2.x: ``torchtitan.train.main(DataStatesTrainer)`` (``python -m torchtitan.train`` always
  makes the stock trainer) with ``--job.custom_config_module torchtitan_config_02 --model.name
  datastates_llama3 --datastates.mode <mode>`` (see ``torchtitan_config_02.py``).

Where a package torchtitan imports is not installed and the run never uses it, a stand-in is
registered first: Hugging Face ``datasets`` (the synthetic loader never loads a data set), and
with 0.2.x ``tokenizers`` (no tokenizer is loaded) and ``tensorboard`` (off), and ``triton``
(torchtitan's MoE kernels, which llama3 does not use). With torchtitan 0.3, where the
installed torch lacks what 0.3.0 (made with a torch nightly) calls:
``torch.distributed.set_timeout`` (torch's own ``_set_pg_timeout`` stands in),
``torch.distributed.fsdp.DataParallelMeshDims`` (torch < 2.12: a stand-in name and a
``fully_shard`` that drops ``dp_mesh_dims=None``) and a ``create_block_mask`` that takes
``separate_full_blocks=True`` (what older ones always do).

``--cpu`` trains on the CPU with gloo (torchtitan asks for a GPU otherwise), torchtitan 0.2.x
only (0.3's flex attention has no backward on the CPU, and it refuses sdpa): slow, for trying
the scripts on a machine without a GPU; the figures mean nothing, and ``stock`` saves with
``async_mode="async"`` there (DCP's pinned-memory stager needs an accelerator).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODES = ("none", "stock", "enable", "tiers")
#: Environment variables read when the config is made (torchtitan's CLI can override the rest).
FLAVOR_ENV, ATTENTION_ENV = "TITAN_FLAVOR", "TITAN_ATTENTION"
#: The seed of every run (weights and data).
SEED = 1234


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest (torchtitan's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--flavor", default="debugmodel", help="llama3 flavour")
    parser.add_argument("--attention", choices=("flex", "sdpa", "varlen"),
                        help="flex (sdpa with --cpu: flex has no backward on the CPU)")
    parser.add_argument("--dump_folder", default="./outputs", help="torchtitan's output folder")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (gloo)")
    args, rest = parser.parse_known_args(argv)
    args.attention = args.attention or ("sdpa" if args.cpu else "flex")
    return args, rest


#: A step's folder in torchtitan's checkpoint folder.
TITAN_STEP = re.compile(r"^step-(\d+)$")


def committed_steps(folder: Path) -> set[int]:
    """Steps of torchtitan's checkpoint ``folder`` (``step-<N>``) with a committed
    ``.metadata`` (the adapter's module is not imported: it imports torchtitan, seconds that
    a kill-and-restart check waiting on this cannot spare)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for name in names if (m := TITAN_STEP.match(name))
            and (folder / name / ".metadata").is_file()}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# -- what the runs of both releases share -----------------------------------------------------
class SyntheticBatches:
    """Deterministic batches of arithmetic token sequences modulo the vocabulary (the loss
    falls): batch ``i`` of data rank ``r`` depends only on ``(seed, r, i)``, so the loader's
    state is the number of batches taken. Set ``seed``, ``rank``, ``shape`` (rows, length),
    ``vocab`` and ``taken``; ``positions``: also give the model the positions."""

    seed: int = SEED
    rank: int = 0
    shape: tuple[int, int] = (4, 2048)
    vocab: int = 2048
    taken: int = 0
    positions: bool = True

    def batch(self, index: int) -> tuple[dict[str, Any], Any]:
        """Batch ``index`` of this data rank: (inputs, labels)."""
        import torch

        rows, length = self.shape
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + index)
        start = torch.randint(0, self.vocab, (rows, 1), generator=gen)
        stride = torch.randint(1, 8, (rows, 1), generator=gen)
        tokens = (start + stride * torch.arange(length + 1)) % self.vocab
        inputs = {"input": tokens[:, :-1]}
        if self.positions:
            inputs["positions"] = torch.arange(length).expand(rows, length).contiguous()
        return inputs, tokens[:, 1:]

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        while True:
            self.taken += 1
            yield self.batch(self.taken - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.taken = state_dict.get("taken", 0)


class SyntheticVocab:
    """Mixin for torchtitan's ``BaseTokenizer``: the synthetic data are token ids already
    (its ``__init__`` sets ``vocab_size``)."""

    vocab_size: int

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("synthetic data need no encoding")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("synthetic data need no decoding")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class StepClock:
    """Mixin for torchtitan's ``MetricsProcessor``: one line per step, ``step N loss L time_s
    T`` (the loss in full precision; the time since the previous step's line: that step's
    compute and the previous step's checkpoint save), and the figures for the summary."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_times: list[float] = []
        self.last: float | None = None
        self.first_step: int | None = None

    def log(self, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, extra_metrics: dict[str, Any] | None = None) -> None:
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        now = time.perf_counter()
        elapsed = now - self.last if self.last is not None else float("nan")
        if self.last is not None:
            self.step_times.append(elapsed)
        else:
            self.first_step = step
        self.last = now
        if rank() == 0:
            print(f"step {step} loss {float(global_avg_loss)!r} time_s {elapsed:.6f}", flush=True)

    def summary(self) -> dict[str, Any]:
        """Step-time figures (the first step, with its warm-up, is left out)."""
        times = self.step_times or [float("nan")]
        return {"first_step": self.first_step, "steps_timed": len(self.step_times),
                "mean_step_s": statistics.fmean(times), "median_step_s": statistics.median(times),
                "max_step_s": max(times), "step_times_s": self.step_times}


class RunSummary:
    """Mixin for torchtitan's ``Trainer``: notes the checkpoints committed to the folder as
    they come (``keep_latest_k`` purges old ones) and prints one JSON line ``{"summary": ...}``
    once the trainer has closed: step times, the checkpoints taken (saves due at the interval
    and the last step; with the memory tier, those it committed) and persisted
    (committed to the folder). Call ``summarize(...)`` at the end of ``__init__``."""

    def summarize(self, mode: str, folder: Path, interval: int | None) -> None:
        self.summary_mode, self.summary_folder, self.summary_interval = mode, folder, interval
        datastates = getattr(self.checkpointer, "datastates", None)
        self.summary_tiers = getattr(datastates, "tiers", None)  # closed with the trainer
        self.persisted: set[int] = set()
        self.started = time.perf_counter()

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().train_step(*args, **kwargs)
        self.persisted.update(committed_steps(self.summary_folder))
        return out

    def taken(self, first: int | None) -> tuple[list[int], list[int]]:
        """The steps from ``first`` on whose checkpoint was taken, and those the memory tier's
        overhead budget skipped (a save the tier had no room for is neither)."""
        if self.summary_interval is None or first is None:
            return [], []
        due = {s for s in range(first, self.step + 1) if s % self.summary_interval == 0}
        tiers = self.summary_tiers
        if tiers is None:
            return sorted(due | {self.step}), []
        committed = {f.step for f in tiers.history if not f.skipped}
        skipped = {f.step for f in tiers.history if f.skipped}
        # the last step's checkpoint is written straight to the folder, not through the tier
        return sorted((due & committed) | {self.step}), sorted(due & skipped)

    def close(self) -> None:
        super().close()
        metrics = getattr(self, "metrics_processor", None)
        if rank() != 0 or not isinstance(metrics, StepClock) or not hasattr(self, "started"):
            return
        self.persisted.update(committed_steps(self.summary_folder))
        taken, skipped = self.taken(metrics.first_step)
        summary = {"mode": self.summary_mode, "interval": self.summary_interval,
                   "steps": self.step, "checkpoints_taken": taken,
                   "checkpoints_skipped": skipped,
                   "checkpoints_persisted": sorted(self.persisted),
                   "wall_s": time.perf_counter() - self.started, **metrics.summary()}
        print(json.dumps({"summary": summary}), flush=True)


# -- stand-ins and shims --------------------------------------------------------------------
def _missing(name: str) -> bool:
    return name not in sys.modules and importlib.util.find_spec(name) is None


def _refuse(what: str) -> Any:
    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError(f"{what} is not installed (a stand-in is): this run must not use it")

    return refuse


def stand_ins_for_missing_packages() -> list[str]:
    """Register stand-ins for the packages torchtitan imports that this run never uses, where
    they are not installed; returns their names."""
    made = []
    if _missing("datasets"):
        stand_in = types.ModuleType("datasets")
        stand_in.Dataset = type("Dataset", (), {})
        stand_in.IterableDataset = type("IterableDataset", (), {})
        stand_in.load_dataset = _refuse("Hugging Face datasets")
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = _refuse("Hugging Face datasets")
        stand_in.distributed = distributed
        sys.modules.update({"datasets": stand_in, "datasets.distributed": distributed})
        made.append("datasets")
    if _missing("tokenizers"):  # torchtitan 0.2.x's components/tokenizer.py
        stand_in = types.ModuleType("tokenizers")
        stand_in.Tokenizer = type("Tokenizer", (), {"from_file": staticmethod(
            _refuse("Hugging Face tokenizers"))})
        stand_in.AddedToken = type("AddedToken", (), {"__init__": _refuse(
            "Hugging Face tokenizers")})
        sys.modules["tokenizers"] = stand_in
        made.append("tokenizers")
    if _missing("tensorboard") and "torch.utils.tensorboard" not in sys.modules:
        stand_in = types.ModuleType("torch.utils.tensorboard")
        stand_in.SummaryWriter = type("SummaryWriter", (), {"__init__": _refuse("tensorboard")})
        sys.modules["torch.utils.tensorboard"] = stand_in
        made.append("tensorboard")
    if _missing("triton"):  # torchtitan imports its MoE kernels with every model
        for name in TRITON_KERNELS:
            sys.modules.setdefault(name, _Kernels(name))
        made.append("triton")
    return made


#: torchtitan's modules of triton kernels that its trainer imports (0.2.x, 0.3.x).
TRITON_KERNELS = ("torchtitan.models.moe.kernels",
                  "torchtitan.distributed.minimal_async_ep.kernels")


class _Kernels(types.ModuleType):
    """Stands in for a module of triton kernels: every name refuses to run."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _refuse("triton")


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


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` with what torchtitan asks of a device module (names, memory figures)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*_: object) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(*_: object) -> Any:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(total_memory=pages * size, name="cpu")

    @staticmethod
    def memory_stats(*_: object) -> dict[str, int]:
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def set_device(*_: object) -> None:
        pass

    reset_peak_memory_stats = empty_cache = synchronize = set_device


def cpu_as_the_device() -> None:
    """Make torchtitan (imported after this) pick the CPU as its device, with gloo; FSDP2's
    gradient reductions then sum (gloo has no PREMUL_SUM or AVG)."""
    import torch._utils
    from torch.distributed.fsdp import FSDPModule

    cpu = _CpuDevice("cpu_device")
    torch._utils._get_available_device_type = lambda: "cpu"
    get_module = torch._utils._get_device_module
    torch._utils._get_device_module = lambda kind: cpu if kind == "cpu" else get_module(kind)
    set_factor = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


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


def legacy_arguments(mode: str, flavor: str, cpu: bool = False) -> list[str]:
    """torchtitan 0.2.x's command line for ``mode`` (this example's JobConfig and train spec;
    the checkpoint policy of torchtitan_config.py's modes). On the CPU, ``stock`` saves with
    ``async_mode="async"``: DCP's pinned-memory stager needs an accelerator."""
    args = ["--job.custom_config_module", "torchtitan_config_02",
            "--model.name", "datastates_llama3", "--model.flavor", flavor,
            "--datastates.mode", mode]
    if mode != "none":
        args.append("--checkpoint.enable")
    if mode == "tiers":
        args.append("--checkpoint.memory_tier")
    if mode == "stock" and cpu:
        args += ["--checkpoint.async_mode", "async"]
    return args


def legacy_release() -> bool:
    """Whether the torchtitan installed is 0.2.x (0.1 and older are not supported), read from
    its metadata: torchtitan 0.2.x's ``ConfigManager`` takes ``sys.argv`` when it is imported,
    so the command line is set before."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("torchtitan")
    except PackageNotFoundError:
        return False  # a source checkout: the import says
    return tuple(int(x) for x in release.split(".")[:2] if x.isdigit()) < (0, 3)


def main(argv: list[str] | None = None) -> None:
    args, titan_args = parse(sys.argv[1:] if argv is None else argv)
    os.environ[FLAVOR_ENV], os.environ[ATTENTION_ENV] = args.flavor, args.attention
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the config modules
    legacy = legacy_release()
    if legacy:
        sys.argv = [sys.argv[0], *legacy_arguments(args.mode, args.flavor, args.cpu),
                    "--job.dump_folder", args.dump_folder, *titan_args]
    else:
        sys.argv = [sys.argv[0], "--module", "torchtitan_config", "--config",
                    f"datastates_{args.mode}", "--dump_folder", args.dump_folder, *titan_args]
    stand_ins_for_missing_packages()
    if not legacy:  # what torchtitan 0.3.0 takes from a newer torch
        set_timeout_where_missing()
        fsdp_names_where_missing()
        block_mask_where_old()
    if args.cpu:
        cpu_as_the_device()
    single_process_world()
    import torchtitan.train

    from dcp_datastates.integrations.torchtitan import TORCHTITAN

    if TORCHTITAN.manager is None:
        raise SystemExit(f"torchtitan cannot be imported: {TORCHTITAN.error}")
    if TORCHTITAN.legacy != legacy:
        raise SystemExit(f"torchtitan {TORCHTITAN.version}: its metadata and its API disagree")
    if legacy:
        from torchtitan_config_02 import DataStatesTrainer

        torchtitan.train.main(DataStatesTrainer)
    else:
        torchtitan.train.main()


if __name__ == "__main__":
    main()
