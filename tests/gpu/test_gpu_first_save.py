"""GPU: the first save copies its snapshot aside (device to device) while the host cache is
made, the guard waits only for that copy, and the checkpoint is bit exact."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.fakes import SlowArena

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, guard
from dcp_datastates._cuda import cuda_copy
from dcp_datastates._memory.aside import HOST, stash

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TIMEOUT = 120


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].device == value.device, key
        assert torch.equal(_bits(got[key]), _bits(value)), key


def test_first_save_on_gpu_waits_only_for_a_device_copy(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False)
                                  for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    slow = SlowArena()
    engine = Engine(host_cache_size="1GiB", make_arena=slow)
    try:
        guard(opt, engine)
        model(torch.randn(8, 4096, device="cuda")).square().mean().backward()
        state = {**model.state_dict(), "cpu": torch.arange(999, dtype=torch.int64)}
        saved = {k: v.detach().clone() for k, v in state.items()}
        before = torch.cuda.memory_allocated()
        resp = dcp.async_save(state, checkpoint_id=tmp_path / "ck", no_dist=True,
                              storage_writer=DataStatesWriter(engine=engine))
        assert slow.started.wait(TIMEOUT)
        opt.step()  # the guard: the copy aside is done, the cache is not made
        assert not slow.gate.is_set() and not slow.timed_out
        assert torch.cuda.memory_allocated() - before >= 4 * (4096 * 4096 * 4)  # on the GPU
        assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
        slow.gate.set()
        resp.upload_completion.result(TIMEOUT)
        assert engine.arenas.aside_bytes() == 0
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(out, checkpoint_id=tmp_path / "ck", no_dist=True,
                 storage_reader=DataStatesReader(engine=engine))
        _assert_same(out, saved)
    finally:
        slow.gate.set()
        engine.close()


def test_guard_queues_step_behind_the_copy_aside_on_the_gpu(tmp_path) -> None:
    """The first save's copy aside runs on the GPU behind the work queued before the save;
    the guard queues the step behind it there and returns before it is done."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2048, 2048, device="cuda")) for _ in range(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1.0)
    slow = SlowArena()
    engine = Engine(host_cache_size="1GiB", make_arena=slow)
    writer = DataStatesWriter(engine=engine)
    handle = guard(opt, writer)
    try:
        state = {f"p{i}": p for i, p in enumerate(params)}
        saved = {k: v.detach().clone() for k, v in state.items()}
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time before the snapshot may copy
        resp = dcp.async_save(state, checkpoint_id=tmp_path / "ck", no_dist=True,
                              storage_writer=writer)
        opt.step()
        assert not writer.staging_done(), "the guard waited for the copy aside on the CPU"
        assert writer.staging_ordered()  # a budget takes the next save at once
        assert any(not torch.equal(saved[k], v) for k, v in state.items())  # after the copy
        slow.gate.set()
        resp.upload_completion.result(TIMEOUT)
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(out, checkpoint_id=tmp_path / "ck", no_dist=True,
                 storage_reader=DataStatesReader(engine=engine))
        _assert_same(out, saved)
    finally:
        handle.remove()
        slow.gate.set()
        engine.close()


@pytest.mark.parametrize("headroom", [0.0, 1.0], ids=["gpu-buffer", "pageable"])
def test_stash_gpu_sources(headroom: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    sources = [torch.randn(1000, 333, device="cuda", generator=gen).bfloat16(),
               torch.empty(0, 4, device="cuda"), torch.tensor(2.5, device="cuda"),
               torch.arange(77, dtype=torch.int16)]
    expected = [_bits(s).clone() for s in sources]  # a CPU source's bits alias it
    assert cuda_copy.available()  # imports cuda-python's runtime for the copier
    copier = cuda_copy.CudaCopier()
    try:
        ready = copier.record_current({0})
        aside = stash(sources, copier, ready, gpu_headroom=headroom)
        copier.destroy_events(ready)
    finally:
        copier.close()
    for s in sources:
        s.zero_()
    on_gpu = headroom == 0.0
    assert (0 in aside.buffers) == on_gpu and HOST in aside.buffers
    for view, src, want in zip(aside.views, sources, expected, strict=True):
        assert view.is_cuda == (on_gpu and src.is_cuda and src.numel() > 0)
        assert view.shape == src.shape and view.dtype == src.dtype
        assert torch.equal(_bits(view), want)
    aside.free()


def test_manager_save_into_a_slot_not_pinned_yet_waits_aside(tmp_path, caplog) -> None:
    """A memory-tier save without prepare() whose slot is not pinned yet (pinning held)
    copies its GPU snapshot aside at once and waits there, uncommitted, for its slot to be
    pinned (no copy into memory not pinned yet), then moves in off the training's path; bit
    exact."""
    import logging
    import shutil
    import tempfile
    from pathlib import Path

    from helpers.fakes import HeldPinEngine

    from dcp_datastates import CheckpointManager

    caplog.set_level(logging.INFO, logger="dcp_datastates")
    memory = Path(tempfile.mkdtemp(prefix="dcp_gpu_aside_", dir="/dev/shm"))
    engine = HeldPinEngine(host_cache_size="64MiB")
    gen = torch.Generator(device="cuda").manual_seed(5)
    state = {"w": torch.randn(4096, 4096, device="cuda", generator=gen)}
    saved = {"w": state["w"].clone()}
    try:
        with CheckpointManager(tmp_path / "durable", memory_dir=memory, persist=None,
                               engine=engine) as manager:
            handle = manager.save(1, state)
            manager.wait_for_staging()
            state["w"].add_(1.0)  # after the copy aside: must not reach the checkpoint
            time.sleep(0.5)
            assert not handle.committed.done() and engine.pinned == 0
            assert any("not ready yet; the snapshot waits aside" in r.getMessage()
                       for r in caplog.records)
            engine.gate.set()
            handle.result(TIMEOUT)
            assert engine.pinned >= 1
            out = {"w": torch.zeros_like(saved["w"])}
            assert manager.load(out) == 1
            _assert_same(out, saved)
    finally:
        engine.gate.set()
        engine.close()
        shutil.rmtree(memory, ignore_errors=True)
