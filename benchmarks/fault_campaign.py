"""Fault campaign: child processes SIGKILLed at random points of saves, persists, exports and
replication, and full file systems under both tiers; each trial checks what was left.

    python benchmarks/fault_campaign.py --trials 50 --kinds save,persist,export,replication,enospc

Kinds (each trial draws its variant, state size and kill delay from ``--seed`` and its number):

- ``save``: ``dcp.save`` / ``dcp.async_save`` with ``DataStatesWriter``, over a complete
  checkpoint (``overwrite=True``) or into a new directory beside one. After the kill the old
  checkpoint loads bit for bit (or, over it, the new one does), the new directory loads bit
  for bit or has no ``.metadata``; the next save into it succeeds and leaves nothing behind.
- ``persist``: ``CheckpointManager`` persisting a memory-tier step, or ``python -m
  dcp_datastates persist``. Every committed durable step loads bit for bit; a new manager
  restarts from a committed step bit for bit; the command run again persists the step.
- ``export``: ``python -m dcp_datastates export`` (safetensors shards or ``--format torch``),
  into a new target or over an earlier export. The target is absent, the earlier export or
  the new one, whole; the source is untouched; the next export succeeds.
- ``replication``: two gloo ranks (torchrun, CPU) with ``replicate=True``, the whole job killed;
  sometimes rank 1's memory tier is then lost. Two new ranks restart from a step at least as
  new as the one committed before the kill, bit for bit, from memory, a peer's replica or the
  durable tier.
- ``enospc``: a small tmpfs (mounted here: root only) as the memory tier or the durable tier,
  filled so a save or persist runs out of space (before or while it writes). The save fails
  with an error naming the tier, the previous step loads bit for bit, and the next save after
  the space is freed succeeds.

The kill delay is drawn within the operation's duration, measured once per variant (the
delay counts from the child's ``START``, once its interpreter is up). ``--launch exec`` (the
default) starts every child as a fresh interpreter (the replication job under torchrun, the
commands as ``python -m dcp_datastates`` runs them); ``--launch fork`` forks them from a
server that imported torch once (the same code, many times faster to start; the test suite's
run). Prints a table (kind, trials, kills that landed before the end, ok, failures with the
command reproducing each) and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import hashlib
import io
import json
import logging
import multiprocessing
import os
import random
import re
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the suite's helpers: states, bit-exact checks, tmpfs

import pytest  # noqa: E402 - mounted_tmpfs skips through it
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from helpers import (  # noqa: E402
    assert_state_equal,
    descendants,
    gone,
    load_into,
    mounted_tmpfs,
    rand_tensor,
    save,
)
from helpers.tiers import make_state, steps_in  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine  # noqa: E402
from dcp_datastates import _cli as cli  # noqa: E402
from dcp_datastates.errors import TierFullError  # noqa: E402

MiB = 1 << 20
KINDS = ("save", "persist", "export", "replication", "enospc")
STARTUP_S = 300  # a child's start, up to its START (a fresh torch import on a busy machine)
TRIAL_LIMIT_S = 600  # one trial, or the campaign stops as hung (with every thread's stack)
MARK = "@@fault-campaign "  # prefixes the messages an exec'd child prints


# -- children: what runs in the processes the campaign kills ---------------------------------------
def rank_state(seed: int, rank: int, step: int, big: int) -> dict:
    """Rank ``rank``'s state at ``step``: its own items (named by rank) and one both share."""
    return {f"rank{rank}": make_state(seed * 100 + 10 * rank + step, big=big + rank),
            "shared": {"step": torch.tensor(step)}}


def job_state(seed: int, step: int, big: int) -> dict:
    """A durable step of the two-rank job: both ranks' items."""
    return {**rank_state(seed, 0, step, big), **rank_state(seed, 1, step, big)}


def export_source(seed: int) -> dict:
    """Tensors only (an export keeps every one), several dtypes, about 3 MiB."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
    return {f"layer{k}": rand_tensor((96 << 10 if k % 4 == 3 else 48 << 10,), dtypes[k % 4],
                                     seed * 10 + k) for k in range(10)}


def child_save(p: dict, send: Callable[..., None]) -> None:
    state = make_state(p["seed"], big=p["big"])
    writer = DataStatesWriter(engine=Engine(host_cache_size="16MiB"), overwrite=True)
    send("START")
    if p["mode"] == "async":
        dcp.async_save(state, checkpoint_id=p["dir"], storage_writer=writer,
                       no_dist=True).upload_completion.result(timeout=120)
    else:
        dcp.save(state, checkpoint_id=p["dir"], storage_writer=writer, no_dist=True)
    send("DONE")


def child_persist(p: dict, send: Callable[..., None]) -> None:
    """Step 1 committed and persisted, then (the operation) step 2 saved, persisted, closed."""
    manager = CheckpointManager(p["durable"], memory_dir=p["memory"], persist=p["persist"],
                                keep_durable=p["keep_durable"],
                                engine=Engine(host_cache_size="16MiB"))
    first, second = (make_state(p["seed"] + s, big=p["big"]) for s in (1, 2))
    manager.save(1, first).result(timeout=120)
    manager.wait()
    send("START")
    manager.save(2, second).result(timeout=120)
    manager.close()
    send("DONE")


def child_command(p: dict, send: Callable[..., None]) -> None:
    """``python -m dcp_datastates ARGV``: the package's ``__main__`` as ``-m`` runs it."""
    sys.argv = ["dcp_datastates", *p["argv"]]
    send("START")
    try:
        runpy.run_module("dcp_datastates", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    send("DONE", code=code)


def child_replicate(p: dict, send: Callable[..., None]) -> None:
    """Rank r of two: step 1 committed, replicated (and persisted), then step 2 likewise."""
    rank = _init_ranks()
    manager = _rank_manager(p, rank)
    manager.save(1, rank_state(p["seed"], rank, 1, p["big"])).result(timeout=120)
    manager.wait()
    dist.barrier()
    if rank == 0:
        send("START")
    manager.save(2, rank_state(p["seed"], rank, 2, p["big"])).result(timeout=120)
    manager.wait()
    manager.close()
    dist.barrier()
    if rank == 0:
        send("DONE")


def child_restart(p: dict, send: Callable[..., None]) -> None:
    """Rank r of two restarts on the killed job's directories and says what it loaded."""
    rank = _init_ranks()
    said = _Said()
    logging.getLogger("dcp_datastates").addHandler(said)
    logging.getLogger("dcp_datastates").setLevel(logging.INFO)
    manager = _rank_manager(p, rank)
    latest = manager.latest_step()
    template = rank_state(p["seed"], rank, 0, p["big"])
    step = manager.load(template)
    error = ""
    try:
        assert_state_equal(template, rank_state(p["seed"], rank, step, p["big"]))
    except AssertionError as exc:
        error = f"rank {rank} loaded step {step}, not as saved: {exc}"
    manager.close()
    source = next((m.group(1) for line in said.lines
                   if (m := re.search(r"from (rank \d+'s replica|the \w+ tier)", line))), "?")
    send("LOADED", rank=rank, latest=latest, step=step, error=error, source=source)
    dist.destroy_process_group()


class _Said(logging.Handler):
    """The package's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _init_ranks() -> int:
    dist.init_process_group("gloo")
    return dist.get_rank()


def _rank_manager(p: dict, rank: int) -> CheckpointManager:
    return CheckpointManager(p["durable"], memory_dir=f"{p['root']}/rank_{rank}",
                             persist=p["persist"], replicate=True,
                             engine=Engine(host_cache_size="16MiB"))


CHILDREN: dict[str, Callable[[dict, Callable[..., None]], None]] = {
    "save": child_save, "persist": child_persist, "command": child_command,
    "replicate": child_replicate, "restart": child_restart}


# -- launching children ----------------------------------------------------------------------------
class Job:
    """The processes of one child role (one, or two ranks), and the messages they send."""

    pids: list[int]

    def message(self, timeout: float) -> dict | None:
        """The next message, or None (the timeout passed, or every process ended)."""
        raise NotImplementedError

    def exited(self, timeout: float) -> bool:
        """Wait for every process to end by itself."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL every process of the job still running at once (a crash), and wait for
        them to be gone."""
        for pid in self.live():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reap()
        deadline = time.monotonic() + 60
        while not all(gone(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _reap(self) -> None:
        raise NotImplementedError

    def live(self) -> list[int]:
        raise NotImplementedError

    def errors(self) -> str:
        return ""


class ExecJob(Job):
    """Fresh interpreters: ``python fault_campaign.py --child ROLE``, the ranks under torchrun."""

    def __init__(self, role: str, params: dict, ranks: int, log: Path) -> None:
        script = [str(Path(__file__).resolve()), "--child", role, json.dumps(params)]
        argv = [sys.executable, *script] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), *script]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env, start_new_session=True)
        self.pids = [self.proc.pid]

    def message(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                return None
            line = self.proc.stdout.readline()
            if not line:
                return None
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        return None

    def live(self) -> list[int]:
        if self.proc.poll() is not None:
            return []
        self.pids = [self.proc.pid, *descendants(self.proc.pid)]  # torchrun's ranks too
        return self.pids

    def _reap(self) -> None:
        self.proc.wait(60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def exited(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return True

    def errors(self) -> str:
        return self.log.read_text()[-3000:]


class ForkJob(Job):
    """Processes forked from a server that imported torch and the package once."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, role: str, params: dict,
                 ranks: int, log: Path) -> None:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(ranks)}
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(ranks):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_forked, args=(role, params, theirs, str(log), {
                **env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        self.pids = [p.pid for p in self.procs if p.pid is not None]
        self.log = log

    def message(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while self.conns and (left := deadline - time.monotonic()) > 0:
            for conn in wait(self.conns, left):
                assert isinstance(conn, Connection)
                try:
                    return conn.recv()
                except EOFError:
                    self.conns.remove(conn)
        return None

    def _reap(self) -> None:
        for proc in self.procs:
            proc.join(60)

    def live(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None and p.exitcode is None]

    def exited(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        return all(p.exitcode is not None for p in self.procs)

    def errors(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def _forked(role: str, params: dict, conn: Connection, log: str, env: dict) -> None:
    os.environ.update(env)
    with open(log, "a") as err:
        os.dup2(err.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        CHILDREN[role](params, lambda msg, **kw: conn.send({"msg": msg, **kw}))
    except BaseException:
        traceback.print_exc()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exec_child(role: str, params: str) -> None:
    """The ``--child`` entry: messages go to stdout (prefixed), anything printed to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(msg: str, **kw: object) -> None:
        out.write(MARK + json.dumps({"msg": msg, **kw}) + "\n")
        out.flush()

    CHILDREN[role](json.loads(params), send)


# -- trials ----------------------------------------------------------------------------------------
class TrialFailed(Exception):
    """A trial found what must not happen."""


@dataclass
class Outcome:
    killed: bool  # the kill landed before the operation ended
    note: str = ""


@dataclass
class Row:
    kind: str
    trials: int = 0
    killed: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)


class Campaign:
    def __init__(self, args: argparse.Namespace, engine: Engine, work: Path) -> None:
        self.args, self.engine, self.work = args, engine, work
        self.durations: dict[str, float] = {}  # measured per variant
        self.ctx: multiprocessing.context.ForkServerContext | None = None
        self.exec_kinds = set(args.exec.split(",")) if args.exec else set()
        self.kind = ""

    # -- one child run, killed at a random point ------------------------------------------------
    def launch(self, role: str, params: dict, log: Path, ranks: int = 1,
               fork: bool = False) -> Job:
        """Start ``role``'s processes: fresh interpreters where the kind is in ``--exec``,
        else (or with ``fork``) forks of the server."""
        if self.kind in self.exec_kinds and not fork:
            return ExecJob(role, params, ranks, log)
        if self.ctx is None:
            self.ctx = multiprocessing.get_context("forkserver")
            self.ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint",
                                             "dcp_datastates"])
        return ForkJob(self.ctx, role, params, ranks, log)

    def run_killed(self, variant: str, role: str, prepare: Callable[[Path], dict], base: Path,
                   rng: random.Random, ranks: int = 1, untouched: Sequence[Path] = ()) -> bool:
        """Run the child on what ``prepare(base)`` set up, SIGKILL it at a random point of its
        operation; whether the kill came before the operation ended (else it must have ended
        well). The files of the ``untouched`` directories must not change. The operation's
        duration is measured once per variant, on a copy set up beside ``base``."""
        base.mkdir(parents=True)
        if variant not in self.durations:
            measure = base.with_name("measure")
            measure.mkdir()
            self.durations[variant] = self._run(role, prepare(measure), measure, ranks, None)
        params = prepare(base)
        before = [_file_bytes(u) for u in untouched]
        delay = rng.uniform(0.0, 1.1 * self.durations[variant])
        killed = self._run(role, params, base, ranks, delay) < 0
        for u, was in zip(untouched, before, strict=True):
            if _file_bytes(u) != was:
                raise TrialFailed(f"{u}: its files changed (the operation only reads them)")
        return killed

    def _run(self, role: str, params: dict, d: Path, ranks: int, delay: float | None) -> float:
        """Run once; its START-to-DONE time, or -1 where it was killed first."""
        d.mkdir(parents=True, exist_ok=True)
        job = self.launch(role, params, d / f"{role}.log", ranks)
        try:
            start = job.message(STARTUP_S)
            if start is None or start["msg"] != "START":
                raise TrialFailed(f"{role} child never started: {start} {job.errors()}")
            t0 = time.perf_counter()
            done = job.message(TRIAL_LIMIT_S / 2 if delay is None else delay)
            took = time.perf_counter() - t0
            if done is None:
                if delay is None:
                    raise TrialFailed(f"{role} child did not finish in {TRIAL_LIMIT_S / 2} s "
                                      f"(a hang?) {job.errors()}")
                job.kill()
                return -1.0
            if done["msg"] != "DONE" or done.get("code", 0) != 0:
                raise TrialFailed(f"{role} child failed: {done} {job.errors()}")
            if not job.exited(120):
                raise TrialFailed(f"{role} child did not exit after its operation ended")
            return took
        finally:
            job.kill()

    # -- save ---------------------------------------------------------------------------------
    def trial_save(self, rng: random.Random, d: Path) -> Outcome:
        mode, target = rng.choice(["sync", "async"]), rng.choice(["overwrite", "fresh"])
        seed, big = rng.randrange(1 << 20), rng.randint(MiB, 4 * MiB)
        old, new = make_state(seed, big=big), make_state(seed + 1, big=big)

        def prepare(base: Path) -> dict:
            save(old, base / "ckpt", DataStatesWriter(engine=self.engine))
            directory = base / ("ckpt" if target == "overwrite" else "fresh")
            return {"dir": str(directory), "seed": seed + 1, "big": big, "mode": mode}

        base = d / "run"
        killed = self.run_killed(f"save-{mode}-{target}", "save", prepare, base, rng,
                                 untouched=[base / "ckpt"] if target == "fresh" else [])
        previous, directory = base / "ckpt", base / ("ckpt" if target == "overwrite" else "fresh")
        if target == "fresh":
            self.check_loads(previous, [old], "the previous checkpoint")
        self.check_loads(directory, [new] if not killed else
                         ([old, new] if target == "overwrite" else [new, None]), "the target")
        again = make_state(seed + 2, big=big)
        save(again, directory, DataStatesWriter(engine=self.engine, overwrite=True))
        self.check_loads(directory, [again], "the save after the kill")
        names = sorted(p.name for p in directory.iterdir())
        if len(names) != 3 or names[:2] != [".dcp_datastates.lock", ".metadata"]:
            raise TrialFailed(f"{directory} after the next save holds {names}")
        return Outcome(killed, f"{mode}/{target}")

    def check_loads(self, directory: Path, states: list[dict | None], what: str) -> None:
        """``directory`` loads as one of ``states``, bit for bit (None: or has no .metadata)."""
        if not (directory / ".metadata").exists():
            if None in states:
                return
            raise TrialFailed(f"{what} {directory} has no .metadata")
        errors = []
        for state in (s for s in states if s is not None):
            try:
                assert_state_equal(load_into(state, directory, engine=self.engine), state)
                return
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported below
                errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        raise TrialFailed(f"{what} {directory} has a .metadata but does not load as saved: "
                          f"{errors}")

    # -- persist ------------------------------------------------------------------------------
    def trial_persist(self, rng: random.Random, d: Path) -> Outcome:
        how = rng.choice(["manager", "command"])
        seed, big = rng.randrange(1 << 20), rng.randint(MiB, 4 * MiB)
        states = {s: make_state(seed + s, big=big) for s in (1, 2)}
        policy, keep = rng.choice([1, "idle"]), rng.choice([1, 3])

        def prepare(base: Path) -> dict:
            memory, durable = self.shm(base) / "memory", base / "durable"
            if how == "manager":
                return {"memory": str(memory), "durable": str(durable), "seed": seed,
                        "big": big, "persist": policy, "keep_durable": keep}
            with CheckpointManager(durable, memory_dir=memory, persist=None,
                                   engine=self.engine) as manager:
                for s, state in states.items():
                    manager.save(s, state).result(timeout=120)
            self.persist_command(memory, durable, "--step", "1")
            return {"argv": ["persist", "-q", str(memory), str(durable)]}

        base = d / "run"
        memory, durable = self.shm(base) / "memory", base / "durable"
        if how == "manager":
            killed = self.run_killed(f"persist-manager-{policy}", "persist", prepare, base, rng)
        else:
            killed = self.run_killed("persist-command", "command", prepare, base, rng,
                                     untouched=[memory / "step_1", memory / "step_2"])
        if not steps_in(durable):
            raise TrialFailed(f"{durable} lost step 1, persisted before the kill")
        self.check_durable(durable, states, None if killed else 2)
        if how == "command":
            self.persist_command(memory, durable)
            self.check_durable(durable, states, 2)
        self.check_restart(memory, durable, states, 1 if killed else 2)
        return Outcome(killed, how if how == "command" else f"manager, persist={policy}")

    def persist_command(self, memory: Path, durable: Path, *args: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["persist", "-q", str(memory), str(durable), *args],
                            engine=self.engine)
        if code != 0:
            raise TrialFailed(f"persist {memory} {durable} {' '.join(args)} exited {code}")

    def check_durable(self, durable: Path, states: dict[int, dict], newest: int | None) -> None:
        """Every step committed in ``durable`` loads as saved; ``newest``: one that must be."""
        steps = steps_in(durable)
        if newest is not None and newest not in steps:
            raise TrialFailed(f"{durable} lacks step {newest} (it holds {steps})")
        for step in steps:
            self.check_loads(durable / f"step_{step}", [states[step]], f"durable step {step}")

    def check_restart(self, memory: Path, durable: Path, states: dict[int, dict],
                      at_least: int) -> None:
        """A new manager loads a committed step at least as new as ``at_least`` bit for bit;
        once closed, the durable tier holds that step."""
        with CheckpointManager(durable, memory_dir=memory, persist="idle",
                               engine=self.engine) as manager:
            latest = manager.latest_step()
            if latest is None or latest < at_least:
                raise TrialFailed(f"restart: latest step {latest}, expected >= {at_least}")
            step = self.check_manager_loads(manager, states, None)
        self.check_durable(durable, states, step)

    def check_manager_loads(self, manager: CheckpointManager, states: dict[int, dict],
                            step: int | None) -> int:
        """``manager`` loads ``step`` (None: the latest) as saved; the step loaded."""
        template = make_state(0, big=states[min(states)]["big"].numel())
        got = manager.load(template, step=step)
        try:
            assert_state_equal(template, states[got])
        except AssertionError as exc:
            raise TrialFailed(f"step {got} does not load as saved: {exc}") from None
        return got

    # -- export -------------------------------------------------------------------------------
    def trial_export(self, rng: random.Random, d: Path) -> Outcome:
        fmt, over = rng.choice(["safetensors", "torch"]), rng.choice([False, True])
        seed = rng.randrange(1 << 20)
        new, old = export_source(seed), export_source(seed + 1)
        argv = ["export", "-q", "--format", fmt]
        if fmt == "safetensors":
            argv += ["--max-shard-size", rng.choice(["512KiB", "1MiB", "5GB"])]
        name = "hf" if fmt == "safetensors" else "model.pt"

        def prepare(base: Path) -> dict:
            save(new, base / "ckpt", DataStatesWriter(engine=self.engine))
            if over:
                save(old, base / "old", DataStatesWriter(engine=self.engine))
                self.export(argv, base / "old", base / name)
            return {"argv": [*argv, str(base / "ckpt"), str(base / name)]}

        base = d / "run"
        source, out = base / "ckpt", base / name
        killed = self.run_killed(f"export-{fmt}", "command", prepare, base, rng,
                                 untouched=[source])
        _check_export(out, fmt, [new] if not killed else [new, old] if over else [new, None])
        self.export(argv, source, out)
        _check_export(out, fmt, [new])
        note = f"{fmt}{' over an export' if over else ''}"
        if fmt == "safetensors" and (staging := list(out.glob(".export-*"))):
            raise TrialFailed(f"the export after the kill left {staging}")
        if fmt == "torch" and list(base.glob(".model.pt.tmp.*")):
            note += ", the killed export's temporary file left"
        return Outcome(killed, note)

    def export(self, argv: list[str], source: Path, out: Path) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main([*argv, str(source), str(out)], engine=self.engine)
        if code != 0:
            raise TrialFailed(f"{' '.join(argv)} {source} {out} exited {code}")

    # -- replication --------------------------------------------------------------------------
    def trial_replication(self, rng: random.Random, d: Path) -> Outcome:
        seed, big = rng.randrange(1 << 20), rng.randint(MiB, 3 * MiB)
        policy = rng.choice([None, "idle"])

        def prepare(base: Path) -> dict:
            return {"root": str(self.shm(base) / "nodes"), "durable": str(base / "durable"),
                    "seed": seed, "big": big, "persist": policy}

        base = d / "run"
        killed = self.run_killed(f"replication-{policy}", "replicate", prepare, base, rng,
                                 ranks=2)
        params = prepare(base)
        lost = rng.random() < 0.5
        if lost:  # rank 1's node is gone, with its memory tier
            shutil.rmtree(Path(params["root"]) / "rank_1")
        for step in steps_in(base / "durable"):
            self.check_loads(base / "durable" / f"step_{step}", [job_state(seed, step, big)],
                             f"durable step {step}")
        loaded = self.restart_ranks(params, base)
        at_least = 1 if killed else 2
        for got in loaded:
            if got["error"] or got["step"] < at_least or got["step"] != got["latest"]:
                raise TrialFailed(f"restart of rank {got['rank']}: {got}, expected a step >= "
                                  f"{at_least}")
        if loaded[0]["step"] != loaded[1]["step"]:
            raise TrialFailed(f"the ranks restarted from different steps: {loaded}")
        return Outcome(killed, f"persist={policy}{', node lost' if lost else ''}, rank 1 "
                               f"restored from {loaded[1]['source']}")

    def restart_ranks(self, params: dict, base: Path) -> list[dict]:
        """Two ranks restart on the job's directories: what each loaded."""
        job = self.launch("restart", params, base / "restart.log", ranks=2, fork=True)
        try:
            loaded = [job.message(STARTUP_S) for _ in range(2)]
            if not job.exited(120):
                raise TrialFailed("the restarted ranks did not exit")
        finally:
            job.kill()
        if None in loaded:
            raise TrialFailed(f"restart failed: {loaded} {job.errors()}")
        return sorted((got for got in loaded if got is not None), key=lambda got: got["rank"])

    # -- enospc -------------------------------------------------------------------------------
    def trial_enospc(self, rng: random.Random, d: Path) -> Outcome:
        tier = rng.choice(["memory", "durable"])
        seed, big = rng.randrange(1 << 20), rng.randint(MiB, 3 * MiB)
        states = {s: make_state(seed + s, big=big) for s in (1, 2, 3)}
        size = 6 * big + 2 * MiB  # six states, and room for the small files
        try:
            with mounted_tmpfs(f"{size // 1024}k", "dcp_faults_enospc_") as mnt:
                memory = mnt / "memory" if tier == "memory" else self.shm(d) / "memory"
                durable = mnt / "durable" if tier == "durable" else d / "durable"
                return Outcome(False, self.fill_then_save(rng, tier, mnt, memory, durable,
                                                          states))
        except pytest.skip.Exception as exc:
            raise TrialFailed(f"cannot mount a tmpfs: {exc}") from None

    def fill_then_save(self, rng: random.Random, tier: str, mnt: Path, memory: Path,
                       durable: Path, states: dict[int, dict]) -> str:
        """Step 1 saved (and persisted); the file system filled to a random few MiB left, then
        all of it at a random moment of step 2's save; step 2 fails saying so, or fits; the
        steps committed load; with the space back, step 3 saves and loads. How step 2 went."""
        manager = CheckpointManager(durable, memory_dir=memory, keep_memory=1,
                                    persist=1 if tier == "durable" else None,
                                    keep_durable=None, engine=self.engine)
        prepared = rng.random() < 0.5  # the memory tier's slots made before the saves
        try:
            if prepared:
                manager.prepare(states[1], wait=True)
            start = time.perf_counter()
            manager.save(1, states[1])
            manager.wait()
            took = time.perf_counter() - start
            nbytes = states[1]["big"].numel()
            _fill(mnt / "filler", mnt, leave=rng.randint(nbytes // 2, 2 * nbytes))
            with _filled_later(mnt / "filler2", mnt, rng.uniform(0.0, 1.2 * took)):
                outcome = _save_or_fail(manager, 2, states[2], mnt)
            # a failed persist leaves step 2 committed in memory
            latest = 1 if outcome != "fit" and tier == "memory" else 2
            if manager.latest_step() != latest:
                raise TrialFailed(f"after step 2 {outcome}: latest step "
                                  f"{manager.latest_step()}, expected {latest}")
            self.check_manager_loads(manager, states, latest)
            if tier == "durable":
                self.check_durable(durable, states, 1 if outcome != "fit" else 2)
            (mnt / "filler").unlink(missing_ok=True)
            (mnt / "filler2").unlink(missing_ok=True)
            manager.save(3, states[3])
            manager.wait()
            self.check_manager_loads(manager, states, 3)
        except BaseException:
            with contextlib.suppress(Exception):
                manager.close()
            raise
        manager.close()  # raises nothing: wait() raised step 2's error
        if tier == "durable":
            self.check_durable(durable, states, 3)
        return f"{tier}{', slots made first' if prepared else ''}: {outcome}"

    def shm(self, d: Path) -> Path:
        """The directory for ``d``'s memory tiers, in /dev/shm."""
        path = self.work / "shm" / d.relative_to(self.work / "disk")
        path.mkdir(parents=True, exist_ok=True)
        return path


def _file_bytes(directory: Path) -> dict[str, str]:
    """Digests of the regular files of ``directory`` (by name)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()
            if p.is_file()}


def _check_export(out: Path, fmt: str, choices: list[dict | None]) -> None:
    """``out`` holds one of ``choices`` whole (None: or no model a loader takes)."""
    got: dict | None = None
    if fmt == "torch":
        if out.exists():
            got = torch.load(out, weights_only=True)
    else:
        index = out / "model.safetensors.index.json"
        single = out / "model.safetensors"
        if index.exists():
            shards = set(json.loads(index.read_text())["weight_map"].values())
            got = {}
            for shard in shards:
                got |= load_file(out / shard)
            extra = {p.name for p in out.iterdir() if not p.name.startswith(".")} - shards - {
                index.name}
            if extra:
                raise TrialFailed(f"{out} holds files its index does not name: {sorted(extra)}")
        elif single.exists():
            got = load_file(single)
    if got is None:
        if None in choices:
            return
        raise TrialFailed(f"{out}: no export where one must be")
    for state in (s for s in choices if s is not None):
        with contextlib.suppress(AssertionError):
            assert_state_equal(got, state)
            return
    raise TrialFailed(f"{out} holds an export that is neither the new one nor the old one")


def _fill(path: Path, mnt: Path, leave: int) -> None:
    """Grow ``path`` until ``mnt`` has about ``leave`` bytes free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    if free <= leave:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, os.fstat(fd).st_size, free - leave)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def _filled_later(path: Path, mnt: Path, delay: float) -> Iterator[None]:
    """While in the block: after ``delay``, a thread takes what space ``mnt`` has left."""
    stop = threading.Event()

    def fill() -> None:
        if stop.wait(delay):
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for piece in (64 << 10, 4 << 10):  # to the last page
                with contextlib.suppress(OSError):  # ENOSPC: the next size
                    while not stop.is_set():
                        os.posix_fallocate(fd, os.fstat(fd).st_size, piece)
        finally:
            os.close(fd)

    thread = threading.Thread(target=fill)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _save_or_fail(manager: CheckpointManager, step: int, state: dict, mnt: Path) -> str:
    """Save ``step``: "fit", or how it failed (an error naming the full file system)."""
    manager.save(step, state)
    try:
        manager.wait()  # raises the save's error (once)
        return "fit"
    except TierFullError as exc:
        if str(mnt) not in str(exc):
            raise TrialFailed(f"TierFullError not naming {mnt}: {exc}") from None
        return "TierFullError"
    except OSError as exc:
        if exc.errno != errno.ENOSPC or str(mnt) not in str(exc):
            raise TrialFailed(f"not an ENOSPC naming {mnt}: {exc!r}, from {_origin(exc)}"
                              ) from None
        return "ENOSPC"
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported
        raise TrialFailed(f"step {step} failed unclearly: {type(exc).__name__}: "
                          f"{str(exc)[:500]}") from None


def _origin(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frames."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


# -- the campaign ----------------------------------------------------------------------------------
def run_kind(campaign: Campaign, kind: str, trials: list[int], seed: int, row: Row) -> None:
    trial_fn = getattr(campaign, f"trial_{kind}")
    campaign.kind = kind
    for trial in trials:
        rng = random.Random(f"{seed}/{kind}/{trial}")
        d = campaign.work / "disk" / f"{kind}_{trial}"
        d.mkdir(parents=True)
        faulthandler.dump_traceback_later(TRIAL_LIMIT_S, exit=True)
        start = time.monotonic()
        try:
            outcome = trial_fn(rng, d)
        except TrialFailed as exc:
            row.failures.append(f"trial {trial}: {str(exc)[:400]}")
            print(f"{kind} {trial}: FAILED: {exc} (files kept in {d})", file=sys.stderr)
            continue
        except (Exception, CheckpointException):  # noqa: BLE001 - a failure too
            row.failures.append(f"trial {trial}: {traceback.format_exc(limit=1)[-400:]}")
            print(f"{kind} {trial}: FAILED (files kept in {d})\n{traceback.format_exc()}",
                  file=sys.stderr)
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
            row.trials += 1
        row.ok += 1
        row.killed += outcome.killed
        row.notes[outcome.note] = row.notes.get(outcome.note, 0) + 1
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(campaign.work / "shm" / d.name, ignore_errors=True)
        if campaign.args.verbose:
            print(f"{kind} {trial}: ok ({'killed' if outcome.killed else 'finished'}, "
                  f"{outcome.note}, {time.monotonic() - start:.1f} s)", file=sys.stderr)


def table(rows: list[Row], args: argparse.Namespace) -> str:
    lines = ["| kind | trials | killed mid-operation | ok | failures |", "|---|---|---|---|---|"]
    for r in rows:
        fails = "; ".join(r.failures) if r.failures else "none"
        lines.append(f"| {r.kind} | {r.trials} | {r.killed} | {r.ok} | {fails} |")
    lines.append("")
    for r in rows:
        lines.append(f"{r.kind}: " + ", ".join(f"{n} x{c}" for n, c in sorted(r.notes.items())))
    failed = [r for r in rows if r.failures]
    for r in failed:
        ids = ",".join(f.split(":")[0].split()[1] for f in r.failures)
        lines.append(f"reproduce: python benchmarks/fault_campaign.py --kinds {r.kind} --seed "
                     f"{args.seed} --exec '{args.exec}' --only {ids}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50, help="trials per kind (default 50)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {KINDS}")
    ap.add_argument("--seed", type=int, default=0, help="draws every trial's variant and delay")
    ap.add_argument("--only", default="", help="comma-separated trial numbers to run again")
    ap.add_argument("--exec", default="replication", help="kinds whose children start as "
                    "fresh interpreters (the ranks under torchrun; default: replication); the "
                    "others fork from a server that imported torch once")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per trial on stderr")
    args = ap.parse_args(argv)
    unknown = set(args.kinds.split(",") + (args.exec.split(",") if args.exec else [])) - set(
        KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}: choose among {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    trials = [int(t) for t in args.only.split(",")] if args.only else list(range(args.trials))
    work = Path(tempfile.mkdtemp(prefix="dcp_faults_"))
    shm = Path(tempfile.mkdtemp(prefix="dcp_faults_", dir="/dev/shm"))
    (work / "shm").symlink_to(shm)
    engine = Engine(host_cache_size="32MiB")
    rows = []
    try:
        campaign = Campaign(args, engine, work)
        for kind in args.kinds.split(","):
            rows.append(Row(kind))
            start = time.monotonic()
            run_kind(campaign, kind, trials, args.seed, rows[-1])
            print(f"{kind}: {rows[-1].ok}/{rows[-1].trials} ok in "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr)
    finally:
        engine.close()
    print(table(rows, args))
    if not any(r.failures for r in rows):  # else the failed trials' files stay
        shutil.rmtree(work)
        shutil.rmtree(shm)
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        exec_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
