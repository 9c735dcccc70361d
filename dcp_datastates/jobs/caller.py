"""Which thread, and which DCP call on it, runs a save: so a save DCP gave up on can be ended.

DCP calls a storage writer's steps one by one; when DCP fails between them (in the planner, or
because another rank failed) the writer hears nothing more. A save therefore remembers the
frame through which DCP entered (the outermost frame of ``torch.distributed.checkpoint`` code
around the writer's call) and the thread; once that frame is gone from the thread's stack, or the
thread has ended, DCP has left the save, finished or not.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType

import torch.distributed.checkpoint as _dcp

_DCP_DIR = os.path.dirname(_dcp.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Caller:
    """A thread and the frame (by identity, not kept alive) of the DCP call it is in."""

    thread: threading.Thread
    frame_id: int
    code: object

    @classmethod
    def here(cls) -> Caller:
        """The calling thread, and the DCP call around the writer's method it is in."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
            frame = frame.f_back
        entry = frame
        while frame is not None and frame.f_code.co_filename.startswith(_DCP_DIR):
            entry = frame
            frame = frame.f_back
        if entry is None:  # called from nowhere we can see: the thread alone decides
            return cls(threading.current_thread(), 0, None)
        return cls(threading.current_thread(), id(entry), entry.f_code)

    def gone(self) -> bool:
        """Whether the thread ended or has returned from that call."""
        if not self.thread.is_alive():
            return True
        if self.code is None:
            return False
        frame = sys._current_frames().get(self.thread.ident)
        while frame is not None:
            if id(frame) == self.frame_id and frame.f_code is self.code:
                return False
            frame = frame.f_back
        return True
