"""The process group a save began under, and the check that DCP still runs it there.

DCP's ``async_save`` does not keep the process group: its upload thread calls ``save`` later,
and ``save`` takes the default group up *then* (``_DistWrapper`` passes ``group=None`` to each
collective). A save whose group was destroyed meanwhile would run as a one-process save on
each rank, each committing its own part over the checkpoint; where a new group was made, its
collectives would run on that one, among the training's (the ranks hang). So a save records
the default group when it began (:class:`Began`) and each of its DCP calls checks that this
group is still the default one (:meth:`Began.check`). The first call, ``reset`` (DCP makes it
when given a ``checkpoint_id``), comes before DCP's first collective of the save.

When a save began, by what DCP calls on which thread (one function each, below):

- staged by the writer itself (its ``stage``): then (:func:`began_staging`). ``no_dist=True``
  saves and the snapshots not staged by ``dcp.async_save`` (a manager's memory tier) are each
  rank's own checkpoint: they record no group.
- else the writer hears of the save first at its storage steps (:func:`began_for`): on the
  thread that made the writer (``dcp.save``), the save begins then; on another thread
  (``dcp.async_save``'s upload thread, the stager another), it began when the writer was made
  (one writer per save, DCP's idiom).
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass

import torch.distributed as dist

from .._dcp_frames import ASYNC_SAVE, dcp_locals
from ..errors import CheckpointError

log = logging.getLogger("dcp_datastates")


@dataclass(frozen=True)
class Began:
    """The thread a save began on and the default process group then (None: no group of
    several ranks, or a save that is this rank's own)."""

    thread: threading.Thread
    group: dist.ProcessGroup | None

    @classmethod
    def here(cls, own: bool = False) -> Began:
        """A save beginning now on the calling thread (``own``: this rank's own checkpoint)."""
        return cls(threading.current_thread(), None if own else _default_group())

    def check(self, ticket: int) -> None:
        """Raise (and log) if save ``ticket`` began under a group that is no longer the
        default one: it is abandoned, before DCP runs it as one rank's save or on the new
        group."""
        if self.group is None or _default_group() is self.group:
            return
        instead = ("on the new process group, among its other collectives"
                   if dist.is_initialized() else "as this rank's own checkpoint")
        error = CheckpointError(
            f"save {ticket} abandoned: the process group was destroyed while the save was in "
            f"flight; DCP would run it {instead}, so it is not committed on any rank (a "
            f"checkpoint there before is intact). Wait for the save's upload_completion "
            f"before dist.destroy_process_group()")
        log.warning("dcp_datastates: %s", error)
        raise error


def began_for(made: Began | None) -> Began:
    """When the save that DCP starts on the calling thread began, for a save the writer did
    not stage: now on the thread ``made`` the writer (or where that is unknown: a writer
    sent to DCP's checkpointer process), else when it was made."""
    if made is None or made.thread is threading.current_thread():
        return Began.here()
    return made


def _default_group() -> dist.ProcessGroup | None:
    """The default process group, if one of several ranks is up."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def began_staging() -> Began:
    """The beginning of a save whose snapshot the writer stages now: under the default group
    for a save DCP runs across the ranks (staged by ``dcp.async_save`` without ``no_dist``,
    read from its frame by ``_dcp_frames.py``, while a group of several ranks is up), else
    this rank's own."""
    here = Began.here()
    if here.group is None:
        return here
    async_save = dcp_locals(ASYNC_SAVE)
    if async_save is None or async_save["no_dist"]:
        return Began.here(own=True)
    group = async_save["process_group"] or dist.group.WORLD
    if group is dist.group.WORLD and dist.get_backend(group) == "gloo":
        warnings.warn(
            "dcp.async_save runs its collectives on DCP's upload thread, here on the default "
            "process group, which has gloo only: where the training's collectives use it too "
            "(DDP on the CPU), the two can block each other for good. Make a group for "
            "checkpoints once, on every rank (dist.new_group(backend=\"gloo\")), and pass it "
            "as process_group= to dcp.async_save", RuntimeWarning, stacklevel=2)
    return here
