"""The 4 KiB alignment that O_DIRECT, io_uring fixed buffers and the host cache share."""

from __future__ import annotations

#: Alignment of file offsets, lengths and host buffers for O_DIRECT (bytes).
ALIGN = 4096


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align
