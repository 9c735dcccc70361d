"""What a ``CheckpointManager.save`` call leaves when the caller's state fails it: a
``Stateful`` whose ``state_dict()`` raises gives its memory-tier slot back (later saves find
one, ``close()`` does not wait for it). Real files under /dev/shm."""

from __future__ import annotations

import pytest
import torch
from helpers import MARKS, Tiers

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
