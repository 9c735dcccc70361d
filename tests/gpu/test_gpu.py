"""GPU path: lazy D2H snapshots on a side stream, the optimizer guard, pinned H2D restore."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, guard
from dcp_datastates._cuda import cuda_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert got[key].device == value.device, key
            assert torch.equal(bits(got[key]), bits(value)), key
        else:
            assert got[key] == value, key


def gpu_state(seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    return {
        "big_bf16": torch.randn(5000, 4096, device=dev, generator=gen).bfloat16(),  # 39 MiB
        "fp32": torch.randn(333, 777, device=dev, generator=gen),
        "fp8": torch.randn(1024, 1000, device=dev, generator=gen).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(7.25, device=dev),
        "empty": torch.empty(0, 5, device=dev),
        "strided": torch.randn(300, 200, device=dev, generator=gen).t(),
        "cpu": torch.arange(1000, dtype=torch.int64),
        "step": 42,
    }


def fresh_like(state: dict) -> dict:
    return {k: torch.full_like(v, 0) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


@pytest.fixture
def engine_of():
    """Engines of a given host cache size, closed (and checked for leaked leases) at the end."""
    made = []

    def make(size: str) -> Engine:
        made.append(Engine(host_cache_size=size))
        return made[-1]

    yield make
    for e in made:
        assert e.live_leases() == 0
        e.close()


def test_cuda_python_is_used() -> None:
    assert cuda_copy.available(), "cuda-python (cuda.bindings) must be importable on GPU hosts"


@pytest.mark.parametrize("cache", ["1GiB", "8MiB"], ids=["fits", "larger-than-cache"])
def test_gpu_round_trip_bit_exact(tmp_path, cache: str, engine_of) -> None:
    state = gpu_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    writer = DataStatesWriter(engine=engine_of(cache))
    resp = dcp.async_save(state, checkpoint_id=tmp_path / "ck", storage_writer=writer,
                          no_dist=True)
    resp.staging_completion.result()
    resp.upload_completion.result()
    out = fresh_like(state)
    dcp.load(out, checkpoint_id=tmp_path / "ck", storage_reader=DataStatesReader(), no_dist=True)
    assert_same(out, expected)


def test_snapshot_reports_the_gpu_time_of_its_copies(tmp_path, engine_of) -> None:
    """``copy_s``: the copies' own time on the GPU, within the snapshot's wall time, and none
    for a state without GPU tensors."""
    writer = DataStatesWriter(engine=engine_of("1GiB"))
    for name, state, on_gpu in [("gpu", gpu_state(3), True),
                                ("cpu", {"w": torch.arange(1 << 20)}, False)]:
        resp = dcp.async_save(state, checkpoint_id=tmp_path / name, storage_writer=writer,
                              no_dist=True)
        resp.staging_completion.result()
        resp.upload_completion.result()
        st = writer.last_stats()
        if on_gpu:
            assert 0 < st.copy_s <= st.snapshot_s, (st.copy_s, st.snapshot_s)
        else:
            assert st.copy_s is None


def test_fresh_default_writer_per_save_on_gpu(tmp_path) -> None:
    """DCP's idiom: a new writer and reader per call, default arguments, 5 rounds."""
    for i in range(5):
        state = gpu_state(20 + i)
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        resp = dcp.async_save(state, checkpoint_id=tmp_path / f"ck{i}",
                              storage_writer=DataStatesWriter(), no_dist=True)
        resp.staging_completion.result()
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize > 1:
                v.add_(1.0)  # after staging: must not reach the checkpoint
        resp.upload_completion.result()
        out = fresh_like(expected)
        dcp.load(out, checkpoint_id=tmp_path / f"ck{i}", storage_reader=DataStatesReader(),
                 no_dist=True)
        assert_same(out, expected)


def test_mutation_after_staging_completion_is_not_saved(tmp_path, engine_of) -> None:
    state = gpu_state(1)
    before = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    writer = DataStatesWriter(engine=engine_of("1GiB"))
    resp = dcp.async_save(state, checkpoint_id=tmp_path / "ck", storage_writer=writer,
                          no_dist=True)
    resp.staging_completion.result()
    for v in state.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize > 1:
            v.add_(1.0)
    resp.upload_completion.result()
    out = fresh_like(state)
    dcp.load(out, checkpoint_id=tmp_path / "ck", storage_reader=DataStatesReader(), no_dist=True)
    assert_same({k: out[k] for k in before}, before)


@pytest.mark.parametrize("fresh", [False, True], ids=["kept-writer", "fresh-writer"])
def test_guard_queues_step_behind_snapshot(tmp_path, engine_of, fresh: bool) -> None:
    """The guard does not hold the training thread while the copies run: the step's kernels
    queue behind them on the GPU, and the checkpoint holds the values before the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, bias=False) for _ in range(8)])
    model = model.cuda()  # 8 x 256 MiB of fp32 parameters: the copy takes tens of ms
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = engine_of("3GiB")
    engine.reserve(2 << 30).release()  # map and pin the cache before timing anything
    writer = DataStatesWriter(engine=engine)
    handle = guard(opt, engine if fresh else writer)
    for warm_up in (True, False):  # the first step's lazy set-up (CPU time) is not the guard's
        opt.zero_grad()
        model(torch.randn(4, 8192, device="cuda")).square().mean().backward()
        if warm_up:
            opt.step()
    torch.cuda.synchronize()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resp = dcp.async_save(model.state_dict(), checkpoint_id=tmp_path / "ck",
                          storage_writer=DataStatesWriter(engine=engine) if fresh else writer,
                          no_dist=True)
    assert not resp.staging_completion.done(), "snapshot finished before async_save returned"
    opt.step()  # no explicit wait: the guard queues the step behind the copies
    assert not resp.staging_completion.done(), "the guard waited for the copies on the CPU"
    resp.staging_completion.result()
    assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
    resp.upload_completion.result()
    out = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(out, checkpoint_id=tmp_path / "ck", storage_reader=DataStatesReader(), no_dist=True)
    assert_same(out, saved)
    handle.remove()


def test_back_to_back_async_saves_queue_safely(tmp_path, engine_of) -> None:
    writer = DataStatesWriter(engine=engine_of("64MiB"))
    states, responses = [], []
    for i in range(4):
        state = gpu_state(10 + i)
        states.append(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        )
        responses.append(dcp.async_save(state, checkpoint_id=tmp_path / f"ck{i}",
                                        storage_writer=writer, no_dist=True))
    for resp in responses:
        resp.upload_completion.result()
    for i, want in enumerate(states):
        out = fresh_like(want)
        dcp.load(out, checkpoint_id=tmp_path / f"ck{i}", storage_reader=DataStatesReader(),
                 no_dist=True)
        assert_same(out, want)


def test_next_snapshot_is_issued_while_the_previous_one_settles(tmp_path) -> None:
    """The staging thread issues the second snapshot's copies while the first one's settle
    (the wait for its copies' end) is held: the guard queues work behind both on the GPU at
    once, and each checkpoint holds its own bytes, with the copies' GPU time."""
    from helpers.fakes import HeldSettles

    held = HeldSettles()
    engine = Engine(host_cache_size="1GiB", settle_pool=held)
    try:
        engine.reserve(256 << 20).release()  # the cache is made: no snapshot waits aside
        writer = DataStatesWriter(engine=engine)
        states = [gpu_state(30 + i) for i in range(2)]
        expected = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for s in states]
        responses = [dcp.async_save(s, checkpoint_id=tmp_path / f"ck{i}", storage_writer=writer,
                                    no_dist=True) for i, s in enumerate(states)]
        assert held.wait_handed(2, 60)
        assert not responses[0].staging_completion.done()
        assert writer.staging_ordered()
        engine.order_after_staging()  # returns at once: the GPU holds what comes next
        for state in states:
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.is_cuda \
                        and v.dtype.itemsize > 1:
                    v.add_(1.0)  # queued behind both snapshots' copies
        held.gate.set()
        for i, resp in enumerate(responses):
            resp.upload_completion.result()
            out = fresh_like(expected[i])
            dcp.load(out, checkpoint_id=tmp_path / f"ck{i}", storage_reader=DataStatesReader(),
                     no_dist=True)
            assert_same(out, expected[i])
        st = writer.last_stats()
        assert 0 < st.copy_s <= st.snapshot_s, (st.copy_s, st.snapshot_s)
    finally:
        held.gate.set()
        engine.close()
    assert engine.live_leases() == 0


def test_sync_save_of_gpu_state_and_load_into_strided_gpu_target(tmp_path, engine_of) -> None:
    state = {"w": torch.randn(512, 256, device="cuda")}
    dcp.save(state, checkpoint_id=tmp_path / "ck",
             storage_writer=DataStatesWriter(engine=engine_of("64MiB")), no_dist=True)
    target = torch.zeros(256, 512, device="cuda").t()  # non-contiguous destination
    dcp.load({"w": target}, checkpoint_id=tmp_path / "ck", storage_reader=DataStatesReader(),
             no_dist=True)
    assert torch.equal(target, state["w"])


def test_manager_snapshots_every_step_into_pinned_slots(tmp_path, engine_of) -> None:
    """CheckpointManager on tmpfs with a GPU state: each step's snapshot lands in a pinned slot
    file that becomes the step's data file (the guard holds optimizer.step until it is copied);
    the kept steps restore bit-exactly onto the GPU."""
    import shutil
    import tempfile
    from pathlib import Path

    from dcp_datastates import CheckpointManager

    memory = Path(tempfile.mkdtemp(prefix="dcp_gpu_tiers_", dir="/dev/shm"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = engine_of("256MiB")
    saved = {}
    try:
        with CheckpointManager(tmp_path / "durable", memory_dir=memory, keep_memory=2,
                               persist=None, engine=engine) as manager:
            handle = guard(opt, manager)
            for step in range(1, 7):
                model(torch.randn(8, 4096, device="cuda")).square().mean().backward()
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                if step == 1:
                    manager.prepare(state)
                opt.step()  # waits for the previous step's snapshot
                opt.zero_grad()
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                manager.save(step, state)
            manager.wait()
            handle.remove()
            figures = [f for f in manager.history if f.step > 1]
            assert figures and all(0 < f.copy_s <= f.snapshot_s for f in figures), figures
            for step in (5, 6):
                out = {"model": {k: torch.zeros_like(v) for k, v in saved[step].items()}}
                assert manager.load(out, step=step) == step
                assert_same(out["model"], saved[step])
        assert engine.live_leases() == 0
        assert sorted(p.name for p in memory.iterdir() if p.name.startswith("step_")) == [
            "step_5", "step_6"]
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def test_a_copy_aside_does_not_queue_behind_a_move_to_host_memory() -> None:
    """A snapshot's copy aside (device to device: the training's next step waits for it) is
    done while an earlier snapshot's move to host memory (2 GiB) is still running, and both
    bring their bytes."""
    copier = cuda_copy.CudaCopier()
    try:
        big = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device="cuda")
        host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
        small = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        aside = torch.empty_like(small)
        torch.cuda.synchronize()
        move = copier.issue([(0, host.data_ptr(), big.data_ptr(), big.numel())], "d2h")
        copier.copy([(0, aside.data_ptr(), small.data_ptr(), small.numel())], "d2d")
        (_, _, moved), = move.spans
        running = cuda_copy.cudart.cudaEventQuery(moved)[0]
        move.wait()
        assert running == cuda_copy.cudart.cudaError_t.cudaErrorNotReady
        assert torch.equal(aside, small)
        assert torch.equal(host[::4096], big[::4096].cpu())
    finally:
        copier.close()


def test_a_load_to_the_gpu_waits_for_a_move_to_host_memory_of_its_tensor() -> None:
    """A load's copy into a tensor (host to device) issued while an earlier save's move of that
    tensor to host memory (2 GiB) still runs waits for the move on the GPU: the save keeps the
    bytes the tensor had, the tensor gets the loaded ones. The load writes the tensor's last
    256 MiB, which the move reads last (without the wait, those bytes of the save were the
    loaded ones: H100, per-kind streams)."""
    copier = cuda_copy.CudaCopier()
    try:
        big = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device="cuda")
        before = big[::4096].cpu()
        host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
        tail = 256 << 20
        loaded = torch.full((tail,), 7, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        move = copier.issue([(0, host.data_ptr(), big.data_ptr(), big.numel())], "d2h")
        copier.copy([(0, big.data_ptr() + big.numel() - tail, loaded.data_ptr(), tail)], "h2d")
        move.wait()
        assert torch.equal(host[::4096], before)
        assert bool((big[-tail:] == 7).all())
    finally:
        copier.close()
