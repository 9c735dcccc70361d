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
from dcp_datastates.io import ThreadPoolBackend
from dcp_datastates.memory.aside import GPU_HEADROOM, room_on

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


def test_manager_save_with_every_slot_held_waits_for_its_slot(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    gen = torch.Generator(device="cuda").manual_seed(7)
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    earlier = {s: {"x": torch.randn(1024, 1024, device="cuda", generator=gen)}
               for s in range(1, 5)}
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=hold, host_cache_size="64MiB", io_workers=2)
    stepped = threading.Event()
    filler: list[torch.Tensor] = []  # the GPU memory held while the test runs

    def step() -> None:
        opt.step()  # the guard: after the fifth snapshot is copied into its slot
        torch.cuda.synchronize()
        stepped.set()

    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=engine) as manager:
            guard(opt, manager)
            model(torch.randn(8, 2048, device="cuda", generator=gen)).square().mean().backward()
            state = model.state_dict()
            saved = {k: v.detach().clone() for k, v in state.items()}
            filler.append(_fill_gpu())
            assert not engine.aside_fits_on_gpu(list(state.values()))
            stepper = threading.Thread(target=step)
            try:
                handles = [manager.save(s, earlier[s]) for s in range(1, 5)]
                handles.append(manager.save(5, state))
                stepper.start()
                _wait_until(lambda: _messages(caplog, WAITS))
                assert not handles[4].staged.done() and not stepped.is_set()
                assert engine.arenas.aside_bytes() == 0
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
                if stepper.is_alive():
                    stepper.join(TIMEOUT)
            assert stepped.is_set()
            assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
            for handle in handles:
                handle.result(timeout=TIMEOUT)
            out = {k: torch.zeros_like(v) for k, v in saved.items()}
            assert manager.load(out, step=5) == 5
            for key, want in saved.items():
                assert torch.equal(_bits(out[key]), _bits(want)), key
        assert not _messages(caplog, ASIDE)
    finally:
        hold.gate.set()
        engine.close()
        filler.clear()
        torch.cuda.empty_cache()


def test_a_save_waiting_for_its_slot_goes_aside_once_the_gpu_has_room(
        tiers: Tiers, caplog: pytest.LogCaptureFixture) -> None:
    """As above, the fifth save waits for its slot on a full GPU; once the memory held is freed
    (to torch's cache, as an earlier snapshot's buffer aside is), the save goes aside on the GPU
    and the guarded optimizer step runs while every slot is still held; the step loads bit
    exactly once the slots come free."""
    caplog.set_level(logging.INFO, logger="dcp_datastates")
    gen = torch.Generator(device="cuda").manual_seed(8)
    model = torch.nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    earlier = {s: {"x": torch.randn(1024, 1024, device="cuda", generator=gen)}
               for s in range(1, 5)}
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    engine = Engine(io_backend=hold, host_cache_size="64MiB", io_workers=2)
    filler: list[torch.Tensor] = []
    try:
        with CheckpointManager(memory_dir=tiers.memory, keep_memory=1, persist=None,
                               engine=engine) as manager:
            guard(opt, manager)
            model(torch.randn(8, 2048, device="cuda", generator=gen)).square().mean().backward()
            state = model.state_dict()
            saved = {k: v.detach().clone() for k, v in state.items()}
            filler.append(_fill_gpu())
            try:
                handles = [manager.save(s, earlier[s]) for s in range(1, 5)]
                handles.append(manager.save(5, state))
                _wait_until(lambda: _messages(caplog, WAITS))
                filler.clear()  # idle in torch's cache: room for the snapshot aside
                _wait_until(lambda: _messages(caplog, ASIDE))
                assert _messages(caplog, "has room again")
                assert engine.arenas.aside_bytes() > 0
                opt.step()  # ordered after the copy aside, not after a slot
                torch.cuda.synchronize()
                assert not any(h.committed.done() for h in handles)
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
            for handle in handles:
                handle.result(timeout=TIMEOUT)
            out = {k: torch.zeros_like(v) for k, v in saved.items()}
            assert manager.load(out, step=5) == 5
            for key, want in saved.items():
                assert torch.equal(_bits(out[key]), _bits(want)), key
    finally:
        hold.gate.set()
        engine.close()
        filler.clear()
        torch.cuda.empty_cache()


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
