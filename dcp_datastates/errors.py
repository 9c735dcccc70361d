"""The exceptions of dcp_datastates, all under :class:`DataStatesError`.

Each keeps the built-in bases it has always had (``StateDictMismatchError`` is a RuntimeError
and a ValueError, ``UringUnavailable`` a RuntimeError), so an ``except`` written for those still
catches it; ``except DataStatesError`` catches every one of them.
"""

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "DamagedStepError",
    "DataStatesError",
    "StateDictMismatchError",
    "TierFullError",
    "UringUnavailable",
    "WorldSizeChangedError",
]


class DataStatesError(Exception):
    """The base of every exception dcp_datastates raises of its own."""


class CheckpointError(DataStatesError):
    """A checkpoint cannot be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match their checksums."""


class DamagedStepError(CheckpointCorruptError):
    """A memory-tier checkpoint that a persist was to copy is damaged (a file missing or
    short, a checksum that fails): nothing of it is committed in the durable tier."""


class TierFullError(CheckpointError):
    """The memory tier has no room for a checkpoint; nothing was written."""


class WorldSizeChangedError(CheckpointError):
    """A restart on another number of ranks finds its steps only in memory tiers written by the
    earlier number (each holds one rank's shards, which do not reshard): they are to be persisted
    first, as a durable checkpoint reshards."""


class StateDictMismatchError(DataStatesError, RuntimeError, ValueError):
    """The state dict asks for items the checkpoint lacks, or for tensors of another shape (a
    RuntimeError and a ValueError, as DCP's own planner raised for each)."""


class UringUnavailable(DataStatesError, RuntimeError):
    """io_uring cannot be used in this process; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"io_uring backend unavailable: {reason}")
        self.reason = reason


def brief(value: object, limit: int = 200) -> str:
    """How an error shows ``value`` read from a file: its repr, cut to about ``limit``
    characters, sequences rendered only as far as shown, integers too long to print (Python
    refuses beyond 4300 digits) or to read (beyond 256 bits) by their size."""
    if isinstance(value, (tuple, list)):
        parts: list[str] = []
        for v in value:
            if sum(len(p) + 2 for p in parts) > limit:
                break
            parts.append(brief(v, limit))
        more = ", ..." if len(parts) < len(value) else ""
        text = f"[{', '.join(parts)}{more}]"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        try:
            text = repr(value)
        except ValueError:  # holds an integer too long to print
            text = f"<a {type(value).__name__} holding an integer too long to print>"
    return text if len(text) <= limit else f"{text[:limit]}..."
