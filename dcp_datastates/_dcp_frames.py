"""What DCP does not tell a storage backend, read from its call stack: the one place that does.

DCP hands its StorageWriter and StorageReader no signal for these facts, so they are read from
the frames of DCP's functions, here and nowhere else in the package:

- the process group and ``no_dist`` of the ``dcp.async_save`` staging the writer's snapshot
  (:data:`ASYNC_SAVE`, ``_jobs/groups.py``);
- the planner of the load step calling the reader's ``set_up_storage_reader``
  (:data:`LOAD_STEP`, ``_reader.py``);
- whether a StorageReader's ``read_metadata`` unpickles our ``.metadata``
  (:data:`READ_METADATA`, ``_format/metadata_file.py``);
- the outermost DCP frame around a writer's call, and whether it returned
  (:func:`dcp_entry`, :func:`on_stack`, ``_jobs/ordering.py``).

Each :class:`Where` names the DCP function it reads and the locals it reads there;
``tests/test_dcp_frames.py`` checks them on the installed torch, so that a release renaming one
fails there rather than silently here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.storage import StorageReader

__all__ = ["ASYNC_SAVE", "DCP_DIR", "LOAD_STEP", "READ_METADATA", "Where", "dcp_code",
           "dcp_entry", "dcp_locals", "on_stack"]

#: DCP's source directory: a frame of code there is DCP's.
DCP_DIR = os.path.dirname(_dcp.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class Where:
    """A DCP function whose frame is read, and the locals read there.

    ``function`` is dotted under ``torch.distributed.checkpoint`` (a nested function by its
    enclosing one's name, then its own). Its frames are known by its code, or by its name alone
    where ``self_type`` is given (any class's method of that name whose ``self`` is one).
    ``depth``: how many frames, from the caller of the function asking, are looked at (None:
    the whole stack)."""

    function: str
    names: tuple[str, ...]
    depth: int | None = None
    self_type: type | None = None


#: ``dcp.async_save`` staging the writer's snapshot: the save's group, and whether it has none.
ASYNC_SAVE = Where("state_dict_saver.async_save", ("process_group", "no_dist"))
#: DCP's load step calling the reader's ``set_up_storage_reader`` (a closure over its planner).
LOAD_STEP = Where("state_dict_loader._load_state_dict.local_step", ("planner",), depth=1)
#: A StorageReader's ``read_metadata`` unpickling (DCP's own is FileSystemReader's).
READ_METADATA = Where("filesystem.FileSystemReader.read_metadata", ("self",), depth=3,
                      self_type=StorageReader)


def dcp_code(function: str) -> CodeType | None:
    """The code of DCP's ``function`` (dotted as :attr:`Where.function`; decorators unwrapped),
    None where the installed torch has none of that name."""
    module, *path = function.split(".")
    found: Any = importlib.import_module(f"{_dcp.__name__}.{module}")
    for name in path:
        code = _code_of(found)
        nested = [c for c in (code.co_consts if code else ()) if isinstance(c, CodeType)
                  and c.co_name == name]
        found = nested[0] if nested else getattr(found, name, None)
        if found is None:
            return None
    return _code_of(found)


def _code_of(found: Any) -> CodeType | None:
    if isinstance(found, CodeType):
        return found
    return getattr(inspect.unwrap(found), "__code__", None) if callable(found) else None


def dcp_locals(where: Where) -> dict[str, object] | None:
    """The locals ``where.names`` (None for one unset) of the innermost frame of ``where``'s
    function on the calling thread's stack, from the caller of the function asking; None where
    there is none."""
    code = dcp_code(where.function) if where.self_type is None else None
    name = where.function.rsplit(".", 1)[-1]
    frame: FrameType | None = sys._getframe(2)
    looked = 0
    while frame is not None and (where.depth is None or looked < where.depth):
        if frame.f_code is code or (where.self_type is not None and frame.f_code.co_name == name
                                    and isinstance(frame.f_locals.get("self"), where.self_type)):
            return {local: frame.f_locals.get(local) for local in where.names}
        frame, looked = frame.f_back, looked + 1
    return None


def dcp_entry() -> tuple[int, CodeType] | None:
    """The outermost DCP frame around this package's frames on the calling thread's stack
    (the DCP call through which the package was called; where DCP is not the caller, the first
    frame outside the package), by identity (not kept alive) and code; None: no such frame."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    entry = frame
    while frame is not None and frame.f_code.co_filename.startswith(DCP_DIR):
        entry = frame
        frame = frame.f_back
    return None if entry is None else (id(entry), entry.f_code)


def on_stack(thread: threading.Thread, entry: tuple[int, CodeType]) -> bool:
    """Whether the frame :func:`dcp_entry` gave (on ``thread``) is still on its stack."""
    ident = thread.ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if id(frame) == entry[0] and frame.f_code is entry[1]:
            return True
        frame = frame.f_back
    return False
