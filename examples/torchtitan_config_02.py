"""torchtitan 0.2.x: the four runs of ``torchtitan_config.py`` (llama3, synthetic data).

torchtitan 0.2.x has no config registry: its ``ConfigManager`` parses the command line (and a
TOML file) into one ``JobConfig``, and its trainer builds every part from a registered train
spec. ``examples/torchtitan_train.py`` runs ``torchtitan.train.main(DataStatesTrainer)`` with
``--job.custom_config_module torchtitan_config_02``: this module's ``JobConfig`` adds the
section ``datastates`` (``mode``) and ``DataStatesCheckpointManager.Config``'s fields to
``checkpoint``, and sets this example's defaults (seed, determinism, batch, schedule,
checkpoint policy), those of ``torchtitan_config.py``; importing the module registers the
train spec ``datastates_llama3`` (``--model.name``): torchtitan's llama3 with synthetic
tokens, the step printer, no validation, the attention of ``$TITAN_ATTENTION`` (``flex`` or
``sdpa``, causal), and 0.3's flavours ``1B`` and ``3B`` besides 0.2.x's own.

The modes (``--datastates.mode``; the wrapper also sets ``--checkpoint.enable`` and, for
``tiers``, ``--checkpoint.memory_tier``):

* ``none``: no checkpoints; ``stock``: torchtitan's ``CheckpointManager``,
  ``async_mode="async_with_pinned_mem"``;
* ``enable``: the same manager, then ``enable_datastates(trainer.checkpointer)``;
* ``tiers``: ``DataStatesCheckpointManager`` with ``memory_tier=True`` (0.2.x's trainer makes
  its manager as ``torchtitan.train.CheckpointManager(...)``: :class:`DataStatesTrainer` sets
  that name first).

``python -m torchtitan.train`` of 0.2.x always makes the stock trainer, so the modes need the
wrapper's ``torchtitan.train.main(DataStatesTrainer)``.
"""

# no "from __future__ import annotations": torchtitan's ConfigManager merges these dataclasses
# into its JobConfig, and tyro then resolves their fields' types outside this module
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torchtitan.train
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec, llama3_args
from torchtitan.protocols.train_spec import register_train_spec
from torchtitan_train import (
    ATTENTION_ENV,
    SEED,
    RunSummary,
    StepClock,
    SyntheticBatches,
    SyntheticVocab,
)

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager, enable_datastates

#: The train spec's name (``--model.name``).
TRAIN_SPEC = "datastates_llama3"


# -- the JobConfig (merged into torchtitan's: a section here adds to or overrides its own) ---
@dataclass
class DataStatesSection:
    mode: Literal["none", "stock", "enable", "tiers"] = "none"
    """none, stock (torchtitan's own checkpoints), enable (enable_datastates on torchtitan's
    manager) or tiers (DataStatesCheckpointManager with the memory tier)."""


@dataclass(kw_only=True)
class Checkpoint(DataStatesCheckpointManager.Config):
    interval: int = 10
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async_with_pinned_mem"
    keep_latest_k: int = 2
    last_save_model_only: bool = False


@dataclass
class Model:
    name: str = TRAIN_SPEC
    flavor: str = "debugmodel"


@dataclass
class Training:
    local_batch_size: int = 4
    seq_len: int = 2048
    steps: int = 40


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    decay_ratio: float | None = 0.8


@dataclass
class Metrics:
    log_freq: int = 1


@dataclass
class Debug:
    seed: int | None = SEED
    deterministic: bool = True
    deterministic_warn_only: bool = True


@dataclass
class JobConfig:
    datastates: DataStatesSection = field(default_factory=DataStatesSection)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    debug: Debug = field(default_factory=Debug)


# -- the train spec -------------------------------------------------------------------------
class SyntheticTokenizer(SyntheticVocab, BaseTokenizer):
    """Stands in for a tokenizer: the synthetic data are token ids already."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size


class SyntheticDataLoader(SyntheticBatches, BaseDataLoader):
    """Deterministic batches of arithmetic token sequences; its state is the batch count."""

    positions = False  # 0.2.x's llama3 takes the positions from the sequence

    def __init__(self, *, seed: int, rank: int, rows: int, length: int, vocab: int) -> None:
        self.seed, self.rank, self.shape, self.vocab = seed, rank, (rows, length), vocab
        self.taken = 0


class StepPrinter(StepClock, MetricsProcessor):
    """torchtitan's metrics, plus one line per step and the summary's figures."""


#: torchtitan 0.3's llama3 flavours 1B and 3B (Llama 3.2's shapes), which 0.2.x lacks.
SMALL_FLAVOURS = {
    "1B": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                               ffn_dim_multiplier=1.5, multiple_of=1024, rope_theta=500000),
    "3B": TransformerModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                               ffn_dim_multiplier=1.0, multiple_of=1024, rope_theta=500000),
}


def _vocab(job_config: Any) -> int:
    return {**llama3_args, **SMALL_FLAVOURS}[job_config.model.flavor].vocab_size


def build_tokenizer(job_config: Any, **_: Any) -> SyntheticTokenizer:
    return SyntheticTokenizer(_vocab(job_config))


def build_dataloader(*, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                     job_config: Any, **_: Any) -> SyntheticDataLoader:
    seed = job_config.debug.seed if job_config.debug.seed is not None else SEED
    return SyntheticDataLoader(seed=seed, rank=dp_rank, rows=job_config.training.local_batch_size,
                               length=job_config.training.seq_len, vocab=_vocab(job_config))


def build_metrics(job_config: Any, parallel_dims: Any, model_args: Any = None,
                  tag: str | None = None) -> StepPrinter:
    return StepPrinter(job_config, parallel_dims, tag)


def train_spec() -> Any:
    """torchtitan's llama3 spec with synthetic data, the step printer, no validation, and
    every flavour's attention set from ``$TITAN_ATTENTION`` (causal masks)."""
    attention = os.environ.get(ATTENTION_ENV, "flex")
    if attention not in ("flex", "sdpa"):
        raise ValueError(f"torchtitan 0.2.x runs here with flex or sdpa attention, not "
                         f"{attention!r}")
    flavours = {name: dataclasses.replace(args, attn_type=attention, attn_mask_type="causal")
                for name, args in {**llama3_args, **SMALL_FLAVOURS}.items()}
    return dataclasses.replace(get_train_spec(), model_args=flavours,
                               build_tokenizer_fn=build_tokenizer,
                               build_dataloader_fn=build_dataloader,
                               build_metrics_processor_fn=build_metrics, build_validator_fn=None)


register_train_spec(TRAIN_SPEC, train_spec())


# -- the trainer --------------------------------------------------------------------------------
class DataStatesTrainer(RunSummary, torchtitan.train.Trainer):
    """torchtitan's Trainer with ``DataStatesCheckpointManager`` where ``checkpoint.memory_tier``
    is set, ``enable_datastates`` on its manager in the mode ``enable``, and a summary line
    once it has closed (checkpoints in the folder counted then)."""

    def __init__(self, job_config: Any) -> None:
        if job_config.checkpoint.memory_tier:
            # 0.2.x's Trainer makes its manager as torchtitan.train.CheckpointManager(...)
            torchtitan.train.CheckpointManager = DataStatesCheckpointManager
        super().__init__(job_config)
        mode = job_config.datastates.mode
        self.datastates = enable_datastates(self.checkpointer) if mode == "enable" else None
        checkpoint = job_config.checkpoint
        self.summarize(mode, Path(job_config.job.dump_folder) / checkpoint.folder,
                       checkpoint.interval if checkpoint.enable else None)
