"""File I/O engines: io_uring through a C shim, with a thread-pool fallback.

:func:`make_backend` builds one; the environment variable ``DCP_DATASTATES_IO`` (``auto``,
``uring`` or ``threads``) overrides the name passed in.
"""

from __future__ import annotations

import os

from ..errors import UringUnavailable
from .base import IOBackend, IOReq
from .threads import ThreadPoolBackend
from .uring import UringBackend

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "FALLBACK",
    "IOBackend",
    "IOReq",
    "ThreadPoolBackend",
    "UringBackend",
    "check_backend_name",
    "make_backend",
]

BACKENDS = ("auto", "uring", "threads")
#: In :func:`make_backend`'s message where ``auto`` could not use io_uring (worth a warning).
FALLBACK = "falling back to the thread-pool I/O backend"
ENV_VAR = "DCP_DATASTATES_IO"


def check_backend_name(name: str) -> str:
    """``name`` if it names a backend (``$DCP_DATASTATES_IO`` is not consulted), else ValueError."""
    if name.strip().lower() not in BACKENDS:
        raise ValueError(f"unknown I/O backend {name!r}; valid names: {', '.join(BACKENDS)}")
    return name


def make_backend(name: str = "auto") -> tuple[IOBackend, str]:
    """A new backend called ``name`` (``$DCP_DATASTATES_IO`` wins when set) and a one-line
    message describing the choice, for the caller to log once; the caller closes the backend.

    ``auto`` prefers io_uring and falls back to threads. ``uring`` raises
    :class:`UringUnavailable` (with the reason) when io_uring cannot be used.
    """
    env = os.environ.get(ENV_VAR)
    name = check_backend_name(env or name).strip().lower()
    why = f" ({ENV_VAR}={env})" if env else ""
    if name == "threads":
        return ThreadPoolBackend(), f"dcp_datastates: using the thread-pool I/O backend{why}"
    try:
        return UringBackend(), f"dcp_datastates: using the io_uring I/O backend{why}"
    except UringUnavailable as e:
        if name == "uring":
            raise
        msg = f"dcp_datastates: {e.reason}; {FALLBACK}"
        return ThreadPoolBackend(), msg
