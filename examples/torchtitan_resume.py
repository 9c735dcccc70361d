"""Kill torchtitan's trainer with SIGKILL mid-run, start it again the same way, compare losses.

    python examples/torchtitan_resume.py --mode tiers --flavor debugmodel --steps 30 \\
        --interval 10 --dir /tmp/titan_resume
    python examples/torchtitan_resume.py --mode tiers --nproc 2 --drop-rank-tier 1 \\
        --dir /tmp/titan_resume -- --parallelism.data_parallel_shard_degree 2 \\
        --checkpoint.memory_replicate

Three runs of ``examples/torchtitan_train.py`` with the same arguments (so the same seed, data
and steps): one to the end (the reference), one killed with SIGKILL (its whole process group)
once it has passed ``--kill-after`` steps and a checkpoint is committed, and the same command
again, which resumes by itself from the newest checkpoint. Checked: the restarted trainer
starts right after the newest step committed when the kill came (in the checkpoint folder, or
in the memory tier for ``--mode tiers``), and its loss at every later step equals the
reference's, digit for digit. Prints one JSON line ``{"resume": ...}``; exits 1 if a check
fails. Arguments after ``--`` go to ``torchtitan_train.py`` (torchtitan's command line).

``--nproc N`` starts each run with ``torchrun --standalone --nproc-per-node N`` (the kill then
reaches torchrun and every rank: torchrun starts each in a session of its own).
``--drop-rank-tier R`` (memory tier) removes rank R's memory tier between the kill and the
restart, as a lost node would: the restart then takes rank R's state from the replica another
rank keeps (``--checkpoint.memory_replicate``), else from the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_train import MODES, committed_steps  # noqa: E402

from dcp_datastates.tiers._replica import replica_root  # noqa: E402
from dcp_datastates.tiers._steps import committed_steps as tier_steps  # noqa: E402

TRAIN = Path(__file__).with_name("torchtitan_train.py")
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) time_s (\S+)$")
START_LINE = re.compile(r"Training starts at step (\d+)")
RESTORED_LINE = re.compile(r"dcp_datastates: restored step (\d+) from the (\w+) tier")
REPLICA_LINE = re.compile(r"dcp_datastates: step (\d+) of rank (\d+) restored into .* from "
                          r"rank (\d+)'s replica")
#: The longest one run may take (a hung trainer is killed then; ``$TITAN_RUN_LIMIT_S``).
RUN_LIMIT_S = float(os.environ.get("TITAN_RUN_LIMIT_S", "600"))


@dataclass
class Spec:
    """One trainer configuration: the arguments of ``torchtitan_train.py``."""

    mode: str
    flavor: str = "debugmodel"
    attention: str = "flex"
    steps: int = 30
    interval: int = 10
    extra: list[str] = field(default_factory=list)
    nproc: int = 1

    def command(self, folder: Path, memory: Path) -> list[str]:
        """The command line of a run whose outputs go to ``folder`` (memory tier: ``memory``)."""
        launch = [sys.executable, str(TRAIN)]
        if self.nproc > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", str(self.nproc), str(TRAIN)]
        cmd = [*launch, "--mode", self.mode, "--flavor", self.flavor,
               "--attention", self.attention, "--training.steps", str(self.steps),
               "--dump_folder", str(folder)]
        if self.mode != "none":
            cmd += ["--checkpoint.interval", str(self.interval)]
        if self.mode == "tiers":
            cmd += ["--checkpoint.memory_dir", str(memory)]
        return cmd + self.extra


@dataclass
class Outcome:
    """What one run printed: its losses (as printed), summary, start step and log tail."""

    rc: int | None = None
    losses: dict[int, str] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)
    starts_at: int | None = None
    restored: tuple[int, str] | None = None
    from_replicas: list[str] = field(default_factory=list)
    summary: dict | None = None
    first_step_s: float | None = None
    killed_after: int | None = None
    tail: list[str] = field(default_factory=list)

    def read(self, line: str, since: float) -> int | None:
        """Take in one line of the run's output; the step it ended, if any."""
        self.tail = [*self.tail[-39:], line]
        if line.startswith('{"summary"'):
            self.summary = json.loads(line)["summary"]
        elif m := START_LINE.search(line):
            self.starts_at = int(m.group(1))
        elif m := RESTORED_LINE.search(line):
            self.restored = self.restored or (int(m.group(1)), m.group(2))
        elif m := REPLICA_LINE.search(line):
            self.from_replicas.append(f"step {m.group(1)} of rank {m.group(2)} from rank "
                                      f"{m.group(3)}'s replica")
        elif m := STEP_LINE.match(line):
            step = int(m.group(1))
            self.losses[step] = m.group(2)
            self.step_times[step] = float(m.group(3))
            if self.first_step_s is None:
                self.first_step_s = time.perf_counter() - since
            return step
        return None


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_all(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and those of every process below it (torchrun
    starts each rank in a session of its own)."""
    groups = set()
    for p in [pid, *descendants(pid)]:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd: list[str], log: Path, kill_when: Callable[[int], bool] | None = None,
        limit_s: float = RUN_LIMIT_S) -> Outcome:
    """Run ``cmd`` in a process group of its own, its output to ``log``; SIGKILL it and every
    process below it once ``kill_when(step)`` holds after a step (or after ``limit_s``, or
    when this process is stopped: see :func:`stop_on_sigterm`)."""
    out, start = Outcome(), time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timer = threading.Timer(limit_s, kill_all, (proc.pid,))
        timer.start()
        try:
            for line in proc.stdout:
                sink.write(line)
                step = out.read(line.rstrip("\n"), start)
                if step is not None and kill_when is not None and kill_when(step):
                    kill_all(proc.pid)
                    out.killed_after = step
                    break
            left = proc.stdout.read()  # what was left in the pipe when the group was killed
            if left:
                sink.write(f"--- after the kill at step {out.killed_after}, still in the pipe:\n"
                           if out.killed_after is not None else "")
                sink.write(left)
            out.rc = proc.wait()
        except BaseException:
            kill_all(proc.pid)  # stopped (SIGTERM, Ctrl-C): the trainer has a session of its own
            raise
        finally:
            timer.cancel()
            proc.stdout.close()
    return out


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``'s) stops this process by SystemExit, so that :func:`run` kills the
    trainer it watches (which runs in a session of its own) instead of leaving it running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def newest_committed(folder: Path, memory: Path, world: int = 1,
                     lost: int | None = None) -> int | None:
    """The newest step a restart can load: committed in torchtitan's checkpoint folder, or in
    the memory tier of every rank (its own tier or, with replicas, the next rank's copy of it);
    ``lost``: a rank whose own memory tier does not count (it is to be removed)."""
    found = committed_steps(folder)
    every: set[int] | None = None
    for rank in range(world):
        held = set(tier_steps(memory / f"rank_{rank}")) if rank != lost else set()
        if world > 1:
            peer = (rank + 1) % world
            if peer != lost:
                held |= set(tier_steps(replica_root(memory / f"rank_{peer}", rank)))
        every = held if every is None else every & held
    return max(found | (every or set()), default=None)


def resume_check(spec: Spec, root: Path, reference: Outcome | None = None,
                 kill_after: int | None = None, drop_rank_tier: int | None = None) -> dict:
    """The kill-and-restart check under ``root`` (``reference``: a finished run of ``spec``,
    else one is made; ``drop_rank_tier``: remove that rank's memory tier before the restart).
    Returns its figures and ``ok``."""
    if spec.mode == "none":
        raise ValueError("the resume check needs a checkpoint mode")
    if drop_rank_tier is not None and (spec.mode != "tiers" or drop_rank_tier >= spec.nproc):
        raise ValueError(f"--drop-rank-tier {drop_rank_tier} needs --mode tiers and a rank "
                         f"below --nproc {spec.nproc}")
    kill_after = kill_after or 2 * spec.interval + spec.interval // 2
    if kill_after >= spec.steps:
        raise ValueError(f"--kill-after {kill_after} must come before the last step {spec.steps}")
    folder, memory = root / "run", Path("/dev/shm") / f"titan_resume_{os.getpid()}"
    try:
        if reference is None:
            reference = run(spec.command(root / "reference", memory / "reference"),
                            root / "reference.log")
        cmd = spec.command(folder, memory / "run")
        ckpt = folder / "checkpoint"

        def newest() -> int | None:
            return newest_committed(ckpt, memory / "run", spec.nproc, drop_rank_tier)

        def due(step: int) -> bool:
            return step >= kill_after and newest() is not None

        newest()  # its imports done before the run it watches

        killed = run(cmd, root / "killed.log", kill_when=due)
        if drop_rank_tier is not None:
            shutil.rmtree(memory / "run" / f"rank_{drop_rank_tier}", ignore_errors=True)
        newest_step = newest()
        resumed = run(cmd, root / "resumed.log")
    finally:  # the logs stay; the checkpoints (gigabytes each) go
        for tier in (memory, folder, root / "reference"):
            shutil.rmtree(tier, ignore_errors=True)
    result = verdict(reference, killed, resumed, newest_step)
    result["dropped_rank_tier"] = drop_rank_tier
    return result


def verdict(reference: Outcome, killed: Outcome, resumed: Outcome, newest: int | None) -> dict:
    """What the three runs show: where the restart began, and the steps whose loss differs."""
    after = sorted(s for s in resumed.losses if newest is not None and s > newest)
    differ = [f"step {s}: {resumed.losses[s]} != {reference.losses.get(s)}"
              for s in after if resumed.losses[s] != reference.losses.get(s)]
    problems = []
    if killed.killed_after is None:
        problems.append(f"the run was not killed (exit {killed.rc})")
    if newest is None or resumed.starts_at != newest + 1:
        problems.append(f"restart began at step {resumed.starts_at}, the newest committed "
                        f"step was {newest}")
    if resumed.rc != 0 or reference.rc != 0:
        problems.append(f"exit codes: reference {reference.rc}, restart {resumed.rc}")
    if not after or differ:
        problems.append(f"{len(differ)} of {len(after)} losses after the restart differ")
    return {"ok": not problems, "problems": problems, "killed_after_step": killed.killed_after,
            "newest_committed": newest, "resumed_at_step": resumed.starts_at,
            "restored_from": resumed.restored, "from_replicas": resumed.from_replicas,
            "steps_compared": len(after),
            "differences": differ[:5], "restart_first_step_s": resumed.first_step_s,
            "reference_first_step_s": reference.first_step_s,
            "losses_after_restart": {s: resumed.losses[s] for s in after}}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m for m in MODES if m != "none"], default="tiers")
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--attention", default="flex", choices=("flex", "sdpa", "varlen"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--kill-after", type=int, default=None,
                    help="kill once past this step (default: 2.5 intervals)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) of every run")
    ap.add_argument("--drop-rank-tier", type=int, default=None,
                    help="remove this rank's memory tier before the restart")
    ap.add_argument("--dir", type=Path, required=True, help="where the runs write (emptied)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    stop_on_sigterm()
    shutil.rmtree(args.dir, ignore_errors=True)
    spec = Spec(args.mode, args.flavor, args.attention, args.steps, args.interval, extra,
                args.nproc)
    result = resume_check(spec, args.dir, kill_after=args.kill_after,
                          drop_rank_tier=args.drop_rank_tier)
    print(json.dumps({"resume": result}), flush=True)
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
