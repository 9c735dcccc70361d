"""dcp_datastates: nearly free checkpoints for PyTorch Distributed Checkpoint (DCP).

Lazy host snapshots into a reusable host cache, flushed to safetensors files through io_uring
(or a thread pool where io_uring cannot be used), and restored on the same path backwards.
"""

from .engine import Engine, default_engine
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    DamagedStepError,
    DataStatesError,
    StateDictMismatchError,
    TierFullError,
    UringUnavailable,
    WorldSizeChangedError,
)
from .guard import guard
from .reader import DataStatesReader
from .sizes import parse_size
from .tiers import CheckpointManager
from .writer import DataStatesWriter

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "DamagedStepError",
    "DataStatesError",
    "DataStatesReader",
    "DataStatesWriter",
    "Engine",
    "default_engine",
    "guard",
    "parse_size",
    "StateDictMismatchError",
    "TierFullError",
    "UringUnavailable",
    "WorldSizeChangedError",
]
