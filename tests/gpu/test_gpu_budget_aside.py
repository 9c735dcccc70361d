"""GPU: under ``max_overhead``, a fresh manager's first save comes before any slot is pinned
(the pinning held). It is taken, its snapshot waits aside on the GPU while the optimizer step
changes the parameters, and once the slot is pinned the step commits and loads bit exactly.
With no room on the GPU for that aside, the save is skipped instead (no copy into pageable
memory)."""

from __future__ import annotations

import pytest
import torch
from helpers import Tiers
from helpers.fakes import FakeClock, HeldPinEngine
from helpers.tiers import TIMEOUT

from dcp_datastates import CheckpointManager, guard
from dcp_datastates._memory.aside import GPU_HEADROOM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("room", [True, False], ids=["gpu-room", "gpu-full"])
def test_a_budgeted_first_save_before_any_slot_is_pinned(tiers: Tiers, room: bool) -> None:
    engine = HeldPinEngine(io_backend="threads", host_cache_size="64MiB", io_workers=2)
    clock = FakeClock()
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    filler: list[torch.Tensor] = []  # the GPU memory the test holds
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=engine, max_overhead=0.5, clock=clock) as manager:
            guard(opt, manager)
            model(torch.randn(8, 2048, device="cuda")).square().mean().backward()
            manager.prepare(model.state_dict())
            assert engine.pinning.wait(TIMEOUT)
            if not room:  # hold the GPU's memory but half of the headroom an aside leaves
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info()
                filler.append(torch.empty(max(0, free - int(total * GPU_HEADROOM / 2)),
                                          dtype=torch.uint8, device="cuda"))
            clock.now += 1.0
            state = model.state_dict()
            saved = {k: _bits(v) for k, v in state.items()}
            handle = manager.save(1, state)
            filler.clear()
            if not room:
                engine.gate.set()
                assert handle.skipped
                assert handle.reason.startswith("no memory-tier slot free"), handle.reason
                return
            assert not handle.skipped, handle.reason
            opt.step()  # the guard waits for the copy aside, not for the slot
            torch.cuda.synchronize()
            assert not handle.committed.done()
            assert not torch.equal(_bits(model.weight), saved["weight"])
            engine.gate.set()
            handle.result(timeout=TIMEOUT)
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            assert manager.load(out) == 1
            for key, want in saved.items():
                assert torch.equal(_bits(out[key]), want), key
    finally:
        engine.gate.set()
        engine.close()
        filler.clear()
        torch.cuda.empty_cache()
