"""GPU: a memory-tier save with every slot held, whose snapshot would wait aside in pageable
memory (the GPU held nearly full: no room for it), waits for its slot instead; the guard holds the
optimizer step until the snapshot is copied into the slot, and the step loads bit exactly. Once
the GPU has room again (memory torch's allocator holds unused counts) the save goes aside and the
step goes on before any slot comes free."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import Tiers
from helpers.tiers import ASIDE, TIMEOUT, WAITS, HoldWrites, _messages, _wait_until

from dcp_datastates import CheckpointManager, Engine, guard
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates._memory.aside import GPU_HEADROOM, room_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _fill_gpu() -> torch.Tensor:
    """Hold the GPU's memory but half of ``GPU_HEADROOM``: a snapshot has no room aside (what
    torch's allocator held unused counts as room: given back to the driver first)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    nbytes = max(0, free - int(total * GPU_HEADROOM / 2))
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


class _Held:
    """A trained model with a guarded optimizer, four earlier states whose commits are held
    (every slot of ``keep_memory=1`` in use), and the GPU memory the test fills."""

    def __init__(self, tiers: Tiers, seed: int) -> None:
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.model = torch.nn.Linear(2048, 2048).cuda()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.earlier = {s: {"x": torch.randn(1024, 1024, device="cuda", generator=self.gen)}
                        for s in range(1, 5)}
        self.hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
        self.engine = Engine(io_backend=self.hold, host_cache_size="64MiB", io_workers=2)
        self.filler: list[torch.Tensor] = []

    def manager(self, tiers: Tiers) -> CheckpointManager:
        manager = CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                                    engine=self.engine)
        guard(self.opt, manager)
        return manager

    def state(self) -> dict[str, torch.Tensor]:
        """The model's state after a backward pass (the optimizer step changes it)."""
        x = torch.randn(8, 2048, device="cuda", generator=self.gen)
        self.model(x).square().mean().backward()
        return self.model.state_dict()

    def check_step_5(self, manager: CheckpointManager, saved: dict[str, torch.Tensor]) -> None:
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert manager.load(out, step=5) == 5
        for key, want in saved.items():
            assert torch.equal(_bits(out[key]), _bits(want)), key

    def close(self) -> None:
        self.hold.gate.set()
        self.engine.close()
        self.filler.clear()
        torch.cuda.empty_cache()


def test_manager_save_with_every_slot_held_waits_for_its_slot(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    run = _Held(tiers, 7)
    stepped = threading.Event()

    def step() -> None:
        run.opt.step()  # the guard: after the fifth snapshot is copied into its slot
        torch.cuda.synchronize()
        stepped.set()

    try:
        with run.manager(tiers) as manager:
            state = run.state()
            saved = {k: v.detach().clone() for k, v in state.items()}
            run.filler.append(_fill_gpu())
            assert not run.engine.aside_fits_on_gpu(list(state.values()))
            stepper = threading.Thread(target=step)
            try:
                handles = [manager.save(s, run.earlier[s]) for s in range(1, 5)]
                handles.append(manager.save(5, state))
                stepper.start()
                _wait_until(lambda: _messages(caplog, WAITS))
                assert not handles[4].staged.done() and not stepped.is_set()
                assert run.engine.arenas.aside_bytes() == 0
            finally:  # a failed assertion must not leave close() waiting for held writes
                run.hold.gate.set()
                if stepper.is_alive():
                    stepper.join(TIMEOUT)
            assert stepped.is_set()
            assert any(not torch.equal(saved[k], v) for k, v in run.model.state_dict().items())
            for handle in handles:
                handle.result(timeout=TIMEOUT)
            run.check_step_5(manager, saved)
        assert not _messages(caplog, ASIDE)
    finally:
        run.close()


def test_a_save_waiting_for_its_slot_goes_aside_once_the_gpu_has_room(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """As above, the fifth save waits for its slot on a full GPU (filled once the earlier
    snapshots are staged); once the memory held is freed (to torch's cache, as an earlier
    snapshot's buffer aside is), the save goes aside on the GPU and the guarded optimizer step
    runs while every slot is still held; the step loads bit exactly once the slots come
    free."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    run = _Held(tiers, 8)
    try:
        with run.manager(tiers) as manager:
            state = run.state()
            saved = {k: v.detach().clone() for k, v in state.items()}
            try:
                handles = [manager.save(s, run.earlier[s]) for s in range(1, 5)]
                for handle in handles:
                    handle.staged.result(TIMEOUT)
                run.filler.append(_fill_gpu())
                assert not run.engine.aside_fits_on_gpu(list(state.values()))
                handles.append(manager.save(5, state))
                _wait_until(lambda: _messages(caplog, "save 5: the next memory-tier slot to "
                                                      "come free is not ready yet and"))
                run.filler.clear()  # idle in torch's cache: room for the snapshot aside
                _wait_until(lambda: _messages(caplog, "save 5: the next memory-tier slot to "
                                                      "come free is not ready yet; the "
                                                      "snapshot waits aside"))
                assert _messages(caplog, "save 5: the GPU has room again")
                assert run.engine.arenas.aside_bytes() > 0
                run.opt.step()  # ordered after the copy aside, not after a slot
                torch.cuda.synchronize()
                assert not any(h.committed.done() for h in handles)
            finally:  # a failed assertion must not leave close() waiting for held writes
                run.hold.gate.set()
            for handle in handles:
                handle.result(timeout=TIMEOUT)
            run.check_step_5(manager, saved)
    finally:
        run.close()


def test_room_aside_counts_what_torch_holds_unused() -> None:
    """A buffer torch's caching allocator holds but no tensor uses (an earlier snapshot's
    buffer aside, freed) counts as room for the next one; one still in use does not."""
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with_held, _ = room_on(0)
    del held
    free, _ = torch.cuda.mem_get_info(0)
    room, total = room_on(0)
    assert room >= free + (1 << 30)
    assert room >= with_held + (1 << 30)
    assert total == torch.cuda.mem_get_info(0)[1]
