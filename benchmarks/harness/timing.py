"""Timing: seconds of a call, medians past the warm-up, completion stamps, rotating orders."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import Future

import torch


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_sync() -> None:
    """Wait for the work queued on the current CUDA stream, as a training loop's
    ``loss.item()`` does (not for other streams: a checkpoint's copies on a side stream)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def timed(fn, *args: object, **kwargs: object) -> float:
    """Seconds ``fn(*args, **kwargs)`` takes, GPU work included."""
    sync()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    sync()
    return time.perf_counter() - t0


def median(xs: list[float | None], skip: int = 0) -> float | None:
    """Median of the values that are not None, past the first ``skip`` (the warm-up) where
    more than ``skip`` are left; None when there are none."""
    xs = [x for x in xs if x is not None]
    xs = xs[skip:] if len(xs) > skip else xs
    return statistics.median(xs) if xs else None


def prewarm(nbytes: int) -> None:
    """Touch and free ``nbytes`` of RAM, so that a VM's host backs free guest pages again."""
    if nbytes:
        torch.ones(nbytes, dtype=torch.uint8)


def rotated(items: list | tuple, rep: int) -> list:
    """``items`` starting at ``rep``: each goes first in turn across repetitions."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


class DoneAt:
    """When ``fut`` completed (``time.perf_counter()``), stamped by a done-callback.

    ``wait()`` is needed even after ``fut.result()`` returned: callbacks run after waiters wake.
    """

    def __init__(self, fut: Future) -> None:
        self.t: float | None = None
        self._event = threading.Event()
        fut.add_done_callback(self._stamp)

    def _stamp(self, _: Future) -> None:
        self.t = time.perf_counter()
        self._event.set()

    def wait(self) -> float:
        self._event.wait()
        return self.t
