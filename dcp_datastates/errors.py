"""Exceptions that dcp_datastates raises for checkpoints it cannot trust."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match their checksums."""
