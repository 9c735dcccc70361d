"""torchtitan's real CheckpointManager routed through dcp_datastates (torchtitan 0.3.x and 0.2.x,
on CPU).

Needs torchtitan importable, either release; it installs without its dependencies (which would
bring a CUDA torch) plus those its checkpoint and optimizer modules import::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro
    pip install --no-deps --target DIR torchtitan==0.2.2 torchdata==0.11.0   # PYTHONPATH=DIR

(``make test`` runs this module once with each.) Packages torchtitan imports but these tests
never use (0.2.x: tokenizers, tensorboard, triton; datasets) get the stand-ins of
``examples/torchtitan_train.py`` where they are missing. Without torchtitan this module is
skipped. What differs between the releases goes through the adapter's ``TORCHTITAN``. The
single-process tests run a world of one gloo rank (torchtitan's manager asks torch.distributed
for its rank and makes a gloo group for async saves); ``test_fsdp2_async_manager_multi_rank``
runs under mpirun with the other MPI tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from helpers import mpi_util
from helpers.fakes import FaultyBackend
from helpers.mpi_util import World, agree
from helpers.tiers import slot_files, wait_until
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from torchtitan_train import stand_ins_for_missing_packages  # noqa: E402

stand_ins_for_missing_packages()
pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is not installed")

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from dcp_datastates import DataStatesReader, Engine, default_engine  # noqa: E402
from dcp_datastates._io import IOReq, ThreadPoolBackend  # noqa: E402
from dcp_datastates.integrations.torchtitan import (  # noqa: E402
    TORCHTITAN,
    DataStates,
    DataStatesCheckpointManager,
    TorchtitanAPI,
    enable_datastates,
    is_datastates_checkpoint,
)
from dcp_datastates.tiers._claims import LOCK_NAME as TIER_LOCK  # noqa: E402
from dcp_datastates.tiers._steps import committed_steps  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:To get the last learning rate computed")
world = mpi_util.world
shared = mpi_util.shared
MODES = ["disabled", "async", "async_with_pinned_mem"]
#: How long each snapshot is held back in the tests that check the overlap, once released.
STAGING_DELAY = 0.5
#: The longest a held snapshot waits for its release (a test that forgets it still ends).
HOLD_LIMIT = 60.0


@pytest.fixture
def engine() -> Iterator[Engine]:
    """The engine the managers of a test save and load with (as a trainer would make one)."""
    with Engine(host_cache_size="16MiB", io_backend="threads", io_workers=2) as made:
        yield made
        assert made.live_leases() == 0, "a save kept host cache memory after it ended"


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-rank gloo world, as torchtitan's manager needs torch.distributed."""
    if dist.is_initialized():
        pytest.skip("single-process test; the process group is already taken")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    import gc

    gc.collect()
    dist.destroy_process_group()
    gc.collect()


class Counter(Stateful):
    """Stands in for the trainer's train_state and the dataloader (plain Stateful objects)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "history": [self.step] * 2}

    def load_state_dict(self, state_dict: dict) -> None:
        assert state_dict["history"] == [state_dict["step"]] * 2
        self.step = state_dict["step"]


def config_class(manager_cls: type) -> type:
    """The config class of ``manager_cls`` (0.2.x's CheckpointManager has none of its own)."""
    return getattr(manager_cls, "Config", None) or TORCHTITAN.config


def wait_for_saving(manager: CheckpointManager) -> None:
    """Wait for the manager's save in flight as torchtitan does before the next save."""
    if TORCHTITAN.legacy:
        manager._async_wait()
    else:
        manager.maybe_wait_for_saving()


def build(cls: type, folder: Path, config: object, **kwargs: object) -> CheckpointManager:
    """A manager of ``cls`` over ``folder`` (the trainer's other arguments: ``kwargs``)."""
    return TORCHTITAN.build(cls, config, sd_adapter=None, base_folder=str(folder), **kwargs)


class Run:
    """A tiny model with torchtitan's own optimizer and LR scheduler containers."""

    def __init__(self, seed: int, mesh: object | None = None) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 5))
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model[0], mesh=mesh)
            fully_shard(self.model[2], mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers, self.lr_schedulers = TORCHTITAN.containers(
            [self.model], lambda s: 1.0 / (1 + s), lr=1e-2, weight_decay=0.1)
        self.train_state = Counter()
        self.dataloader = Counter()

    def manager(self, folder: Path, mode: str, cls: type = CheckpointManager,
                build_args: dict | None = None, **config: object) -> CheckpointManager:
        cfg = config_class(cls)(**{
            "enable": True, "folder": "ckpt", "interval": 2, "async_mode": mode,
            "keep_latest_k": 0, "last_save_model_only": False, **config})
        return build(cls, folder, cfg, dataloader=self.dataloader, model_parts=[self.model],
                     optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                     states={"train_state": self.train_state}, **(build_args or {}))

    def step(self, step: int, manager: CheckpointManager | None = None) -> None:
        """One step as torchtitan's trainer orders it."""
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 5, (6,), generator=gen)
        self.optimizers.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        if manager is not None:
            manager.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.step = step
        self.dataloader.step = 10 * step

    def snapshot(self) -> dict:
        """Everything the manager saves, as full tensors (a collective for FSDP)."""
        model = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        optim = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in self.optimizers.state_dict().items()}
        return _clone({"model": model, "optim": optim, "lr": self.lr_schedulers.state_dict(),
                       "train": self.train_state.state_dict(),
                       "data": self.dataloader.state_dict()})


def _clone(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def differences(actual: object, expected: object, path: str = "") -> list[str]:
    if isinstance(expected, torch.Tensor):
        same = (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape
                and torch.equal(actual.reshape(-1).view(torch.uint8),
                                expected.reshape(-1).view(torch.uint8)))
        return [] if same else [f"{path}: tensors differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [f"{path}: keys differ"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{path}.{k}")]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def hold_snapshot(engine: Engine, delay: float = STAGING_DELAY) -> threading.Event:
    """Hold the next snapshot back until the event returned is set, then ``delay`` s more (the
    engine's staging thread is busy that long first): the save returns with its snapshot still
    copying however loaded the machine is, and a missing wait before optimizer.step() shows."""
    release = threading.Event()

    def hold() -> None:
        release.wait(HOLD_LIMIT)
        time.sleep(delay)

    engine.threads.stage.submit(hold)
    return release


def tier_entries(memory: Path) -> list[str]:
    """What a memory tier holds, less the manager's slot directory (``.slots.<pid>``) and the
    tier's lock file."""
    return sorted(p.name for p in memory.iterdir()
                  if not p.name.startswith(".slots.") and p.name != TIER_LOCK)


def step_dirs(folder: Path) -> list[str]:
    """The step folders torchtitan sees in the checkpoint folder."""
    return sorted(p.name for p in (folder / "ckpt").iterdir() if p.name.startswith("step-"))


# -- single process ------------------------------------------------------------------------------
@pytest.mark.mpi_skip
@pytest.mark.parametrize("mode", MODES)
def test_manager_saves_and_resumes(one_rank: None, tmp_path: Path, engine: Engine,
                                   mode: str) -> None:
    run = Run(seed=0)
    manager = run.manager(tmp_path, mode)
    ds = enable_datastates(manager, engine=engine)
    assert isinstance(ds, DataStates) and manager.datastates is ds and ds.engine is engine
    saved = {}
    for step in range(1, 6):
        run.step(step, manager)
        release = hold_snapshot(engine)
        manager.save(step, last_step=step == 5)
        if mode != "disabled" and step in (2, 4):
            # save() returned while the snapshot is still copying (it overlaps the next step,
            # whose optimizer step waits for it)
            assert not ds.staging.done()
        release.set()
        if step in (2, 4, 5):
            saved[step] = run.snapshot()
    manager.close()
    assert step_dirs(tmp_path) == ["step-2", "step-4", "step-5"]
    for name in step_dirs(tmp_path):
        directory = tmp_path / "ckpt" / name
        assert is_datastates_checkpoint(directory)
        assert (directory / ".metadata").is_file()
        assert not list(directory.glob("*.distcp"))
    stats = ds.last_stats()
    assert stats is not None and stats.bytes_written > 0
    assert not engine.closed, "the manager closed an engine it does not own"

    # resume from step 4 in a fresh run; one more step must give step 5 exactly
    again = Run(seed=1)
    manager = again.manager(tmp_path, mode)
    enable_datastates(manager, engine=engine)
    assert manager.load(step=4)
    assert differences(again.snapshot(), saved[4], "step 4") == []
    again.step(5, manager)
    assert differences(again.snapshot(), saved[5], "step 4 + 1") == []
    # without a step: the latest checkpoint (the last step's, saved synchronously)
    latest = Run(seed=2)
    latest_manager = latest.manager(tmp_path, mode)
    enable_datastates(latest_manager, engine=engine)
    assert latest_manager.load()
    assert differences(latest.snapshot(), saved[5], "latest") == []
    manager.close()
    latest_manager.close()


@pytest.mark.mpi_skip
def test_loads_checkpoint_of_stock_torchtitan(one_rank: None, tmp_path: Path,
                                              engine: Engine) -> None:
    """A run that switches over resumes from the checkpoint stock torchtitan wrote."""
    run = Run(seed=0)
    stock = run.manager(tmp_path, "disabled")
    for step in (1, 2):
        run.step(step)
        stock.save(step)
    stock.close()
    directory = tmp_path / "ckpt" / "step-2"
    assert list(directory.glob("*.distcp")) and not is_datastates_checkpoint(directory)
    expected = run.snapshot()

    again = Run(seed=1)
    manager = again.manager(tmp_path, "async")
    enable_datastates(manager, engine=engine)
    assert manager.load()
    assert differences(again.snapshot(), expected, "stock") == []
    again.step(3, manager)
    again.step(4, manager)
    manager.save(4)
    manager.close()
    assert is_datastates_checkpoint(tmp_path / "ckpt" / "step-4")


@pytest.mark.mpi_skip
def test_config_subclass(one_rank: None, tmp_path: Path) -> None:
    """``DataStatesCheckpointManager.Config`` builds a manager with the writer in place."""
    run = Run(seed=0)
    manager = run.manager(tmp_path, "async", cls=DataStatesCheckpointManager,
                          host_cache_size="16MiB", io_backend="threads")
    assert isinstance(manager, DataStatesCheckpointManager)
    ds = manager.datastates
    assert ds.owns_engine and ds.engine.fixed_size == 16 << 20 and ds.engine.io.name == "threads"
    assert ds.tiers is None, "no memory tier unless the config asks for one"
    assert enable_datastates(manager) is ds  # a second call changes nothing
    for step in (1, 2):
        run.step(step, manager)
        release = hold_snapshot(ds.engine)
        manager.save(step)
        if step == 2:
            assert not ds.staging.done()
        release.set()
    run.step(3, manager)  # its optimizer step waited for the snapshot of step 2
    expected = run.snapshot()
    manager.close()
    assert ds.engine.closed, "the manager closes the engine it made"
    assert ds.last_stats().bytes_written > 0
    again = Run(seed=1)
    other = again.manager(tmp_path, "disabled", cls=DataStatesCheckpointManager)
    assert other.datastates.engine is default_engine() and not other.datastates.owns_engine
    assert other.load(step=2)
    again.step(3, other)
    assert differences(again.snapshot(), expected, "subclass") == []
    other.close()
    assert not default_engine().closed


@pytest.mark.mpi_skip
def test_config_subclass_with_an_engine_and_pinned_mode(one_rank: None, tmp_path: Path,
                                                        engine: Engine) -> None:
    """``engine=`` given to ``build``; "async_with_pinned_mem": torchtitan's own
    maybe_wait_for_staging() returns at once while the snapshot is still being staged (the
    optimizer hook orders the step after its copies)."""
    run = Run(seed=0)
    manager = run.manager(tmp_path, "async_with_pinned_mem", cls=DataStatesCheckpointManager,
                          build_args={"engine": engine})
    ds = manager.datastates
    assert ds.engine is engine and not ds.owns_engine
    with pytest.raises(ValueError, match="not both"):
        run.manager(tmp_path, "async", cls=DataStatesCheckpointManager,
                    build_args={"engine": engine}, io_backend="threads")
    for step in (1, 2):
        run.step(step, manager)
        release = hold_snapshot(engine)
        manager.save(step)
        if step == 1:
            release.set()
    assert ds.guarded and not ds.staging.done()
    manager.maybe_wait_for_staging()  # would hang here until release if it waited on staging
    assert not ds.staging.done()
    release.set()
    ds.staging.result(timeout=30)
    # 0.3 drops the future once waited for; 0.2.x keeps it (done)
    assert manager.staging_future is None or manager.staging_future.done()
    expected = run.snapshot()
    manager.close()
    assert not engine.closed
    again = Run(seed=1)
    other = again.manager(tmp_path, "async_with_pinned_mem", cls=DataStatesCheckpointManager,
                          build_args={"engine": engine})
    assert other.load(step=2)
    assert differences(again.snapshot(), expected, "pinned mode") == []
    other.close()


@pytest.mark.mpi_skip
def test_disabled_manager_is_left_alone(one_rank: None, tmp_path: Path) -> None:
    run = Run(seed=0)
    cfg = config_class(CheckpointManager)(enable=False)
    manager = build(CheckpointManager, tmp_path, cfg, dataloader=None, model_parts=[run.model],
                    optimizers=run.optimizers, lr_schedulers=run.lr_schedulers, states={})
    assert enable_datastates(manager) is None
    assert not hasattr(manager, "datastates")


@pytest.mark.mpi_skip
def test_one_seam_knows_the_release(one_rank: None, tmp_path: Path) -> None:
    """TORCHTITAN says which release is installed and how it differs; the subclass overrides
    the hooks that release calls; a config without the adapter's fields (a 0.2.x JobConfig
    section, torchtitan's own config class) builds a manager with their defaults."""
    import torchtitan

    release = tuple(int(x) for x in torchtitan.__version__.split(".")[:2])
    assert TORCHTITAN.version == torchtitan.__version__
    assert TORCHTITAN.legacy == (release < (0, 3))
    assert TORCHTITAN.manager is CheckpointManager
    hooks = ("save", "load") if TORCHTITAN.legacy else ("_save", "_load")
    assert (TORCHTITAN.save_hook, TORCHTITAN.load_hook) == hooks
    for name in hooks:
        assert name in vars(DataStatesCheckpointManager), name
    if not TORCHTITAN.legacy:  # 0.3's public methods keep their guards
        assert not {"save", "load"} & set(vars(DataStatesCheckpointManager))
    assert issubclass(DataStatesCheckpointManager.Config, TORCHTITAN.config)
    with pytest.raises(ImportError, match="torchtitan cannot be imported: gone"):
        TorchtitanAPI(error="gone").containers([], lambda step: 1.0)  # none installed

    run = Run(seed=0)
    plain = TORCHTITAN.config(enable=True, folder="plain", async_mode="async")
    other = build(DataStatesCheckpointManager, tmp_path, plain, dataloader=run.dataloader,
                  model_parts=[run.model], optimizers=run.optimizers,
                  lr_schedulers=run.lr_schedulers, states={"train_state": run.train_state})
    ds = other.datastates
    assert ds.tiers is None and not ds.owns_engine and ds.verify_checksums and ds.overlap
    run.step(1, other)
    other.save(1, last_step=True)
    other.close()
    assert is_datastates_checkpoint(tmp_path / "plain" / "step-1")


# -- memory tier ---------------------------------------------------------------------------------
@pytest.fixture
def shm() -> Iterator[Path]:
    """A job's memory root under /dev/shm."""
    made = Path(tempfile.mkdtemp(prefix="dcp_titan_tier_", dir="/dev/shm"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def tiered(run: Run, folder: Path, shm: Path, engine: Engine, mode: str = "async",
           **config: object) -> DataStatesCheckpointManager:
    """A DataStatesCheckpointManager with a memory tier under ``shm``."""
    return run.manager(folder, mode, cls=DataStatesCheckpointManager, build_args={"engine": engine},
                       memory_tier=True, memory_dir=str(shm), **config)


def restored(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(" in ")[0] for r in caplog.records
            if r.name == "dcp_datastates" and r.getMessage().startswith("dcp_datastates: restored")]


@pytest.mark.mpi_skip
@pytest.mark.parametrize("mode", MODES)
def test_memory_tier_persists_and_restart_loads_from_memory(one_rank: None, tmp_path: Path,
                                                            shm: Path, engine: Engine,
                                                            caplog: pytest.LogCaptureFixture,
                                                            mode: str) -> None:
    """Saves go into the memory tier; every 2nd save (persist_interval 4, interval 2) is
    persisted to the folder as step-<N>. A run that stops without closing (as a crashed one
    does) left step 10 in memory only: the restart loads it from memory (stock torchtitan would
    take step 8) and persists it; torchtitan's own loader loads the persisted steps; both runs
    then take the same next step bit for bit."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, mode, persist_interval=4)
    tiers = manager.datastates.tiers
    assert tiers is not None and tiers.memory == shm / "rank_0"
    saved = {}
    for step in range(1, 11):
        run.step(step, manager)
        manager.save(step)
        if step % 2 == 0:
            saved[step] = run.snapshot()
            tiers.wait()  # the memory commit and the persist, if any: the test is exact
    assert step_dirs(tmp_path) == ["step-4", "step-8"]
    assert tier_entries(tiers.memory) == ["step_10", "step_8"]
    assert manager._find_load_step() == 8, "torchtitan itself sees the persisted steps"

    # restart (the first run never closed: its newest step was not persisted); a crashed run's
    # claims of its tier directories die with its process: here, the first run lets them go
    tiers._claims.release()
    again = Run(seed=1)
    other = tiered(again, tmp_path, shm, engine, mode, persist_interval=4)
    assert other.load()
    assert restored(caplog) == ["dcp_datastates: restored step 10 from the memory tier (" +
                                str(shm / "rank_0" / "step_10") + ")"]
    assert differences(again.snapshot(), saved[10], "from memory") == []
    other.datastates.tiers.wait()  # the restarted run persisted step 10 meanwhile
    assert step_dirs(tmp_path) == ["step-10", "step-4", "step-8"]
    run.step(11, manager)
    again.step(11, other)
    assert differences(again.snapshot(), run.snapshot(), "step 11 after the restart") == []

    # the persisted checkpoints, through torchtitan's own load (the latest, and by step)
    plain = Run(seed=2)
    stock = plain.manager(tmp_path, "disabled", cls=DataStatesCheckpointManager,
                          build_args={"engine": engine})
    assert stock.load()
    assert differences(plain.snapshot(), saved[10], "persisted step 10") == []
    assert stock.load(step=4)
    assert differences(plain.snapshot(), saved[4], "persisted step 4") == []
    for m in (manager, other, stock):
        m.close()
    assert not engine.closed


@pytest.mark.mpi_skip
def test_memory_tier_last_step_goes_to_the_folder_and_purges(one_rank: None, tmp_path: Path,
                                                             shm: Path, engine: Engine) -> None:
    """The last step's checkpoint is written to the folder directly (as torchtitan does; it
    purges nothing then); keep_latest_k applies to the persisted steps as each persist
    commits; the memory tier keeps memory_keep."""
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, keep_latest_k=2, memory_keep=3,
                     persist_interval=2)
    tiers = manager.datastates.tiers
    for step in range(1, 10):
        run.step(step, manager)
        manager.save(step, last_step=step == 9)
        if step % 2 == 0:
            tiers.wait()
    expected = run.snapshot()
    manager.close()
    assert step_dirs(tmp_path) == ["step-6", "step-8", "step-9"]
    assert tier_entries(tiers.memory) == ["step_4", "step_6", "step_8"]
    assert is_datastates_checkpoint(tmp_path / "ckpt" / "step-9")
    again = Run(seed=1)
    other = tiered(again, tmp_path, shm, engine, persist_interval=2)
    assert other.load()  # step 9: only the folder holds it
    assert differences(again.snapshot(), expected, "last step") == []
    other.close()


@pytest.mark.mpi_skip
def test_memory_tier_full_skips_the_save_and_training_goes_on(one_rank: None, tmp_path: Path,
                                                             shm: Path, engine: Engine,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """A memory tier without room for a checkpoint: torchtitan's save returns, waiting for it
    raises nothing, training and close() go on; the error is logged, naming the tier."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, memory_limit="1MiB")
    for step in range(1, 6):
        run.step(step, manager)
        saved = manager.save(step)
        assert saved == (step % 2 == 0) or TORCHTITAN.legacy  # 0.2.x's save returns None
        wait_for_saving(manager)  # no error: the save was skipped
    run.step(6, manager)  # training goes on
    manager.close()  # no error either
    assert step_dirs(tmp_path) == []
    assert tier_entries(shm / "rank_0") == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors
    for step, error in zip((2, 4), errors, strict=True):
        assert error.startswith(f"dcp_datastates: checkpoint of step {step} not taken: memory "
                                f"tier {shm / 'rank_0'} has "), error
        assert "Nothing was written" in error


@pytest.mark.mpi_skip
def test_memory_tier_config_is_checked(one_rank: None, tmp_path: Path, shm: Path,
                                       engine: Engine) -> None:
    run = Run(seed=0)
    with pytest.raises(ValueError, match=r"checkpoint\.persist_interval must be 0 or a multiple "
                                         r"of checkpoint\.interval \(2\), got 3"):
        tiered(run, tmp_path, shm, engine, persist_interval=3)
    (tmp_path / "ckpt" / "step_5").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds step directories named step_<N>"):
        tiered(run, tmp_path, shm, engine)
    assert not engine.closed


@pytest.mark.mpi_skip
def test_memory_tier_under_an_overhead_budget(one_rank: None, tmp_path: Path, shm: Path,
                                              engine: Engine) -> None:
    """``max_overhead``: a save every step, the tier's budget takes what it can pay for and
    skips the rest (training goes on, the skipped steps have no checkpoint); torchtitan's own
    wait for the snapshot gets a done future (the guard, which the budget counts, orders the
    optimizer step); a restart loads the newest step taken. Without the memory tier the option
    is refused."""
    with pytest.raises(ValueError, match="max_overhead needs checkpoint.memory_tier"):
        Run(seed=0).manager(tmp_path, "async", cls=DataStatesCheckpointManager,
                            build_args={"engine": engine}, max_overhead=0.05)
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, "async_with_pinned_mem", interval=1,
                     max_overhead=0.05)
    ds = manager.datastates
    assert ds.budgeted and ds.tiers is not None
    saved = {}
    for step in range(1, 13):
        run.step(step, manager)
        release = hold_snapshot(engine, 0.05)
        manager.save(step)
        assert manager.staging_future is None or manager.staging_future.done()
        release.set()
        saved[step] = run.snapshot()
    ds.tiers.wait()
    history = list(ds.tiers.history)
    taken = [f.step for f in history if not f.skipped]
    skipped = [f.step for f in history if f.skipped]
    assert taken and taken[0] <= 2, history  # step 1 may find its slot still being made
    assert skipped, "a save every step of a held snapshot: the budget skips some"
    assert sorted(taken + skipped) == list(range(1, 13))
    manager.close()
    ds.tiers = None
    again = Run(seed=1)
    other = tiered(again, tmp_path, shm, engine, "async_with_pinned_mem", interval=1)
    assert other.load()
    newest = max(taken)
    assert differences(again.snapshot(), saved[newest], f"step {newest}") == []
    other.close()


@pytest.mark.mpi_skip
@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_memory_tier_next_save_waits_for_no_memory_commit(one_rank: None, tmp_path: Path,
                                                          shm: Path, mode: str) -> None:
    """torchtitan waits for the previous save's upload before each save; the memory tier's
    manager orders its saves itself, so the next save and torchtitan's wait go on while the
    previous memory commit is held. Once let go, both steps commit and the newest loads bit
    for bit."""
    io = FaultyBackend(ThreadPoolBackend(), gated=True)
    with Engine(host_cache_size="16MiB", io_backend=io, io_workers=2) as engine:
        run = Run(seed=0)
        manager = tiered(run, tmp_path, shm, engine, mode, interval=1)
        tiers = manager.datastates.tiers
        assert tiers is not None
        let_go = threading.Timer(HOLD_LIMIT / 2, io.gate.set)  # a wait fails, never hangs
        let_go.start()
        try:
            run.step(1, manager)
            manager.save(1)
            assert io.write_started.wait(HOLD_LIMIT / 2), "the memory commit never wrote"
            run.step(2, manager)
            manager.save(2)
            wait_for_saving(manager)
            assert not io.gate.is_set(), "a save waited for the previous memory commit"
            assert committed_steps(tiers.memory) == []
        finally:
            let_go.cancel()
            io.gate.set()
        saved = run.snapshot()
        tiers.wait()
        assert committed_steps(tiers.memory) == [1, 2]
        manager.close()
        again = Run(seed=1)
        other = tiered(again, tmp_path, shm, engine, mode, interval=1)
        assert other.load()
        assert differences(again.snapshot(), saved, "step 2") == []
        other.close()


@pytest.mark.mpi_skip
def test_memory_tier_commit_error_is_raised_at_the_next_save(one_rank: None, tmp_path: Path,
                                                             shm: Path) -> None:
    """A memory commit that failed (the tier's disk said EIO) raises at the next save, as
    torchtitan's wait for it did; that save is not taken."""
    io = FaultyBackend(ThreadPoolBackend(), fail_write_after=0)
    with Engine(host_cache_size="16MiB", io_backend=io, io_workers=2) as engine:
        run = Run(seed=0)
        manager = tiered(run, tmp_path, shm, engine, "async", interval=1)
        ds = manager.datastates
        tiers = ds.tiers
        assert tiers is not None
        run.step(1, manager)
        manager.save(1)
        wait_until(lambda: ds.upload is not None and ds.upload.done(), "the commit failed")
        run.step(2, manager)
        with pytest.raises(OSError, match="injected"):
            manager.save(2)
        assert "step_2" not in tier_entries(tiers.memory)
        assert committed_steps(tiers.memory) == []
        with pytest.raises(OSError, match="injected"):  # the manager's close raises it too
            manager.close()


class StepFailingBackend(FaultyBackend):
    """Holds the writes into ``step_<failing>`` of the memory tier until ``gate`` is set, then
    fails them (EIO); every other write goes through."""

    def __init__(self, failing: int) -> None:
        super().__init__(ThreadPoolBackend())
        self.failing, self.held = f"/step_{failing}/", threading.Event()
        self.gate.clear()

    def write(self, fd: int, path: str, reqs: Sequence[IOReq]) -> None:
        if self.failing not in path:
            self.inner.write(fd, path, reqs)
            return
        self.held.set()
        if not self.gate.wait(HOLD_LIMIT):
            raise TimeoutError(f"{path}: the write was never let go")
        raise self._error("write", path)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_memory_tier_commit_that_fails_after_the_next_save_raises_later(
        one_rank: None, tmp_path: Path, shm: Path, mode: str) -> None:
    """A memory commit that fails once the next save has started (the later commits go
    through) still raises at a later save, not only at close()."""
    io = StepFailingBackend(failing=1)
    with Engine(host_cache_size="16MiB", io_backend=io, io_workers=2) as engine:
        run = Run(seed=0)
        manager = tiered(run, tmp_path, shm, engine, mode, interval=1)
        tiers = manager.datastates.tiers
        assert tiers is not None
        try:
            run.step(1, manager)
            manager.save(1)
            assert io.held.wait(HOLD_LIMIT / 2), "the commit of step 1 never wrote"
            run.step(2, manager)
            manager.save(2)  # step 1's commit is still running: nothing to raise yet
        finally:
            io.gate.set()
        wait_until(lambda: committed_steps(tiers.memory) == [2], "step 2 committed")
        run.step(3, manager)
        with pytest.raises(OSError, match=r"injected.*step_1"):
            manager.save(3)
        run.step(4, manager)
        manager.save(4)  # raised once: the next save is taken
        wait_until(lambda: committed_steps(tiers.memory) == [2, 4], "step 4 committed")
        with pytest.raises(OSError, match=r"injected.*step_1"):  # the manager's close too
            manager.close()


@pytest.mark.mpi_skip
def test_memory_tier_disabled_mode_raises_a_failed_commit_once(one_rank: None,
                                                               tmp_path: Path,
                                                               shm: Path) -> None:
    """In "disabled" mode the save that failed raises its commit's error; the next save is
    taken (the error is not raised again there)."""
    io = StepFailingBackend(failing=1)
    io.gate.set()
    with Engine(host_cache_size="16MiB", io_backend=io, io_workers=2) as engine:
        run = Run(seed=0)
        manager = tiered(run, tmp_path, shm, engine, "disabled", interval=1)
        tiers = manager.datastates.tiers
        assert tiers is not None
        run.step(1, manager)
        with pytest.raises(OSError, match=r"injected.*step_1"):
            manager.save(1)
        run.step(2, manager)
        manager.save(2)
        assert committed_steps(tiers.memory) == [2]
        with pytest.raises(OSError, match=r"injected.*step_1"):  # the manager's close too
            manager.close()


@pytest.mark.mpi_skip
def test_memory_tier_leaves_saves_outside_the_folder_to_the_writer(one_rank: None,
                                                                   tmp_path: Path, shm: Path,
                                                                   engine: Engine) -> None:
    """A save into a folder other than the manager's (torchtitan 0.2.x's torchft per-replica
    save of the dataloader, ``<folder>/ft-replicat-<r>/step-<N>``) is written there, as
    torchtitan writes it, not taken into the memory tier as that step."""
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, "async")
    tiers = manager.datastates.tiers
    assert tiers is not None
    replica = Path(manager.folder) / "ft-replicat-0" / "step-3"
    state = {"dataloader": run.dataloader}
    run.dataloader.step = 30
    result = manager.dcp_save(state, checkpoint_id=str(replica), async_mode="async")
    if result is not None:
        result.result()
    assert is_datastates_checkpoint(replica)
    assert tiers.latest_step() is None and committed_steps(tiers.memory) == []
    again = Run(seed=1)
    loaded = {"dataloader": again.dataloader}
    dcp.load(loaded, checkpoint_id=str(replica), storage_reader=DataStatesReader(engine=engine))
    assert again.dataloader.step == 30
    manager.close()


class OneReplicaFT:
    """Stands in for torchft's ``FTManager`` as torchtitan 0.2.x's manager uses it: replica 0
    of a fault-tolerant job, the one that writes the shared checkpoints."""

    enabled, replica_id = True, 0

    def __init__(self) -> None:
        self.manager = self

    def set_state_dict_fns(self, load: object, save: object) -> None:
        pass

    def participating_rank(self) -> int:
        return 0


@pytest.mark.mpi_skip
@pytest.mark.skipif(not TORCHTITAN.legacy, reason="torchft's per-replica saves are 0.2.x's")
def test_memory_tier_restores_the_torchft_replica_dataloader(one_rank: None, tmp_path: Path,
                                                             shm: Path, engine: Engine) -> None:
    """With torchft, each replica's dataloader is saved apart (``ft-replicat-<r>``) and left
    out of the shared checkpoint; a restart from the memory tier loads it from there, as
    torchtitan's own load does."""
    def replica(run: Run) -> CheckpointManager:
        return run.manager(tmp_path, "async", cls=DataStatesCheckpointManager,
                           build_args={"engine": engine, "ft_manager": OneReplicaFT()},
                           memory_tier=True, memory_dir=str(shm),
                           enable_ft_dataloader_checkpoints=True)

    run = Run(seed=0)
    manager = replica(run)
    for step in range(1, 5):
        run.step(step, manager)
        manager.save(step)
    manager.datastates.tiers.wait()
    saved = run.snapshot()
    manager.close()
    again = Run(seed=1)
    other = replica(again)
    assert other.load()
    assert again.train_state.step == 4
    assert again.dataloader.step == 40, "the replica's dataloader was not restored"
    assert differences(again.snapshot(), saved, "step 4") == []
    other.close()


# -- several ranks (mpirun) ----------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_fsdp2_async_manager_multi_rank(world: World, shared: Path, engine: Engine) -> None:
    """FSDP2 on all ranks, the manager in "async" mode; a fresh run resumes bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world.size,))
    run = Run(seed=0, mesh=mesh)
    manager = run.manager(shared, "async")
    enable_datastates(manager, engine=engine)
    saved = {}
    for step in range(1, 5):
        run.step(step, manager)
        hold_snapshot(engine, 0.2).set()
        manager.save(step)
        if step % 2 == 0:
            saved[step] = run.snapshot()
    manager.close()
    errors = []
    if sorted(os.listdir(shared / "ckpt")) != ["step-2", "step-4"]:
        errors.append(f"folders: {sorted(os.listdir(shared / 'ckpt'))}")
    again = Run(seed=1, mesh=mesh)
    other = again.manager(shared, "async")
    enable_datastates(other, engine=engine)
    for step in (2, 4):
        other.load(step=step)
        errors += differences(again.snapshot(), saved[step], f"step {step}")
    other.close()
    agree(errors, f"torchtitan manager on {world.size} ranks")


@pytest.mark.mpi_skip
def test_memory_tier_slots_are_made_from_the_first_step(one_rank: None, tmp_path: Path,
                                                        shm: Path, engine: Engine) -> None:
    """The trainer calls ``save`` every step: the first call, not a checkpoint step, has the
    memory tier's slots made for the trainer's state (sized for its model and optimizer
    state), so the first checkpoint finds one ready."""
    run = Run(seed=0)
    manager = tiered(run, tmp_path, shm, engine, "async", interval=4)
    tiers = manager.datastates.tiers
    assert tiers is not None and slot_files(tiers.memory) == {}
    run.step(1, manager)
    manager.save(1)  # not a checkpoint step
    wait_until(lambda: bool(slot_files(tiers.memory)), "a slot made after the first step")
    assert tier_entries(tiers.memory) == []
    for step in range(2, 5):
        run.step(step, manager)
        manager.save(step)
    tiers.wait()
    assert tier_entries(tiers.memory) == ["step_4"]
    manager.close()
