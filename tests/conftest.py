"""Fixtures of the whole suite (the helpers they use are in ``helpers``)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import BACKENDS, Tiers, require_backend, split_engine_args
from helpers.fakes import FaultyBackend, HeldSettles

from dcp_datastates import DataStatesWriter, Engine
from dcp_datastates._io import make_backend


@pytest.fixture
def no_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DCP_DATASTATES_IO`` would silently replace the backend a test asks for."""
    monkeypatch.delenv("DCP_DATASTATES_IO", raising=False)


@pytest.fixture(params=BACKENDS)
def io_backend(request: pytest.FixtureRequest) -> str:
    return require_backend(request.param)


@pytest.fixture
def engine() -> Iterator[Engine]:
    """A small engine on the thread backend, closed after the test."""
    made = Engine(io_backend="threads", host_cache_size="8MiB", io_workers=2)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Build engines and close them all at teardown (asserting none still holds memory)."""
    engines: list[Engine] = []

    def make(**kw: object) -> Engine:
        engines.append(Engine(**kw))
        return engines[-1]

    yield make
    for e in engines:
        assert e.live_leases() == 0, "a save kept host cache memory after it ended"
        e.close()


@pytest.fixture
def make_writer(make_engine) -> Callable[..., DataStatesWriter]:
    """Build writers on test engines (small host cache, threads backend by default); writers
    asking for the same engine arguments share one engine, as writers of a run do."""
    engines: dict[tuple, Engine] = {}

    def make(path: Path | str | None = None, **kw: object) -> DataStatesWriter:
        args = {"host_cache_size": "4MiB", "io_backend": "threads", "io_workers": 4,
                **split_engine_args(kw)}
        key = tuple(sorted(args.items(), key=lambda kv: kv[0]))
        if "engine" not in kw:
            kw["engine"] = engines.get(key) or engines.setdefault(key, make_engine(**args))
        return DataStatesWriter(path, **kw)

    return make


@pytest.fixture
def faulty_engine() -> Iterator[Callable[..., tuple[Engine, FaultyBackend]]]:
    """``make(backend="threads", host_cache_size=..., **faults)``: an engine whose I/O goes
    through a :class:`FaultyBackend` over a real backend (``gated=True`` holds every data write
    until ``backend.gate`` is set); closed at teardown, asserting that no lease or buffer
    registration was left behind."""
    made: list[tuple[Engine, FaultyBackend]] = []

    def make(backend: str = "threads", *, host_cache_size: int | str = "8MiB",
             io_workers: int = 4, **faults: object) -> tuple[Engine, FaultyBackend]:
        faulty = FaultyBackend(make_backend(backend)[0], **faults)
        made.append((Engine(io_backend=faulty, host_cache_size=host_cache_size,
                            io_workers=io_workers), faulty))
        return made[-1]

    yield make
    problems = []
    for engine, faulty in made:
        faulty.gate.set()
        if engine.live_leases():
            problems.append(f"{engine.live_leases()} lease(s) live at the end")
        engine.close()
        faulty.close()
        if faulty.live_buffers():
            problems.append(f"buffers still registered: {faulty.live_buffers()}")
    assert not problems, problems


@pytest.fixture
def held() -> Iterator[HeldSettles]:
    """An engine's settle thread that holds every settle until ``held.gate`` is set (then
    shut down at teardown)."""
    settles = HeldSettles(limit_s=60.0)
    yield settles
    settles.gate.set()
    settles.shutdown(wait=True)


@pytest.fixture
def tiers() -> Iterator[Tiers]:
    shm = Path(tempfile.mkdtemp(prefix="dcp_tiers_test_", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="dcp_tiers_test_"))
    try:
        yield Tiers(shm / "memory", disk / "durable", shm / "scratch")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The package's log records at INFO and above."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    return caplog
