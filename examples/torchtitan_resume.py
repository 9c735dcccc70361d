"""Kill torchtitan's trainer with SIGKILL mid-run, start it again the same way, compare losses.

    python examples/torchtitan_resume.py --mode tiers --flavor debugmodel --steps 30 \\
        --interval 10 --dir /tmp/titan_resume

Three runs of ``examples/torchtitan_train.py`` with the same arguments (so the same seed, data
and steps): one to the end (the reference), one killed with SIGKILL (its whole process group)
once it has passed ``--kill-after`` steps and a checkpoint is committed, and the same command
again, which resumes by itself from the newest checkpoint. Checked: the restarted trainer
starts right after the newest step committed when the kill came (in the checkpoint folder, or
in the memory tier for ``--mode tiers``), and its loss at every later step equals the
reference's, digit for digit. Prints one JSON line ``{"resume": ...}``; exits 1 if a check
fails. Arguments after ``--`` go to torchtitan's command line.
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

from dcp_datastates.tiers.steps import committed_steps as tier_steps  # noqa: E402

TRAIN = Path(__file__).with_name("torchtitan_train.py")
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) time_s (\S+)$")
START_LINE = re.compile(r"Training starts at step (\d+)")
RESTORED_LINE = re.compile(r"dcp_datastates: restored step (\d+) from the (\w+) tier")
#: The longest one run may take (a hung trainer is killed then).
RUN_LIMIT_S = 600.0


@dataclass
class Spec:
    """One trainer configuration: the arguments of ``torchtitan_train.py``."""

    mode: str
    flavor: str = "debugmodel"
    attention: str = "flex"
    steps: int = 30
    interval: int = 10
    extra: list[str] = field(default_factory=list)

    def command(self, folder: Path, memory: Path) -> list[str]:
        """The command line of a run whose outputs go to ``folder`` (memory tier: ``memory``)."""
        cmd = [sys.executable, str(TRAIN), "--mode", self.mode, "--flavor", self.flavor,
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
            self.restored = (int(m.group(1)), m.group(2))
        elif m := STEP_LINE.match(line):
            step = int(m.group(1))
            self.losses[step] = m.group(2)
            self.step_times[step] = float(m.group(3))
            if self.first_step_s is None:
                self.first_step_s = time.perf_counter() - since
            return step
        return None


def run(cmd: list[str], log: Path, kill_when: Callable[[int], bool] | None = None,
        limit_s: float = RUN_LIMIT_S) -> Outcome:
    """Run ``cmd`` in a process group of its own, its output to ``log``; SIGKILL the group
    once ``kill_when(step)`` holds after a step (or after ``limit_s``)."""
    out, start = Outcome(), time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        timer = threading.Timer(limit_s, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:
                sink.write(line)
                step = out.read(line.rstrip("\n"), start)
                if step is not None and kill_when is not None and kill_when(step):
                    os.killpg(proc.pid, signal.SIGKILL)
                    out.killed_after = step
                    break
            proc.stdout.read()  # what was left in the pipe when the group was killed
            out.rc = proc.wait()
        finally:
            timer.cancel()
            proc.stdout.close()
    return out


def newest_committed(folder: Path, memory: Path) -> int | None:
    """The newest step committed in torchtitan's checkpoint folder or in the memory tier."""
    found = committed_steps(folder) | set(tier_steps(memory / "rank_0"))
    return max(found, default=None)


def resume_check(spec: Spec, root: Path, reference: Outcome | None = None,
                 kill_after: int | None = None) -> dict:
    """The kill-and-restart check under ``root`` (``reference``: a finished run of ``spec``,
    else one is made). Returns its figures and ``ok``."""
    if spec.mode == "none":
        raise ValueError("the resume check needs a checkpoint mode")
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

        def due(step: int) -> bool:
            return step >= kill_after and newest_committed(ckpt, memory / "run") is not None

        killed = run(cmd, root / "killed.log", kill_when=due)
        newest = newest_committed(ckpt, memory / "run")
        resumed = run(cmd, root / "resumed.log")
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return verdict(reference, killed, resumed, newest)


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
            "restored_from": resumed.restored, "steps_compared": len(after),
            "differences": differ[:5], "restart_first_step_s": resumed.first_step_s,
            "reference_first_step_s": reference.first_step_s,
            "losses_after_restart": {s: resumed.losses[s] for s in after}}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=[m for m in MODES if m != "none"], default="tiers")
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--attention", default="flex", choices=("flex", "varlen"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--kill-after", type=int, default=None,
                    help="kill once past this step (default: 2.5 intervals)")
    ap.add_argument("--dir", type=Path, required=True, help="where the runs write (emptied)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    spec = Spec(args.mode, args.flavor, args.attention, args.steps, args.interval, extra)
    result = resume_check(spec, args.dir, kill_after=args.kill_after)
    print(json.dumps({"resume": result}), flush=True)
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
