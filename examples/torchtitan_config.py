"""A torchtitan config registry: llama3 on synthetic data, checkpointed four ways.

torchtitan's own entry takes it by module path (``--module torchtitan_config`` with this folder
on ``sys.path``; ``examples/torchtitan_train.py`` does that)::

    python -m torchtitan.train --module torchtitan_config --config datastates_tiers \\
        --training.steps 40 --checkpoint.interval 10 --dump_folder /tmp/titan

Each ``--config`` is torchtitan's llama3 trainer with the same seed, data and steps; only the
checkpointing differs:

* ``datastates_none``: no checkpoints;
* ``datastates_stock``: torchtitan's ``CheckpointManager``, ``async_mode="async_with_pinned_mem"``;
* ``datastates_enable``: the same manager, then ``enable_datastates(trainer.checkpointer)``;
* ``datastates_tiers``: ``DataStatesCheckpointManager.Config(memory_tier=True, ...)``.

The data are synthetic (no tokenizer or data set to download): each row is an arithmetic
sequence of token ids modulo the vocabulary, so the loss falls, and batch ``i`` of data rank
``r`` depends only on ``(seed, r, i)``: the dataloader's state is the number of batches taken.
The trainer prints one line per step, ``step N loss L time_s T`` (``L`` in full precision),
and at the end one JSON line ``{"summary": ...}``. This is torchtitan 0.3's registry;
``torchtitan_config_02.py`` makes the same runs with torchtitan 0.2.x.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer
from torchtitan_train import (
    ATTENTION_ENV,
    FLAVOR_ENV,
    SEED,
    RunSummary,
    StepClock,
    SyntheticBatches,
    SyntheticVocab,
)

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager, enable_datastates


class SyntheticTokenizer(SyntheticVocab, BaseTokenizer):
    """Stands in for a tokenizer: the synthetic data are token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size


class SyntheticDataLoader(SyntheticBatches, BaseDataLoader):
    """Deterministic batches of arithmetic token sequences; its state is the batch count."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        seed: int = SEED

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int,
                 tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int,
                 **_: Any) -> None:
        self.config, self.seed, self.rank = config, config.seed, dp_rank
        self.shape, self.vocab = (local_batch_size, seq_len), config.vocab_size
        self.taken = 0


class StepPrinter(StepClock, MetricsProcessor):
    """torchtitan's metrics, plus one line per step and the summary's figures."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass


class DataStatesTrainer(RunSummary, Trainer):
    """torchtitan's Trainer; ``enable_datastates`` on its checkpointer where the config asks,
    and a summary line once it has closed (checkpoints in the folder counted then)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        enable_datastates: bool = False
        """Route torchtitan's own CheckpointManager through dcp_datastates."""

        checkpoint_mode: str = "none"
        """Name of the checkpoint mode (printed in the summary)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.datastates = enable_datastates(self.checkpointer) if config.enable_datastates else None
        self.summarize(config.checkpoint_mode, Path(config.dump_folder) / config.checkpoint.folder,
                       config.checkpoint.interval if config.checkpoint.enable else None)


def _base(mode: str, checkpoint: CheckpointManager.Config, *,
          enable: bool = False) -> DataStatesTrainer.Config:
    flavor = os.environ.get(FLAVOR_ENV, "debugmodel")
    attention = os.environ.get(ATTENTION_ENV, "flex")
    model_spec = model_registry(flavor, attn_backend=attention)
    vocab = decoder_vocab_size(model_spec)
    return DataStatesTrainer.Config(
        checkpoint_mode=mode, enable_datastates=enable, model_spec=model_spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)),
        tokenizer=SyntheticTokenizer.Config(vocab_size=vocab),
        dataloader=SyntheticDataLoader.Config(vocab_size=vocab),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=4, seq_len=2048, steps=40,
                                disable_cuda_graphs=attention == "varlen"),
        metrics=StepPrinter.Config(log_freq=1),
        parallelism=ParallelismConfig(),
        checkpoint=checkpoint,
        activation_checkpoint=SelectiveAC.Config(),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=SEED, deterministic=True, deterministic_warn_only=True),
    )


def _checkpoint(cls: type = CheckpointManager, **extra: Any) -> CheckpointManager.Config:
    return cls.Config(enable=True, interval=10, async_mode="async_with_pinned_mem",
                      keep_latest_k=2, last_save_model_only=False, **extra)


def datastates_none() -> DataStatesTrainer.Config:
    """No checkpoints (the baseline)."""
    return _base("none", CheckpointManager.Config(enable=False))


def datastates_stock() -> DataStatesTrainer.Config:
    """torchtitan's own checkpointing, async with pinned memory."""
    return _base("stock", _checkpoint())


def datastates_enable() -> DataStatesTrainer.Config:
    """torchtitan's manager, routed through dcp_datastates by ``enable_datastates``."""
    return _base("enable", _checkpoint(), enable=True)


def datastates_tiers() -> DataStatesTrainer.Config:
    """``DataStatesCheckpointManager`` with the memory tier (persisted when the last persist
    is done)."""
    return _base("tiers", _checkpoint(DataStatesCheckpointManager, memory_tier=True))
