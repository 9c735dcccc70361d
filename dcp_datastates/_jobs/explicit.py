"""A save its owner drives step by step: this rank's own checkpoint, no DCP call around it.

``CheckpointManager`` saves each memory-tier checkpoint so: it makes an :class:`ExplicitSave`
for the step's directory, stages the state (into a memory-tier slot), then flushes and commits
it on its upload thread, or aborts it. The save is a :class:`~._jobs.save.SaveJob` of the
engine's save order (its turn comes after every earlier save's) that nothing needs to guess
about: its owner ends it, so the rules by which :mod:`.ordering` judges that DCP abandoned a
save never apply to it (its tie is *owned*), and it began under no process group (each rank
commits its own). DCP's planner plans it as ``dcp.save(..., no_dist=True)`` would (one
process: the local plan is the global one), through the planner's public methods.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from .._engine import Engine
from .._stats import SaveStats
from .groups import Began
from .save import SaveJob, new_save_job
from .snapshot import SnapshotTarget

#: The storage data of the one plan (DCP's writer names rank ``i``'s ``__i_``): data file names.
PLAN_PREFIX = "__0_"


class ExplicitSave:
    """One rank's own save of a state into ``directory``: :meth:`stage`, then :meth:`flush`
    and :meth:`commit` (on any one thread), or :meth:`abort` at any point. ``target``: a
    snapshot target the snapshot is copied into and that becomes the data file in place (a
    memory-tier slot); ``overwrite``: replace a checkpoint there (intact until the commit)."""

    def __init__(self, engine: Engine, directory: Path, *, target: SnapshotTarget | None = None,
                 overwrite: bool = False, direct_io: bool | None = None) -> None:
        self.job: SaveJob = new_save_job(engine, owned=True)
        self.job.directory, self.job.target = directory, target
        self.job.began = Began.here(own=True)
        self.overwrite, self.direct_io = overwrite, direct_io
        self._staged: Future | None = None
        self._written: tuple[Metadata, list[WriteResult], StorageMeta] | None = None

    @property
    def stats(self) -> SaveStats:
        return self.job.stats

    @property
    def committed(self) -> Future:
        """Done once the save is over: None when committed, else its error."""
        return self.job.committed

    def staging_ordered(self) -> bool:
        """Whether the snapshot's copies are over, or queued on the GPU."""
        return self.job.staging.ordered()

    def stage(self, state: dict) -> Future:
        """Start the snapshot of ``state`` (plain: no ``Stateful`` values); return a Future of
        the staged state dict. Training may change ``state`` once the copies are ordered."""
        self._staged = self.job.stage(state)
        return self._staged

    def flush(self, planner: SavePlanner | None = None) -> None:
        """Once the snapshot is staged and the earlier saves took their turn: plan it with
        ``planner`` (DCP's default one if None) and write this rank's data file."""
        if self._staged is None:
            raise RuntimeError(f"save {self.job.ticket} was not staged")
        job = self.job
        try:
            state = self._staged.result()
            job.order.wait_turn(job)
            meta = StorageMeta(checkpoint_id=str(job.checkpoint_directory()), save_id=job.token)
            planner = planner if planner is not None else DefaultSavePlanner()
            planner.set_up_planner(state, meta, is_coordinator=True)
            local = planner.create_local_plan()
            job.prepare(self.overwrite)
            plans, metadata = planner.create_global_plan([local])
            plan = planner.finish_plan(dataclasses.replace(plans[0], storage_data=PLAN_PREFIX))
            self._written = metadata, job.flush(plan, planner, self.direct_io), meta
        except BaseException as exc:
            job.end(exc)
            raise

    def commit(self) -> None:
        """Commit the flushed save (its ``.metadata``), which ends it."""
        if self._written is None:
            raise RuntimeError(f"save {self.job.ticket} was not flushed")
        metadata, results, meta = self._written
        try:
            self.job.commit(metadata, [results], meta)
        except BaseException as exc:
            self.job.end(exc)
            raise

    def abort(self, error: BaseException) -> None:
        """End the save with ``error``, once no copy of its snapshot runs (its target may
        then be used again); a save over already stays as it ended."""
        if self._staged is not None:
            self.job.quiet.wait()
        self.job.end(error)
