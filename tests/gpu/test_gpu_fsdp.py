"""FSDP2 on several GPUs, as users write it: DTensor states of CUDA meshes saved with a fresh
``DataStatesWriter()`` per save (the default engine, the default process group) and loaded with
``DataStatesReader()``, bit for bit per rank; resharding 2 -> 1 and 1 -> 2 GPUs; the snapshot
stays in host memory (no GPU memory beyond the state's own). Run on a machine with 2 GPUs::

    torchrun --standalone --nproc-per-node 2 -m pytest -q -p no:cacheprovider \\
        -p no:pytest_mpi tests/gpu/test_gpu_fsdp.py

(or ``mpirun -n 2 ... --with-mpi``). A rank that finds a problem reports it through ``agree``,
so every rank fails together.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import mpi_util
from helpers.mpi_util import World, agree, collecting
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine
from dcp_datastates import _cli as cli
from dcp_datastates._cuda.gpu_sums import GpuSums, compile_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

world = mpi_util.world
shared = mpi_util.shared

LAYERS, DIM = 8, 1024
#: The share of the state's local bytes a save may allocate on the GPU (DCP's planning and
#: collectives, checksums); a copy of the state back on the GPU would take all of it.
SLACK = 0.1


@pytest.fixture(autouse=True)
def gpus(world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dcp_datastates")  # in a failure's report
    if torch.cuda.device_count() < world.size:
        pytest.skip(f"needs a GPU per rank ({world.size}), found {torch.cuda.device_count()}")


def build(dtype: torch.dtype, sharded: bool, seed: int = 0) -> tuple[nn.Module, object]:
    """8 linear layers (FSDP2 per layer and on the whole, over every GPU, where ``sharded``)
    and AdamW after one step: every parameter has its optimizer state."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)]).to("cuda", dtype)
    if sharded:
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, dtype, seed)
    return model, opt


def step(model: nn.Module, opt: object, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    x = torch.randn(16, DIM, device="cuda", dtype=dtype, generator=gen)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: nn.Module, opt: object, **options: bool) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(**options))
    return {"model": msd, "optim": osd}


def locals_of(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` (a DTensor's local shard) as a host copy, by path."""
    if isinstance(state, DTensor):
        return {prefix: state.to_local().detach().cpu().clone()}
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().cpu().clone()}
    if isinstance(state, dict):
        return {k: v for key, value in state.items()
                for k, v in locals_of(value, f"{prefix}.{key}").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state)
                for k, v in locals_of(value, f"{prefix}[{i}]").items()}
    return {}


def differences(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    if actual.keys() != expected.keys():
        return [f"tensors {sorted(actual)} != {sorted(expected)}"]
    return [f"{k}: bytes differ" for k, v in expected.items()
            if (actual[k].dtype, actual[k].shape) != (v.dtype, v.shape)
            or not torch.equal(actual[k].view(-1).view(torch.uint8),
                               v.contiguous().view(-1).view(torch.uint8))]


def load_into(model: nn.Module, opt: object, path: Path, **kw: object) -> None:
    state = state_of(model, opt)
    dcp.load(state, checkpoint_id=path, storage_reader=DataStatesReader(), **kw)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full(model: nn.Module, opt: object) -> dict[str, torch.Tensor]:
    """Full tensors of model and optimizer (a collective when sharded)."""
    return locals_of(state_of(model, opt, full_state_dict=True))


@pytest.mark.parametrize("how", ["async", "sync"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp2_saves_as_dcp_idiom_and_loads_bit_exact(world: World, shared: Path,
                                                      dtype: torch.dtype, how: str) -> None:
    model, opt = build(dtype, sharded=True)
    state = state_of(model, opt)
    saved = locals_of(state)
    slack = SLACK * sum(t.numel() * t.element_size() for t in saved.values())
    path = shared / "ckpt"
    errors: list[str] = []
    before = after_a_first_save(state, shared / "warm", errors)
    resp = None
    with collecting(errors, f"{how} save"):
        try:
            if how == "async":
                resp = dcp.async_save(state, checkpoint_id=path,
                                      storage_writer=DataStatesWriter())
                resp.staging_completion.result()
            else:
                dcp.save(state, checkpoint_id=path, storage_writer=DataStatesWriter())
            torch.cuda.synchronize()
            grown = torch.cuda.max_memory_allocated() - before
            assert grown <= slack, f"the save took {grown} bytes of GPU memory"
            if how == "async":
                step(model, opt, dtype, 1)  # the loop goes on: the checkpoint keeps the old state
        finally:  # no collective of this thread while DCP's upload thread runs its own
            if resp is not None:
                resp.upload_completion.result()
    agree(errors, f"FSDP2 {how} save with DataStatesWriter()")
    if world.rank == 0:
        with collecting(errors, "verify"):
            assert cli.main(["verify", "-q", str(path)]) == 0
    agree(errors, "verify of the FSDP2 checkpoint")

    model2, opt2 = build(dtype, sharded=True, seed=7)
    with collecting(errors, "load"):
        load_into(model2, opt2, path)
        errors += differences(locals_of(state_of(model2, opt2)), saved)
    agree(errors, f"{world.size} -> {world.size} GPUs, every rank's shards bit for bit")


def after_a_first_save(state: dict, path: Path, errors: list[str]) -> int:
    """Save ``state`` once (the first save of a process copies its snapshot aside, on the
    GPU, while the engine's host cache is made), then start counting GPU memory: the bytes
    allocated now (the peak is reset)."""
    with collecting(errors, "a first save"):
        resp = dcp.async_save(state, checkpoint_id=path, storage_writer=DataStatesWriter())
        try:
            resp.upload_completion.result(timeout=90)
        except TimeoutError:  # a hang: where every thread of this rank is, for the report
            faulthandler.dump_traceback(all_threads=True)
            raise
    agree(errors, "a first FSDP2 save with DataStatesWriter()")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def test_fsdp2_staged_state_stays_in_host_memory(world: World, shared: Path) -> None:
    """What DCP's planner gets from the writer: DTensors of the CUDA mesh whose local shards
    are in host memory, made with no GPU memory beyond the state's own."""
    model, opt = build(torch.float32, sharded=True)
    state = state_of(model, opt)
    errors: list[str] = []
    before = after_a_first_save(state, shared / "warm", errors)
    writer = DataStatesWriter()
    try:
        staged = writer.stage(state).result(timeout=120)
        torch.cuda.synchronize()
        with collecting(errors, "staged"):
            grown = torch.cuda.max_memory_allocated() - before
            local = locals_of(state)
            slack = SLACK * sum(t.numel() * t.element_size() for t in local.values())
            assert grown <= slack, f"staging took {grown} bytes of GPU memory"
            for (name, got), src in zip(locals_of(staged).items(), local.values(), strict=True):
                assert torch.equal(got, src), name
            dts = [v for v in staged["model"].values() if isinstance(v, DTensor)]
            assert dts and all(d.to_local().device.type == "cpu" and
                               d.device_mesh.device_type == "cuda" for d in dts)
    finally:
        writer.close()
    agree(errors, "the staged FSDP2 state")


def test_reshard_2_to_1_and_1_to_2_gpus(world: World, shared: Path) -> None:
    """A checkpoint of every GPU loaded by one process on one GPU, and one process's
    checkpoint (a plain model on one GPU) loaded by every GPU into FSDP2."""
    errors: list[str] = []
    model, opt = build(torch.float32, sharded=True)
    expected = full(model, opt)
    dcp.async_save(state_of(model, opt), checkpoint_id=shared / "two",
                   storage_writer=DataStatesWriter()).upload_completion.result()
    if world.rank == 0:
        with collecting(errors, "2 -> 1"):
            one, one_opt = build(torch.float32, sharded=False, seed=7)
            load_into(one, one_opt, shared / "two", no_dist=True)
            errors += differences(locals_of(state_of(one, one_opt)), expected)
            plain, plain_opt = build(torch.float32, sharded=False, seed=3)
            dcp.save(state_of(plain, plain_opt), checkpoint_id=shared / "one",
                     storage_writer=DataStatesWriter(), no_dist=True)
    agree(errors, "2 GPUs -> 1")
    plain, plain_opt = build(torch.float32, sharded=False, seed=3)
    expected = locals_of(state_of(plain, plain_opt))
    model, opt = build(torch.float32, sharded=True, seed=7)
    with collecting(errors, "1 -> 2"):
        load_into(model, opt, shared / "one")
    errors += differences(full(model, opt), expected)
    agree(errors, f"1 GPU -> {world.size}")


def test_saves_go_on_when_the_checksum_kernel_is_built_after_the_first(world: World,
                                                                       shared: Path) -> None:
    """On a fresh machine NVRTC takes seconds, so the GPU checksum kernel is ready only after
    the first saves, and the staging thread of each rank loads and launches it on the rank's
    GPU (rank 1's launch once failed there, and rank 0 hung in DCP's planning)."""
    built = threading.Event()

    def late(arch: str) -> bytes:
        try:
            return compile_kernel(arch)
        finally:
            built.set()

    release = threading.Event()
    sums = GpuSums(build=lambda arch: release.wait(60) and late(arch))
    engine = Engine(gpu_sums=sums)
    errors: list[str] = []
    try:
        model, opt = build(torch.float32, sharded=True)
        for k in range(2):  # the first with CPU checksums, the second with the kernel's
            state = state_of(model, opt)
            saved = locals_of(state)
            with collecting(errors, f"save {k}"):
                dcp.async_save(state, checkpoint_id=shared / f"late{k}",
                               storage_writer=DataStatesWriter(engine=engine)) \
                    .upload_completion.result(timeout=90)
            agree(errors, f"save {k} around the kernel's build")
            release.set()
            assert built.wait(60), "the kernel was not built in 60 s"
            step(model, opt, torch.float32, k + 1)
        model2, opt2 = build(torch.float32, sharded=True, seed=7)
        with collecting(errors, "load"):
            load_into(model2, opt2, shared / "late1")
            errors += differences(locals_of(state_of(model2, opt2)), saved)
        agree(errors, "the save with the kernel built late, bit for bit")
        assert sums.ready(torch.cuda.current_device()), "the kernel was given up (see the log)"
    finally:
        engine.close()
