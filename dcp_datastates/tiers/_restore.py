"""Choosing what to restore, and restoring it: the newest step every rank can load, from the
fastest tier that holds it.

Each rank tells the others what it holds (its view: steps committed and complete in its memory
tier, the replicas it keeps of other ranks, steps committed in the durable tier); every rank
then makes the same choice from the same views. A rank whose memory tier lacks the step gets
it back from a peer's replica, if one holds it, else reads it from the durable tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .._engine import Engine
from .._reader import DataStatesReader
from ..errors import CheckpointCorruptError, CheckpointError, WorldSizeChangedError
from . import _local_dcp as local_dcp
from . import _replica as replica
from ._ranks import Ranks
from ._steps import (
    DAMAGE_ERRORS,
    TierRecord,
    committed,
    committed_steps,
    complete,
    step_dir,
)

log = logging.getLogger("dcp_datastates")


def view(memory: Path, durable: Path | None, replicas_of: range, world: int) -> dict:
    """What this rank holds: its memory steps, the replicas it keeps (of the ranks in
    ``replicas_of``), the durable steps; and ("aside") the memory steps that a job of ``world``
    ranks does not restore, with why, by step: (the world size they were saved by, 0 where
    their record is unreadable; the reason)."""
    aside: dict[int, tuple[int, str]] = {}
    mem = _restorable(memory, world, aside)
    reps: dict[int, list[int]] = {}
    for owner in replicas_of:
        held = _restorable(replica.replica_root(memory, owner), world, aside)
        if held:
            reps[owner] = held
    return {"memory": mem, "replicas": reps, "aside": aside,
            "durable": committed_steps(durable) if durable is not None else []}


def _restorable(root: Path, world: int, aside: dict[int, tuple[int, str]]) -> list[int]:
    """The steps committed and complete in the memory tier (or replica directory) ``root``
    that a job of ``world`` ranks restores: those its ranks saved (by their records). A
    memory-tier step holds one rank's shards of the job that saved it; another number of ranks
    shards the state otherwise, and only a durable checkpoint reshards. The others go to
    ``aside``."""
    found = []
    for s in committed_steps(root):
        directory = step_dir(root, s)
        if not complete(directory):
            continue
        try:
            saved_by = TierRecord.read(directory, s).world_size
        except CheckpointCorruptError as exc:
            aside.setdefault(s, (0, str(exc)))
            continue
        if saved_by == world:
            found.append(s)
        else:
            aside.setdefault(s, (saved_by, f"saved by {saved_by} rank(s), this job has {world}"))
    return found


def holder(views: list[dict], owner: int, step: int) -> int | None:
    """The rank holding a replica of ``owner``'s ``step``, if any."""
    for rank, v in enumerate(views):
        if step in v["replicas"].get(owner, ()):
            return rank
    return None


def pick(views: list[dict], step: int | None, below: int | None = None) -> int | None:
    """The newest step (or ``step``; older than ``below``, if given) every rank can restore:
    from its memory tier, a peer's replica of it, or the durable tier."""
    durable = set(views[0]["durable"])
    candidates = durable.union(*(v["memory"] for v in views),
                               *(s for v in views for s in v["replicas"].values()))
    for s in sorted(candidates, reverse=True):
        if (step is not None and s != step) or (below is not None and s >= below):
            continue
        if all(s in v["memory"] or s in durable or holder(views, r, s) is not None
               for r, v in enumerate(views)):
            return s
    return None


def held(views: list[dict]) -> set[int]:
    """Every step some rank holds in some tier."""
    return {s for v in views for s in (*v["memory"], *v["durable"], *v["aside"],
                                       *(x for r in v["replicas"].values() for x in r))}


def _newer_than(views: list[dict], step: int) -> list[int]:
    """Steps newer than ``step`` that some rank holds in some tier."""
    return sorted(s for s in held(views) if s > step)


class Restorer:
    """Restores one rank's state from the tiers: ``memory`` (with the replicas it keeps, if
    ``replicate``) and ``durable`` (None: none), through the engine ``engine()`` gives."""

    def __init__(self, memory: Path, durable: Path | None, replicate: bool, ranks: Ranks,
                 engine: Callable[[], Engine], start_over: str | None = None) -> None:
        self.memory, self.durable, self.replicate = memory, durable, replicate
        self.ranks, self.engine = ranks, engine
        #: how to start over, where the durable tier is new (None: it is not)
        self.start_over = start_over

    def views(self) -> list[dict]:
        """Every rank's view, by rank (collective)."""
        owners = range(self.ranks.world) if self.replicate else range(0)
        return self.ranks.gather(view(self.memory, self.durable, owners, self.ranks.world))

    def restore(self, state: dict, step: int | None) -> tuple[int, list[int]]:
        """Load ``step`` (None: the newest step every rank can restore) into ``state``, on
        every rank. Without ``step``, a step that does not load on some rank (damaged in every
        tier holding it: a checksum fails, a file is unreadable) gives way to the next older
        one, on every rank (logged as an error); where none loads, this rank's error for the
        newest one is raised (noting the others). Returns the step loaded and the newer steps
        some tier holds (collective)."""
        views = self.views()
        chosen, failures, first = pick(views, step), [], None
        while chosen is not None:
            fetched = self.fetch(views, chosen)
            try:
                self.load(state, chosen,
                          memory=fetched or chosen in views[self.ranks.rank]["memory"])
                error = None
            except DAMAGE_ERRORS as exc:
                error = exc
            bad = [(r, e) for r, e in enumerate(self.ranks.gather(error and _said(error)))
                   if e is not None]
            if not bad:
                self._warn(views, chosen)
                return chosen, _newer_than(views, chosen)
            failures.append(f"step {chosen}: rank {bad[0][0]}: {bad[0][1]}")
            if step is not None:
                raise error or CheckpointError(failures[-1])
            first = first or error
            log.error("dcp_datastates: step %d does not load (%s); falling back to the next "
                      "older step", chosen, "; ".join(f"rank {r}: {e}" for r, e in bad))
            chosen = pick(views, None, below=chosen)
        if failures:
            if first is None:
                raise CheckpointError(f"no step loads: {'; '.join(failures)}")
            first.add_note(f"no step loads: {'; '.join(failures)}")
            raise first
        where = f"step {step}" if step is not None else "a checkpoint"
        self.check_world(views, where)
        aside = "; ".join(f"step {s}: {why}" for s, (_, why) in sorted(
            views[self.ranks.rank]["aside"].items()))
        raise FileNotFoundError(
            f"no tier holds {where} complete on every rank (memory {self.memory}, durable "
            f"{self.durable})" + (f"; not restored from the memory tier: {aside}" if aside
                                  else ""))

    def _warn(self, views: list[dict], chosen: int) -> None:
        """Warn of this rank's memory steps not restored although not older than ``chosen``
        (saved by another number of ranks, or their record unreadable)."""
        mine = views[self.ranks.rank]["aside"]
        for why in sorted({why for s, (_, why) in mine.items() if s >= chosen}):
            passed = sorted(s for s, (_, w) in mine.items() if s >= chosen and w == why)
            keep = "" if passed[-1] == chosen else (
                f"; the next save sets step(s) {_listed(s for s in passed if s > chosen)} "
                f"aside (deleted from the memory tier): to keep them, persist them first "
                f"(`python -m dcp_datastates persist <the memory tiers of the job that saved "
                f"them> <durable dir>`)")
            log.warning("dcp_datastates: memory tier %s: step(s) %s not restored from it: %s; "
                        "step %d is loaded from the other tiers%s", self.memory,
                        _listed(passed), why, chosen, keep)

    def warn_new_durable(self, views: list[dict]) -> None:
        """Warn where the durable tier is new (:attr:`start_over` says how to start over) and
        empty, while the memory tiers hold a step to resume from: a run removed to start over
        resumes from its memory tiers (the manager neither deletes nor sets aside steps that
        may be the only copy of a run: a ``persist=None`` run's, or a run's whose shared file
        system is not mounted)."""
        step = pick(views, None)
        if self.start_over is None or views[0]["durable"] or step is None:
            return
        log.warning(
            "dcp_datastates: resuming from step %d of the memory tier %s, though the durable "
            "tier %s is new (no manager used it before: made anew, or removed to start over) "
            "and holds no checkpoint. To start over instead, %s, and start again", step,
            self.memory, self.durable, self.start_over)

    def check_world(self, views: list[dict], where: str) -> None:
        """Raise WorldSizeChangedError where no tier holds ``where`` for this job but memory
        tiers hold steps that another number of ranks saved."""
        saved_by = sorted({n for v in views for n, _ in v["aside"].values() if n})
        if not saved_by:
            return
        steps = _listed(sorted({s for v in views for s, (n, _) in v["aside"].items() if n}))
        durable = self.durable if self.durable is not None else "<durable dir>"
        none = (f"the durable tier {self.durable} holds none" if self.durable is not None
                else "there is no durable tier (durable_dir=None)")
        raise WorldSizeChangedError(
            f"no tier holds {where} that this job of {self.ranks.world} rank(s) can load: the "
            f"memory tiers (this rank's: {self.memory}) hold step(s) {steps} saved by "
            f"{_listed(saved_by)} rank(s), each tier one rank's shards, which do not reshard, "
            f"and {none}. Persist them first (`python -m "
            f"dcp_datastates persist <the memory tiers of every rank that saved them, e.g. "
            f"{self.memory.parent}> {durable}`): a durable checkpoint loads on any number of "
            f"ranks. Or restart on {_listed(saved_by)} rank(s); a new run goes into another "
            f"durable_dir (or remove these memory tiers first)")

    def fetch(self, views: list[dict], step: int) -> bool:
        """Bring ``step`` back into the memory tiers that lack it from the peers' replicas
        (collective); return whether this rank got it."""
        moves = [(held_by, owner) for owner, v in enumerate(views) if step not in v["memory"]
                 for held_by in [holder(views, owner, step)] if held_by is not None]
        if moves and replica.restore(self.ranks.group, self.ranks.rank, moves, self.memory,
                                     step):
            source = next(h for h, owner in moves if owner == self.ranks.rank)
            log.info("dcp_datastates: step %d of rank %d restored into %s from rank %d's "
                     "replica", step, self.ranks.rank, self.memory, source)
            return True
        return False

    def load(self, state: dict, step: int, *, memory: bool = True) -> None:
        """Load ``step`` into ``state`` from this rank's memory tier (if ``memory``: False
        where its copy is one this job does not restore, :func:`view`'s "aside"), else (that
        copy failing as a damaged one may: :data:`DAMAGE_ERRORS`, logged) the durable tier.
        Where no other copy is left, the memory copy's error is raised."""
        start = time.perf_counter()
        mine = step_dir(self.memory, step)
        failed: BaseException | None = None
        if memory and complete(mine):
            try:
                self._read(state, mine, rank_part=True)
                log.info("dcp_datastates: restored step %d from the memory tier (%s) in %.2f s",
                         step, mine, time.perf_counter() - start)
                return
            except DAMAGE_ERRORS as exc:
                failed = exc
                log.warning("dcp_datastates: memory tier copy of step %d unusable (%s); "
                            "loading it from the durable tier", step, _said(exc))
        target = step_dir(self.durable, step) if self.durable is not None else None
        if target is None or not committed(target):
            if failed is not None:
                raise failed
            raise CheckpointError(f"step {step} is in no tier of rank {self.ranks.rank}")
        self._read(state, target, rank_part=False)
        log.info("dcp_datastates: restored step %d from the durable tier (%s) in %.2f s",
                 step, target, time.perf_counter() - start)

    def _read(self, state: dict, directory: Path, rank_part: bool) -> None:
        """Load ``directory`` into ``state``; ``rank_part``: a memory-tier step, this rank's
        part of the checkpoint only."""
        local_dcp.load(state, directory, DataStatesReader(engine=self.engine(),
                                                          rank_part=rank_part))


def _listed(steps: Iterable[int]) -> str:
    return ", ".join(map(str, steps))


def _said(error: BaseException) -> str:
    """``error`` as a log line says it: its type too, unless it is a CheckpointError or an
    OSError (whose messages say what failed)."""
    if isinstance(error, (CheckpointError, OSError)):
        return str(error)
    return f"{type(error).__name__}: {error}"
