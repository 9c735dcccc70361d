"""``persist``: a step that a job committed in its memory tiers (and did not persist)
copied into the durable tier, as the next manager on those directories would."""

from __future__ import annotations

import argparse

from .._sizes import format_size
from ..tiers._offline import persist_job
from .arguments import add_quiet, cli_path, command_engine, note

DESCRIPTION = """\
Persist a checkpoint that CheckpointManager committed into memory tiers but did
not persist (the process died, or persist=None) to the durable tier, as the next
manager on the same directories would: every rank's part is copied to
DURABLE_DIR/step_<N> (step-<N> in a torchtitan folder set up by the adapter)
and their metadata merged into one .metadata, committed last. Without --step:
the newest step complete in the memory tiers given, if it is newer than every
step committed in DURABLE_DIR.

MEMORY_DIR is one rank's memory tier (holding step_<N> directories, e.g.
/dev/shm/dcp_datastates-<uid>/<run>-<hash>/rank_0, <run> being the last names
of the durable_dir) or a job's memory root holding rank_<r> tiers
(/dev/shm/dcp_datastates-<uid>/<run>-<hash>); give several to name the tiers of
every rank. A rank's part comes from its own tier, else from a peer's replica
of it (replicate=True), else from a part already in DURABLE_DIR/step_<N>. With
the ranks spread over several nodes and no replicas, run it on each node with
--step N --partial: each writes its ranks' parts, the last commits the step.

Files and sizes are checked before anything is written; every checksum as each
part is copied (a damaged part is refused and the step not committed). Run it
when no job is using these directories (a manager holding a memory tier or the
durable tier, or another persist holding a memory tier, is named, with its pid,
and refused; persists into one durable tier take turns); a tier another user
owns or may write is refused. Exits 0 when the step is persisted or nothing
was needed, 1 (naming the path) for a missing directory, a step not
committed, a rank missing or damaged (naming the file and the item whose
checksum fails)."""


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {text!r}")
    return step


def _cmd_persist(args: argparse.Namespace) -> int:
    """Persist a step committed in memory tiers (a job that died) into the durable tier."""
    memory = [cli_path(m) for m in args.memory]
    with command_engine(args) as engine:
        outcome = persist_job(engine, memory, cli_path(args.durable), args.step,
                              partial=args.partial, parents=args.parents)
    for text in outcome.notes:
        note(args, text)
    if not outcome.written:
        print(f"nothing to persist: {outcome.reason}")
        return 0
    ranks = sorted(src.rank for src in outcome.written)
    what = (f"step {outcome.step} ({len(ranks)} of {outcome.world_size} rank(s), "
            f"{format_size(outcome.bytes)}) in {outcome.seconds:.2f} s")
    if outcome.committed:
        print(f"persisted {what} to {outcome.target}; it is committed")
        return 0
    print(f"wrote the part(s) of rank(s) {', '.join(map(str, ranks))} of {what} to "
          f"{outcome.target}; it is committed once rank(s) "
          f"{', '.join(map(str, outcome.missing))} add theirs (run this command with --step "
          f"{outcome.step} --partial where their memory tiers are)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``persist``."""
    p = sub.add_parser("persist", help="persist a step that a job left in its memory tiers",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=DESCRIPTION)
    p.add_argument("memory", nargs="+", metavar="MEMORY_DIR",
                   help="a rank's memory tier, or a job's memory root of rank_<r> tiers")
    p.add_argument("durable", metavar="DURABLE_DIR",
                   help="the durable tier (CheckpointManager's durable_dir; created if its "
                        "parent exists, or with --parents)")
    p.add_argument("--step", type=_step, default=None,
                   help="the step to persist (default: the newest complete one)")
    p.add_argument("--partial", action="store_true",
                   help="write the parts found even if other ranks' are missing (needs --step)")
    p.add_argument("--parents", action="store_true",
                   help="create DURABLE_DIR's missing parent directories (as mkdir -p); without "
                        "it a missing parent is refused, as a mistyped path would be")
    add_quiet(p, progress=False)
    p.set_defaults(func=_cmd_persist)
