"""File I/O engines: io_uring through a C shim, with a thread-pool fallback.

``get_backend()`` picks one; the environment variable ``DCP_DATASTATES_IO`` (``auto``, ``uring``
or ``threads``) overrides the name passed in.
"""

from __future__ import annotations

import logging
import os
import threading

from .base import ALIGN, IOBackend, IOReq
from .threads import ThreadPoolBackend
from .uring import UringBackend, UringUnavailable

__all__ = [
    "ALIGN",
    "IOBackend",
    "IOReq",
    "ThreadPoolBackend",
    "UringBackend",
    "UringUnavailable",
    "check_backend_name",
    "get_backend",
]

log = logging.getLogger("dcp_datastates")

BACKENDS = ("auto", "uring", "threads")
ENV_VAR = "DCP_DATASTATES_IO"

_cache: dict[str, IOBackend] = {}
_lock = threading.Lock()
_announced = False


def check_backend_name(name: str) -> str:
    """``name`` if it names a backend (``$DCP_DATASTATES_IO`` is not consulted), else ValueError."""
    if name.strip().lower() not in BACKENDS:
        raise ValueError(f"unknown I/O backend {name!r}; valid names: {', '.join(BACKENDS)}")
    return name


def get_backend(name: str = "auto") -> IOBackend:
    """The shared backend called ``name`` (``$DCP_DATASTATES_IO`` wins when set).

    ``auto`` prefers io_uring and falls back to threads, logging the choice once per process.
    ``uring`` raises :class:`UringUnavailable` (with the reason) when io_uring cannot be used.
    """
    global _announced
    name = (os.environ.get(ENV_VAR) or name).strip().lower()
    check_backend_name(name)
    with _lock:
        if name in _cache:
            return _cache[name]
        backend: IOBackend
        if name == "threads":
            backend = ThreadPoolBackend()
        elif name == "uring":
            backend = UringBackend()
        else:
            try:
                backend = UringBackend()
                msg, level = "dcp_datastates: using the io_uring I/O backend", logging.INFO
            except UringUnavailable as e:
                backend = _cache.get("threads") or ThreadPoolBackend()
                msg = f"dcp_datastates: {e.reason}; falling back to the thread-pool I/O backend"
                level = logging.WARNING
            if not _announced:
                log.log(level, msg)
                _announced = True
        _cache[name] = backend
        _cache.setdefault(backend.name, backend)
        return backend


def _reset() -> None:
    """Close and forget cached backends and re-arm the one-time log (for tests)."""
    global _announced
    with _lock:
        backends = {id(b): b for b in _cache.values()}.values()
        _cache.clear()
        _announced = False
    for b in backends:
        b.close()
