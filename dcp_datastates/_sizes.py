"""Byte sizes written the way people write them: ``4096``, ``"512MiB"``, ``"16GiB"``; the
free bytes of a file system."""

from __future__ import annotations

import os
import re

__all__ = ["format_size", "free_bytes", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming ``name`` when it is not a size."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int or a string like '16GiB', got {value!r}")
    if isinstance(value, int):
        nbytes = value
    else:
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; write bytes or a number with one of "
                f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '16GiB')"
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return nbytes


def format_size(nbytes: float) -> str:
    """Short human form, e.g. ``'1.50 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} TiB"


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for an unprivileged writer on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
