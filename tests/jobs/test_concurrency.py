"""Saves faster than the disk, one checkpoint per step, loads during saves, bounded memory;
fresh writers and readers per save on one engine; saves racing into one directory; a save that
fails on one thread does not hold up the saves of another."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    MARKS,
    assert_state_equal,
    blank_like,
    clone_state,
    data_files,
    load_into,
    raises_in_dcp,
    rand_tensor,
    save,
    small_checkpoint,
    small_state,
)
from helpers.fakes import FaultyBackend
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointError, DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._format.directory import LOCK_NAME
from dcp_datastates._format.metadata_file import read_metadata
from dcp_datastates._io import make_backend

MiB = 1 << 20
TIMEOUT = 60
TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

pytestmark = MARKS


@pytest.fixture
def slow_disk(faulty_engine) -> Callable[..., Engine]:
    """Engines whose data writes take 5 ms more each: saves outrun the disk."""
    return lambda **kw: faulty_engine("threads", delay_s=0.005, **kw)[0]


def _base() -> dict:
    return {
        "big": rand_tensor((MiB,), torch.uint8, seed=1),
        "w": rand_tensor((128, 257), torch.float32, seed=2),
        "b": rand_tensor((300,), torch.bfloat16, seed=3),
        "step": 0,
    }


def _advance(state: dict, step: int) -> None:
    """One training step, in place: the state at step k is a function of k alone."""
    state["big"].add_(1)
    state["w"].mul_(-1).add_(0.5)
    state["b"].add_(1)
    state["step"] = step


def _state_at(base: dict, step: int) -> dict:
    state = clone_state(base)
    for k in range(1, step + 1):
        _advance(state, k)
    return state


class _CacheWatch:
    """Samples the engine's host memory from a thread; records the most seen."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_bytes = self.max_leases = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_bytes = max(self.max_bytes, self.engine.cache_bytes())
            self.max_leases = max(self.max_leases, self.engine.live_leases())
            time.sleep(0.0005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _locked_memory() -> int:
    """Bytes of this process's memory that is locked or pinned (VmLck + VmPin)."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmLck:", "VmPin:")):
                total += int(line.split()[1]) * 1024
    return total


def test_back_to_back_async_saves_outrun_the_disk(
    tmp_path: Path, make_writer, slow_disk
) -> None:
    writer = make_writer(engine=slow_disk(host_cache_size="8MiB"))
    base = _base()
    state = clone_state(base)
    responses = []
    for step in range(8):
        responses.append(dcp.async_save(state, checkpoint_id=tmp_path / f"c{step}",
                                        storage_writer=writer, no_dist=True))
        responses[-1].staging_completion.result(timeout=TIMEOUT)
        _advance(state, step + 1)
    for r in responses:
        r.upload_completion.result(timeout=TIMEOUT)
    for step in range(8):
        expected = _state_at(base, step)
        assert_state_equal(load_into(expected, tmp_path / f"c{step}"), expected)


@pytest.mark.parametrize("in_flight", ["one", "many"])
def test_checkpoint_every_step_with_a_small_cache(
    tmp_path: Path, slow_disk, in_flight: str
) -> None:
    cache = 4 * MiB
    steps = 50
    engine = slow_disk(host_cache_size=cache)
    writers: list[DataStatesWriter] = []

    def async_save(state: dict, name: str):
        writers.append(DataStatesWriter(engine=engine))  # DCP's idiom: a writer per save
        return dcp.async_save(state, checkpoint_id=tmp_path / name, storage_writer=writers[-1],
                              no_dist=True)

    base = _base()
    state = clone_state(base)
    # Warm up (threads, allocator arenas, the cache's pages), then measure.
    async_save(state, "warm").upload_completion.result(timeout=TIMEOUT)
    rss0 = _rss()
    watch = _CacheWatch(engine)
    pending = []
    peak = rss0
    try:
        for step in range(steps):
            r = async_save(state, f"c{step}")
            r.staging_completion.result(timeout=TIMEOUT)
            _advance(state, step + 1)
            if in_flight == "one":
                r.upload_completion.result(timeout=TIMEOUT)
            else:
                pending.append(r)
            peak = max(peak, _rss())
        for r in pending:
            r.upload_completion.result(timeout=TIMEOUT)
    finally:
        watch.stop()
    peak = max(peak, _rss())
    assert peak - rss0 < cache + 64 * MiB, f"RSS grew by {(peak - rss0) / MiB:.1f} MiB"
    assert watch.max_bytes <= cache, f"the engine held {watch.max_bytes} bytes of host cache"
    assert engine.cache_bytes() <= cache
    stats = [w.last_stats() for w in writers]
    assert len(stats) == steps + 1 and len({id(s) for s in stats}) == steps + 1
    assert [s.overflow_bytes for s in stats] == [0] * (steps + 1)
    assert all(s.staged_bytes > MiB for s in stats)
    assert engine.live_leases() == 0
    expected = clone_state(base)
    for step in range(steps):
        assert_state_equal(load_into(expected, tmp_path / f"c{step}"), expected, f"step {step}")
        _advance(expected, step + 1)


def test_load_checkpoint_k_while_saving_k_plus_1(
    tmp_path: Path, make_writer, slow_disk
) -> None:
    writer = make_writer(engine=slow_disk(host_cache_size="4MiB"))
    base = _base()
    state = clone_state(base)
    dcp.async_save(state, checkpoint_id=tmp_path / "c0", storage_writer=writer,
                   no_dist=True).upload_completion.result(timeout=TIMEOUT)
    expected = clone_state(base)
    overlapped = 0
    for step in range(1, 8):
        _advance(state, step)
        r = dcp.async_save(state, checkpoint_id=tmp_path / f"c{step}", storage_writer=writer,
                           no_dist=True)
        loaded = load_into(expected, tmp_path / f"c{step - 1}")  # while step's save flushes
        overlapped += not r.upload_completion.done()
        assert_state_equal(loaded, expected, f"step {step - 1}")
        r.upload_completion.result(timeout=TIMEOUT)
        _advance(expected, step)
    assert overlapped, "no load overlapped a save: the test did not test anything"
    assert_state_equal(load_into(expected, tmp_path / "c7"), expected)


# -- a fresh writer and reader per save, memory freed and mapped again ---------------------------
def _round_state(r: int) -> dict:
    """Round ``r``'s state: new bytes every round, its size cycling over 4 sizes (so that an
    ``auto`` cache grows and its old arena is freed)."""
    size = (1 + (r // 2) % 4) * MiB
    return {
        "big": rand_tensor((size + 4096 * r + 3,), torch.uint8, seed=1000 + r),
        "w": rand_tensor((96, 33), torch.float32, seed=2000 + r),
        "n": {"bias": rand_tensor((7,), torch.bfloat16, seed=3000 + r), "round": r},
    }


def test_fresh_writer_and_reader_every_save_with_memory_remapped(
    tmp_path: Path, io_backend: str
) -> None:
    """24 rounds, each a fresh DataStatesWriter() and DataStatesReader() on the engine, as DCP
    users write it. The engine's cache is "auto": the state grows every few rounds, so snapshot
    arenas are made, retired and freed; every 8 rounds the engine is closed and a new one made,
    so new arenas are mapped where freed ones were. Every round must load its own bytes (an
    io_uring registration outliving its memory would write or read the old pages), and the
    process's locked/pinned memory must stay that of the current cache."""
    backend = FaultyBackend(make_backend(io_backend)[0])  # no faults: it records registrations
    pinned_before = _locked_memory()
    engine: Engine | None = None
    try:
        for r in range(24):
            if r % 8 == 0:
                if engine is not None:
                    engine.close()
                    assert backend.live_buffers() == [], "closing the engine left registrations"
                engine = Engine(io_backend=backend, host_cache_size="auto", io_workers=2)
            state = _round_state(r)
            expected = clone_state(state)
            directory = tmp_path / f"r{r}"
            writer = DataStatesWriter(engine=engine)
            if r % 2:
                dcp.save(state, checkpoint_id=directory, storage_writer=writer, no_dist=True)
            else:
                response = dcp.async_save(state, checkpoint_id=directory, storage_writer=writer,
                                          no_dist=True)
                response.staging_completion.result(timeout=TIMEOUT)
                state["big"].fill_(0xEE)  # the next step changes it: the snapshot must not
                response.upload_completion.result(timeout=TIMEOUT)
            assert engine.live_leases() == 0, f"round {r}"
            loaded = blank_like(expected)
            dcp.load(loaded, checkpoint_id=directory, storage_reader=DataStatesReader(
                engine=engine), no_dist=True)
            assert_state_equal(loaded, expected, f"round {r}")
            assert engine.live_leases() == 0, f"round {r}"
            live = {addr for addr, _ in backend.live_buffers()}
            assert len(live) == len(backend.live_buffers()), backend.live_buffers()
        cache = engine.cache_bytes()
        assert cache <= (4 + 1) * MiB + 128 * MiB + 8 * MiB, cache  # snapshot arena + bounce
        assert sum(n for _, n in backend.live_buffers()) == cache
        # io_uring pins (and accounts) registered buffers once per ring, a ring per I/O thread
        pinned = _locked_memory() - pinned_before
        bound = engine.threads.io_workers * cache if io_backend == "uring" else 0
        assert pinned <= bound + MiB, (
            f"{pinned / MiB:.0f} MiB locked/pinned for a {cache / MiB:.0f} MiB cache")
    finally:
        if engine is not None:
            engine.close()
        backend.close()
    assert backend.live_buffers() == []
    assert _locked_memory() - pinned_before <= MiB
    registered = collections.Counter(addr for addr, _ in backend.registered)
    assert max(registered.values()) > 1, (
        "no arena was mapped again where a freed one had been: the test tested nothing")


# -- two saves racing into one directory ---------------------------------------------------------
def _race_state(seed: int) -> dict:
    return {"big": rand_tensor((3 * MiB + 123,), torch.uint8, seed=seed),
            "w": rand_tensor((64, 100), torch.float32, seed=seed + 1), "seed": seed}


def _check_race(directory: Path, outcomes: dict[int, str], round_: int) -> None:
    """After a race: one save at least succeeded, the other failed at once naming the
    directory (or succeeded after it); the directory holds exactly one whole checkpoint, that
    of a save that succeeded, and .metadata names only files that exist."""
    ok = [seed for seed, outcome in outcomes.items() if outcome == "ok"]
    assert ok, f"round {round_}: no save succeeded: {outcomes}"
    for outcome in outcomes.values():
        if outcome != "ok":
            assert "is being written by another save" in outcome, (round_, outcome)
            assert str(directory) in outcome, (round_, outcome)
    metadata = read_metadata(directory)
    named = {loc.file for loc in metadata.storage_data.values()}
    missing = [name for name in named if not (directory / name).is_file()]
    assert not missing, f"round {round_}: .metadata names missing files {missing}"
    assert len(named) == 1, named
    template = _race_state(0)
    loaded = load_into(template, directory)
    matches = [seed for seed in ok if loaded["seed"] == seed]
    assert matches, f"round {round_}: loaded the state of seed {loaded['seed']}, not one of {ok}"
    assert_state_equal(loaded, _race_state(matches[0]), f"round {round_}")


def _outcome(error: BaseException | None, seconds: float) -> str:
    if error is None:
        return "ok"
    if isinstance(error, CheckpointException):
        (error,) = [exc for exc, _ in error.failures.values()]
    assert isinstance(error, CheckpointError), repr(error)
    assert seconds < 5, f"the refused save took {seconds:.1f} s: it must fail at once"
    return str(error)


def test_two_engines_race_into_one_directory(tmp_path: Path, make_engine) -> None:
    """Two threads, each with an engine of its own (as two libraries in one process would),
    save into one directory with overwrite=True, ten times."""
    engines = [make_engine(host_cache_size="16MiB", io_backend="threads", io_workers=2)
               for _ in range(2)]
    directory = tmp_path / "ckpt"
    for round_ in range(10):
        seeds = (10 * round_ + 1, 10 * round_ + 5)
        barrier = threading.Barrier(2)
        outcomes: dict[int, str] = {}

        def run(engine: Engine, seed: int, barrier=barrier, outcomes=outcomes) -> None:
            state = _race_state(seed)
            writer = DataStatesWriter(engine=engine, overwrite=True)
            barrier.wait(TIMEOUT)
            start = time.monotonic()
            error = None
            try:
                dcp.save(state, checkpoint_id=directory, storage_writer=writer, no_dist=True)
            except BaseException as exc:  # noqa: BLE001 - checked below
                error = exc
            outcomes[seed] = _outcome(error, time.monotonic() - start)

        threads = [threading.Thread(target=run, args=(e, s)) for e, s in zip(engines, seeds,
                                                                              strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert len(outcomes) == 2, outcomes
        _check_race(directory, outcomes, round_)
        assert all(e.live_leases() == 0 for e in engines)
    assert (directory / LOCK_NAME).exists()
    assert len(data_files(directory)) == 1


class _FinishAfter(DataStatesWriter):
    """The coordinator of a multi-rank save: between its ``write_data`` and ``finish`` it
    waits for the other ranks' data files (here: until ``go`` is set)."""

    def __init__(self, *args: object, go: threading.Event, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.go = go
        self.flushed = threading.Event()

    def finish(self, metadata, results) -> None:
        self.flushed.set()
        assert self.go.wait(TIMEOUT)
        super().finish(metadata, results)


def test_directory_stays_claimed_until_commit(tmp_path: Path, make_engine) -> None:
    """A save holds its directory from its claim to its commit: one coming in while the first
    waits for its other ranks (data written, .metadata not yet) is refused at once, and the
    first commits a checkpoint whose files are all there."""
    engines = [make_engine(host_cache_size="16MiB", io_backend="threads", io_workers=2)
               for _ in range(2)]
    directory = tmp_path / "ckpt"
    states = [_race_state(1), _race_state(2)]
    expected = clone_state(states[0])
    go = threading.Event()
    first = _FinishAfter(engine=engines[0], overwrite=True, go=go)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dcp.save(states[0], checkpoint_id=directory, storage_writer=first, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert first.flushed.wait(TIMEOUT)
        start = time.monotonic()
        with raises_in_dcp(CheckpointError,
                           rf"{re.escape(str(directory))} is being written by another save"):
            dcp.save(states[1], checkpoint_id=directory, no_dist=True,
                     storage_writer=DataStatesWriter(engine=engines[1], overwrite=True))
        assert time.monotonic() - start < 5, "the refused save must fail at once"
    finally:
        go.set()
        thread.join(TIMEOUT)
    assert not errors, errors
    _check_race(directory, {1: "ok"}, 0)
    assert_state_equal(load_into(expected, directory), expected)


_RACER = textwrap.dedent(
    """
    import sys, time, traceback, warnings
    warnings.filterwarnings("ignore")
    sys.path[:0] = [{tests!r}, {tests!r} + "/jobs"]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from test_concurrency import _race_state
    from dcp_datastates import DataStatesWriter, Engine

    engine = Engine(host_cache_size="16MiB", io_backend="threads", io_workers=2)
    print("READY", flush=True)
    for line in sys.stdin:
        directory, seed = line.split()
        state = _race_state(int(seed))
        start = time.monotonic()
        try:
            dcp.save(state, checkpoint_id=directory,
                     storage_writer=DataStatesWriter(engine=engine, overwrite=True), no_dist=True)
            print("ok", flush=True)
        except CheckpointException as exc:
            (err,) = [e for e, _ in exc.failures.values()]
            print(f"{{time.monotonic() - start:.3f}} {{type(err).__name__}}: "
                  f"{{str(err).replace(chr(10), ' ')}}", flush=True)
        assert engine.live_leases() == 0
    engine.close()
    """
)


def test_two_processes_race_into_one_directory(tmp_path: Path) -> None:
    """Two processes save into one directory with overwrite=True, ten times."""
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = _RACER.format(tests=str(TESTS))
    racers = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env) for _ in range(2)]
    directory = tmp_path / "ckpt"
    try:
        for p in racers:
            line = p.stdout.readline()
            assert line.strip() == "READY", (line, p.stderr.read() if p.poll() else "")
        for round_ in range(10):
            seeds = (10 * round_ + 2, 10 * round_ + 7)
            for p, seed in zip(racers, seeds, strict=True):
                p.stdin.write(f"{directory} {seed}\n")
                p.stdin.flush()
            outcomes = {}
            for p, seed in zip(racers, seeds, strict=True):
                line = p.stdout.readline().strip()
                assert line, p.stderr.read() if p.poll() is not None else "no answer"
                if line != "ok":
                    seconds, line = line.split(" ", 1)
                    assert line.startswith("CheckpointError: "), line
                    assert float(seconds) < 5, f"the refused save took {seconds} s"
                outcomes[seed] = line
            _check_race(directory, outcomes, round_)
        for p in racers:
            p.stdin.close()
            assert p.wait(TIMEOUT) == 0, p.stderr.read()
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdout, p.stderr):
                f.close()
    assert len(data_files(directory)) == 1


# -- a failed save and the turns of the others ------------------------------------------------


def test_failed_save_on_one_thread_does_not_block_saves_on_another(
    tmp_path: Path, make_writer
) -> None:
    directory, _ = small_checkpoint(tmp_path, make_writer)
    writer = make_writer()
    saver = ThreadPoolExecutor(1, thread_name_prefix="long-lived-saver")
    other = ThreadPoolExecutor(1, thread_name_prefix="other-saver")
    state = small_state(seed=9)
    expected = clone_state(state)
    try:
        failed = saver.submit(save, small_state(seed=8), directory, writer)  # no overwrite=True
        with pytest.raises(CheckpointException, match="Checkpoint already exists"):
            failed.result(timeout=60)
        second = other.submit(save, state, tmp_path / "fresh", writer)
        finished = True
        try:
            second.result(timeout=5)
        except FutureTimeout:
            finished = False
    finally:
        saver.shutdown(wait=True)  # the owner thread exits: a waiting save takes the turn over
        other.shutdown(wait=True)
    assert finished, "the save on another thread waited for the failed save's turn"
    assert_state_equal(load_into(expected, tmp_path / "fresh"), expected)
