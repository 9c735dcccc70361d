"""What a ``CheckpointManager.save`` call leaves when the caller's state fails it or another
thread saves at the same time: a ``Stateful`` whose ``state_dict()`` raises gives its
memory-tier slot back (later saves find one, ``close()`` does not wait for it), a state that
is no dict is refused saying what a state is, and saves
called from two threads all commit (no save's commit waits behind one queued after it).
Real files under /dev/shm; the races come in through the state (a value whose deep copy, made
in the call, waits for the test)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import MARKS, Tiers, assert_state_equal, blank_like

from dcp_datastates import CheckpointManager, Engine

pytestmark = MARKS

#: seconds a save that works commits in, on a loaded CI machine, many times over
COMMIT_S = 30.0


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine(host_cache_size="8MiB", io_backend="threads", io_workers=2)


class Failing:
    """A ``Stateful`` whose ``state_dict()`` raises while ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = False
        self.t = torch.arange(4096, dtype=torch.float32)

    def state_dict(self) -> dict:
        if self.fail:
            raise KeyError("the data loader's state is not ready")
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])


def test_a_state_dict_that_raises_gives_its_slot_back(tiers: Tiers, engine: Engine) -> None:
    """Raising more times than the tier has slots leaves the next save a slot: it commits, and
    the step loads bit for bit."""
    keep = 1
    failing = Failing()
    state = {"app": failing}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=keep,
                           persist=None, engine=engine) as manager:
        manager.save(0, state).result(timeout=COMMIT_S)
        failing.fail = True
        for step in range(1, keep + 5):  # more than the pool's keep_memory + 3 slots
            with pytest.raises(KeyError, match="not ready"):
                manager.save(step, state)
        failing.fail = False
        failing.t.add_(1)
        manager.save(keep + 5, state).result(timeout=COMMIT_S)
        loaded = {"app": Failing()}
        assert manager.load(loaded) == keep + 5
        assert torch.equal(loaded["app"].t, failing.t)


def test_a_state_that_is_no_dict_is_refused_saying_what_it_takes(tiers: Tiers,
                                                                   engine: Engine) -> None:
    """A model passed as the state (not its state dict in a dict) is refused by ``save``,
    ``prepare`` and ``load`` naming its type, and gives its slot back: the next save works."""
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=1,
                           persist=None, engine=engine) as manager:
        said = r"the state must be a dict of state dicts .* got a Linear"
        for step in range(5):  # more than the pool's keep_memory + 3 slots
            with pytest.raises(TypeError, match=said):
                manager.save(step, model)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=said):
            manager.prepare(model)  # type: ignore[arg-type]
        state = {"model": model.state_dict()}
        manager.save(5, state).result(timeout=COMMIT_S)
        with pytest.raises(TypeError, match=said):
            manager.load(model)  # type: ignore[arg-type]
        loaded = {"model": torch.nn.Linear(4, 4).state_dict()}
        assert manager.load(loaded) == 5
        assert_state_equal(loaded, state)


class Gate:
    """A value of the state whose deep copy (made in ``save()``'s call, after the save's place
    in the engine's save order is taken) waits until ``go`` is set; ``entered`` says it
    began."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def __deepcopy__(self, memo: dict) -> str:
        self.entered.set()
        assert self.go.wait(COMMIT_S)
        return "gate"


def test_saves_from_two_threads_all_commit(tiers: Tiers, engine: Engine) -> None:
    """A save whose call is held (thread A) while another thread saves a later step (B): both
    commit once A goes on, and each step loads what it saved."""
    gate = Gate()
    slow = {"t": torch.full((2048,), 1.0), "gate": gate}
    fast = {"t": torch.full((2048,), 2.0)}
    handles = {}
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, keep_memory=2,
                           persist=None, engine=engine) as manager:
        # sized first: on a GPU the first save sizes the slots itself, copying the gate there,
        # before its step is taken (then B's step 2 is the newest, and A's older step refused)
        manager.prepare({"t": fast["t"]}, wait=True)
        a = threading.Thread(target=lambda: handles.update(a=manager.save(1, slow)))
        a.start()
        assert gate.entered.wait(COMMIT_S)
        b = threading.Thread(target=lambda: handles.update(b=manager.save(2, fast)))
        b.start()
        b.join(timeout=0.5)  # B's save is staged and queued, or waits for A's call
        gate.go.set()
        a.join(COMMIT_S)
        b.join(COMMIT_S)
        handles["a"].result(timeout=COMMIT_S)
        handles["b"].result(timeout=COMMIT_S)
        for step, saved in ((1, {"t": slow["t"], "gate": "gate"}), (2, fast)):
            loaded = blank_like(saved)
            assert manager.load(loaded, step=step) == step
            assert_state_equal(loaded, saved)
