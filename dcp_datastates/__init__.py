"""dcp_datastates: nearly free checkpoints for PyTorch Distributed Checkpoint (DCP).

Lazy host snapshots into a reusable host cache, flushed to safetensors files through io_uring
(or a thread pool where io_uring cannot be used), and restored on the same path backwards.
"""

from ._engine import Engine, default_engine
from ._guard import guard
from ._reader import DataStatesReader
from ._sizes import parse_size
from ._writer import DataStatesWriter
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
from .tiers import CheckpointManager

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
