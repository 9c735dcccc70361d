"""Persisting what a job left in its memory tiers, from outside the job (the CLI's ``persist``).

A job's memory tiers are per-rank directories (``<root>/rank_<r>``, each holding
``step_<N>`` checkpoints with a ``.tier.json`` record naming the rank and the world size, and,
with replicas, ``replicas/rank_<o>/step_<N>``: copies of other ranks' checkpoints). A durable
checkpoint of a step is committed only once every rank's part is in it, so
:func:`persist_job` gathers a part for every rank of the step from the directories it is given
(a rank's own tier first, else a peer's replica of it, else a part an earlier run already left
in the durable step), checks their files before it writes anything, then writes them, checking
every checksum as it copies (a damaged part is refused:
:class:`~dcp_datastates.errors.DamagedStepError`); the last part commits the step. With
``partial=True`` it writes the parts it has and leaves the commit to whichever later run (on
another node) adds the rest.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointCorruptError, CheckpointError
from ._claims import claimed, claimed_durable
from ._persist import parts_of, persist_part
from ._replica import REPLICAS
from ._steps import (
    RECORD_NAME,
    TierRecord,
    check_complete,
    committed,
    committed_steps,
    size_of,
    step_dir,
    steps,
)

if TYPE_CHECKING:
    from .._engine import Engine

RANK_RE = re.compile(r"^rank_(\d+)$")


@dataclass(frozen=True)
class Source:
    """One rank's memory-tier checkpoint of one step."""

    step: int
    rank: int
    world_size: int
    path: Path
    replica: bool  # a peer's replica, not the rank's own tier


@dataclass
class Outcome:
    """What :func:`persist_job` did (``written`` empty: nothing was needed, see ``reason``)."""

    step: int | None
    target: Path | None
    world_size: int = 0
    written: list[Source] = field(default_factory=list)
    already: list[int] = field(default_factory=list)  # ranks whose part the target held
    missing: list[int] = field(default_factory=list)  # ranks left for a later run (partial)
    committed: bool = False
    bytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    notes: list[str] = field(default_factory=list)


def memory_tiers(arg: Path) -> list[Path]:
    """The rank memory tiers ``arg`` names: ``arg`` itself (one rank's tier: it holds
    ``step_<N>`` directories) or its ``rank_<r>`` directories (a job's memory root)."""
    if not arg.exists():
        raise FileNotFoundError(f"memory tier {arg} does not exist")
    if not arg.is_dir():
        raise NotADirectoryError(f"memory tier {arg} is not a directory")
    if (arg / RECORD_NAME).is_file():
        raise ValueError(f"{arg} is one checkpoint of a memory tier; give the tier "
                         f"{arg.parent} (and --step to pick the step)")
    ranks = sorted((p for p in arg.iterdir() if RANK_RE.match(p.name) and p.is_dir()),
                   key=lambda p: int(p.name[5:]))
    if steps(arg) or (arg / REPLICAS).is_dir():
        return [arg]
    if ranks:
        return ranks
    raise ValueError(f"{arg} is not a memory tier: it holds no step_<N> directories, nor "
                     f"rank_<r> directories of a job's memory tiers")


def sources(tiers: list[Path]) -> tuple[dict[int, dict[int, list[Source]]], list[str]]:
    """Every committed checkpoint in ``tiers`` (and their replicas), by step and rank (a
    rank's own tier first, replicas after); and notes on steps never committed there."""
    found: dict[int, dict[int, list[Source]]] = {}
    notes: list[str] = []
    roots = [(t, False) for t in tiers]
    for t in tiers:
        rep = t / REPLICAS
        if rep.is_dir():
            roots += [(p, True) for p in sorted(rep.iterdir()) if RANK_RE.match(p.name)]
    for root, replica in roots:
        for s in steps(root):
            directory = step_dir(root, s)
            if not committed(directory):
                if not replica:
                    notes.append(f"{directory} was never committed (the save did not finish); "
                                 f"it is not persisted")
                continue
            record = TierRecord.read(directory, s)
            found.setdefault(s, {}).setdefault(record.rank, []).append(
                Source(s, record.rank, record.world_size, directory, replica))
    for by_rank in found.values():
        for rank, srcs in by_rank.items():
            own = [src for src in srcs if not src.replica]
            if len(own) > 1:
                raise ValueError(
                    f"two memory tiers hold rank {rank}'s checkpoint of step {own[0].step}: "
                    f"{own[0].path} and {own[1].path}; give the directories of one job")
            srcs.sort(key=lambda src: src.replica)
    return found, notes


def _world_size(step: int, by_rank: dict[int, list[Source]]) -> int:
    sizes = {src.world_size for srcs in by_rank.values() for src in srcs}
    if len(sizes) > 1:
        where = ", ".join(f"{src.path} ({src.world_size})"
                          for srcs in by_rank.values() for src in srcs)
        raise CheckpointCorruptError(
            f"the checkpoints of step {step} disagree on the job's number of ranks: {where}")
    return sizes.pop()


def _usable(srcs: list[Source], problems: list[str]) -> Source | None:
    """The first of ``srcs`` whose files are all there (noting the others' problems)."""
    for src in srcs:
        try:
            check_complete(src.path)
            return src
        except (CheckpointCorruptError, OSError) as exc:
            problems.append(f"{src.path} is unusable ({exc})")
    return None


@dataclass
class _Plan:
    world: int
    chosen: dict[int, Source]  # a usable source per rank
    already: list[int]  # ranks whose part the durable step holds
    missing: list[int]
    problems: list[str]  # sources found unusable

    def lacks(self, step: int) -> str:
        why = f" ({'; '.join(self.problems)})" if self.problems else ""
        return f"step {step} lacks rank(s) {_ranks(self.missing)} of {self.world}{why}"


def _plan(step: int, by_rank: dict[int, list[Source]], target: Path) -> _Plan:
    world = _world_size(step, by_rank)
    problems: list[str] = []
    chosen = {r: src for r, srcs in sorted(by_rank.items())
              if (src := _usable(srcs, problems)) is not None}
    already = [r for r in parts_of(target) if r < world and r not in chosen]
    missing = [r for r in range(world) if r not in chosen and r not in already]
    return _Plan(world, chosen, already, missing, problems)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def persist_job(engine: Engine, memory: list[Path], durable: Path, step: int | None = None,
                *, partial: bool = False, parents: bool = False) -> Outcome:
    """Persist ``step`` (default: the newest step complete in ``memory``, if it is newer than
    every step committed in ``durable``) of a job from its memory tiers ``memory`` (each a
    rank's tier or a job's root of ``rank_<r>`` tiers) into ``durable``.

    Raises (before writing anything) where the step is not committed in ``memory``, or a
    rank's part of it is in none of ``memory`` (unless ``partial``: then the parts found are
    written and the step is committed by the run that adds the last one). ``durable``'s
    parent must exist, unless ``parents`` (then missing parents are created)."""
    if partial and step is None:
        raise ValueError("--partial needs --step: every node must persist the same step")
    tiers: list[Path] = []
    for arg in memory:
        tiers += [t for t in memory_tiers(arg) if t.resolve() not in {x.resolve() for x in tiers}]
    _check_durable(durable, tiers, parents)
    with claimed(tiers, "memory tier"), claimed_durable(durable):  # no manager meanwhile
        found, notes = sources(tiers)
        given = ", ".join(map(str, memory))
        if step is None:
            step, why = _newest(found, durable, given, notes)
            if why:
                return Outcome(step, step_dir(durable, step) if step is not None else None,
                               reason=why, notes=notes)
            assert step is not None  # _newest gives no step only with a reason
        target = step_dir(durable, step)
        if committed(target):
            return Outcome(step, target, notes=notes,
                           reason=f"step {step} is already persisted in {target}")
        if step not in found:
            torn = [str(step_dir(t, step)) for t in tiers if step_dir(t, step).is_dir()]
            why = f"; {', '.join(torn)}: never committed (the save did not finish)" if torn else ""
            raise CheckpointError(f"no memory tier in {given} holds a committed checkpoint of "
                                  f"step {step} (committed there: "
                                  f"{_ranks(sorted(found)) or 'none'}{why})")
        plan = _plan(step, found[step], target)
        if plan.missing and not partial:
            raise CheckpointError(
                f"{plan.lacks(step)}: give every rank's memory tier (or a peer's replica), or "
                f"--partial to write the parts found in {given} and leave the commit to a run "
                f"that adds the rest")
        return _write(engine, plan, step, target, notes)


def _newest(found: dict[int, dict[int, list[Source]]], durable: Path, given: str,
            notes: list[str]) -> tuple[int | None, str]:
    """The newest step complete in ``found``, and why nothing is to be done with it ("": it
    is to be persisted); notes the steps passed over in ``notes``."""
    if not found:
        return None, f"no committed checkpoint in {given}"
    incomplete = []
    for s in sorted(found, reverse=True):
        plan = _plan(s, found[s], step_dir(durable, s))
        if not plan.missing:
            break
        incomplete.append(plan.lacks(s))
    else:
        raise CheckpointError(
            f"no step is complete in {given}: {'; '.join(incomplete)}. Give every rank's "
            f"memory tier (or a job's memory root), or --step with --partial")
    notes += [f"{x}: not persisted" for x in incomplete]
    held = committed_steps(durable) if durable.is_dir() else []
    if held and held[-1] >= s:
        return s, (f"the newest complete step in memory, {s}, is not newer than step "
                   f"{held[-1]} in {durable}")
    return s, ""


def _write(engine: Engine, plan: _Plan, step: int, target: Path, notes: list[str]) -> Outcome:
    """Write the parts ``plan`` chose into ``target``; the last one commits the step."""
    notes += plan.problems
    notes += [f"rank {src.rank}'s checkpoint of step {step} comes from the replica {src.path}"
              for src in plan.chosen.values() if src.replica]
    start = time.perf_counter()
    outcome = Outcome(step, target, plan.world, already=plan.already, missing=plan.missing,
                      notes=notes)
    for rank in sorted(plan.chosen):  # each part checked above; the last one commits the step
        src = plan.chosen[rank]
        outcome.committed = persist_part(engine, src.path, target, src.rank, plan.world)
        outcome.written.append(src)
        outcome.bytes += size_of(src.path)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check_durable(durable: Path, tiers: list[Path], parents: bool) -> None:
    if durable.exists() and not durable.is_dir():
        raise NotADirectoryError(f"durable tier {durable} is not a directory")
    if not durable.exists() and not durable.parent.is_dir() and not parents:
        raise FileNotFoundError(f"durable tier {durable}: its parent directory "
                                f"{durable.parent} does not exist (--parents creates it)")
    where = Path(os.path.realpath(durable))
    for t in tiers:
        real = Path(os.path.realpath(t))
        if where == real or real in where.parents:
            raise ValueError(f"durable tier {durable} is the memory tier {t} or inside it")
