"""Keyword checks of the public constructors: an option that moved, a misspelt one, or an
option passed where the path goes raises a TypeError that says what to pass instead."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ENGINE_OPTIONS", "FILESYSTEM_OPTIONS", "checked_keywords"]

#: Options that the engine took over from the writer and the reader (one engine per process
#: owns the host cache, the I/O backend and its threads).
ENGINE_OPTIONS = ("host_cache_size", "io_backend", "io_workers")
#: Options of DCP's FileSystemWriter that have no keyword here: what takes each one's place.
#: (``overwrite`` is the writer's own; its default is False.)
FILESYSTEM_OPTIONS = {
    "thread_count": "the engine's I/O threads write: pass engine=Engine(io_workers=...) (from "
                    "dcp_datastates import Engine)",
    "sync_files": "not needed, every data file and .metadata is fsynced before the checkpoint "
                  "is committed",
    "single_file_per_rank": "not needed, each rank writes one data file",
    "per_thread_copy_ahead": "not needed, a save is snapshotted into the engine's host cache "
                             "(sized by Engine(host_cache_size=...))",
    "cache_staged_state_dict": "not needed, the engine's host cache is made once and reused by "
                               "every save",
    "serialization_format": "not needed, data files are safetensors",
}

F = TypeVar("F", bound=Callable[..., None])


def checked_keywords(init: F) -> F:
    """Wrap a class's ``__init__`` so that an unknown keyword raises a TypeError naming where
    an option of the engine or of DCP's FileSystemWriter went, or the closest real keyword
    (Python's "did you mean"); an object other than a path passed positionally
    (``DataStatesWriter(engine)``) is named too.

    The check runs only when the call fails, so a constructor costs nothing more; the
    signature stays the real one (``inspect.signature`` follows ``__wrapped__``).
    """
    params = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_path = any(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)  # path=, positional
    owner = init.__qualname__.rsplit(".", 1)[0]

    @functools.wraps(init)
    def wrapper(self: object, *args: object, **kwargs: object) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError:
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                raise TypeError(_unknown_keyword(owner, unknown[0], names)) from None
            odd = [a for a in args if a is not None and not isinstance(a, str | os.PathLike)]
            if not (odd and takes_path):
                raise
            raise TypeError(
                f"{owner}() takes a path (str or os.PathLike) as its only positional argument, "
                f"got a {type(odd[0]).__name__}: pass the other options by keyword (an engine "
                f"as engine=engine)") from None

    return wrapper  # type: ignore[return-value]


def _unknown_keyword(owner: str, name: str, names: list[str]) -> str:
    """What to say of keyword ``name`` that ``owner()`` does not take (``names`` it does)."""
    if name in ENGINE_OPTIONS and owner != "Engine":
        return (f"{owner}() got {name}=, an option of the engine: pass "
                f"engine=Engine({name}=...) (from dcp_datastates import Engine; one engine "
                f"serves every writer, reader and manager of the process)")
    if name in FILESYSTEM_OPTIONS and owner != "Engine":
        return (f"{owner}() got {name}=, an option of DCP's FileSystemWriter: "
                f"{FILESYSTEM_OPTIONS[name]}")
    said = f"{owner}() got an unexpected keyword argument {name!r}"
    close = difflib.get_close_matches(name, names, n=1)
    return f"{said}; did you mean {close[0]!r}?" if close else f"{said}; it takes {names}"
