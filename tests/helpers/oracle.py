"""The differential test's oracle: states made from a seed, saved through every path users have,
loaded with ``DataStatesReader``, and compared with what DCP's own ``FileSystemWriter`` and
``FileSystemReader`` give for the same state (``tests/jobs/test_dcp_oracle.py`` on one rank,
``tests/mpi/test_dcp_oracle_mpi.py`` on several).

A state (:func:`make_state`) holds tensors of every dtype, views (transposed, strided, offset,
expanded, 0-d, empty; sharing a storage), nested containers and plain values, DTensors (Shard,
Replicate, ``_StridedShard``, uneven and empty shards) and, with ``bits``, conjugate and
negative views. The same call with ``blank=True`` gives the template a load fills: fresh
tensors, or (``mirror``) the same views of blank storage. :func:`differences` names the seed,
the save path and the item of every difference.

``python -m helpers.oracle process ROOT SEED...`` saves states through
``AsyncCheckpointerType.PROCESS`` on a one-rank gloo group (torch keeps that checkpoint process
for the life of the interpreter, so the tests run it in a child); ``python -m helpers.oracle
manager-load DURABLE MEMORY SEED OUT`` restarts a ``CheckpointManager`` on one rank and saves
what it loads into ``OUT``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dcp_datastates import CheckpointManager, DataStatesReader, DataStatesWriter, Engine

from . import ALL_DTYPES, blank_like, rand_tensor

try:  # torch >= 2.8
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # pragma: no cover - older torch
    DefaultStager = StagingOptions = None

#: Every way users save: DCP's save, async_save with our staging, with DCP's DefaultStager and
#: in DCP's checkpoint process, and CheckpointManager (loaded from memory, and from durable).
SAVE_PATHS = ("save", "async", "stager", "process", "manager_memory", "manager_durable")
#: Seeds CI runs; DCP_ORACLE_SEEDS ("3,8" or "0-99") or DCP_ORACLE_TRIALS (N: 0..N-1) widen.
CI_SEEDS = (0, 1, 2, 3)
TIMEOUT = 120
NEG_DTYPES = {torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.complex64,
              torch.complex128, torch.complex32}
COMPLEX = [torch.complex64, torch.complex128, torch.complex32]
#: DTensor dtypes: distribute_tensor pads uneven shards with fill_, which float4 lacks.
DTENSOR_DTYPES = [dt for dt in ALL_DTYPES if "float4" not in str(dt)]
#: DTensor sizes: over 2 and 4 ranks, 1 and 3 leave empty shards, the odd ones uneven ones.
SIZES = (0, 1, 3, 5, 6, 7, 9, 13)


def seeds(default: tuple[int, ...] = CI_SEEDS) -> list[int]:
    """The seeds to run: DCP_ORACLE_SEEDS, else range(DCP_ORACLE_TRIALS), else ``default``."""
    spec = os.environ.get("DCP_ORACLE_SEEDS", "").strip()
    if spec:
        out: list[int] = []
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
        return out
    trials = os.environ.get("DCP_ORACLE_TRIALS")
    return list(range(int(trials))) if trials else list(default)


# -- states --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Meshes:
    """The meshes a state's DTensors lie on: ``flat`` over every rank, ``square`` the same
    ranks in two dimensions (for ``_StridedShard`` and HSDP-like placements)."""

    flat: DeviceMesh
    square: DeviceMesh

    @classmethod
    def of(cls, size: int) -> Meshes:
        """Meshes of the whole world (of ``size`` ranks); a collective."""
        rows = 2 if size % 2 == 0 and size > 2 else 1
        return cls(init_device_mesh("cpu", (size,)),
                   init_device_mesh("cpu", (rows, size // rows)))

    @classmethod
    def pairs(cls, size: int) -> Meshes:
        """Meshes of this rank's pair (ranks 2k and 2k+1) of an even world; a collective."""
        pairs = init_device_mesh("cpu", (size // 2, 1, 2), mesh_dim_names=("pair", "row", "col"))
        return cls(pairs["col"], pairs["row", "col"])


#: View recipes of a 2-D base (rows, cols >= 2); ``expand`` cannot be a load's destination.
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "t": lambda b: b.t(),
    "strided": lambda b: b[::2, 1::2],
    "offset": lambda b: b[1:],
    "narrow": lambda b: b.narrow(1, 1, b.shape[1] - 1),
    "expand": lambda b: b[:1].expand(3, -1),
    "scalar": lambda b: b[1, 1],
    "empty": lambda b: b[1:1],
    "row": lambda b: b[-1],
}
BIT_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "conj": lambda b: b.conj(),
    "conj_t": lambda b: b.conj().t(),
    "neg": lambda b: torch._neg_view(b),
    "neg_strided": lambda b: torch._neg_view(b)[::2],
    "neg_conj": lambda b: torch._neg_view(b).conj(),
}
PLACEMENTS = ("shard0", "shard1", "replicate", "strided", "hsdp", "2d")


class _Make:
    """Tensors of one state: random bit patterns, or (``blank``) 0xA5 bytes of the same shape."""

    def __init__(self, seed: int, blank: bool) -> None:
        self.seed, self.blank, self.count = seed, blank, 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.count += 1
        t = rand_tensor(shape, dtype, seed=self.seed * 1009 + self.count)
        out = blank_like(t) if self.blank else t
        assert isinstance(out, torch.Tensor)
        return out

    def value(self, v: object) -> object:
        return None if self.blank else v


def make_state(seed: int, meshes: Meshes | None = None, *, blank: bool = False,
               mirror: bool = False, bits: bool = False, layout_seed: int | None = None) -> dict:
    """The state of ``seed`` (its DTensors on ``meshes``; full tensors without).

    ``blank``: the template a load fills, with fresh tensors or, with ``mirror``, the same views
    (bits, strides, shared storages) of blank storage. ``bits``: only conjugate and negative
    views. ``layout_seed``: other placements for the DTensors (a resharding load).
    """
    rng, make = random.Random(seed), _Make(seed, blank)
    if bits:
        return _bit_state(rng, make, mirror)
    layouts = random.Random(seed if layout_seed is None else layout_seed + 104729)
    state: dict = {"dtypes": {}, "views": {}, "plain": _plain_values(seed, rng, make)}
    for k in range(3):  # every dtype, over a few consecutive seeds
        dt = ALL_DTYPES[(3 * seed + k) % len(ALL_DTYPES)]
        shape = rng.choice([(), (0,), (rng.randint(1, 40),),
                            (rng.randint(1, 9), rng.randint(1, 9))])
        state["dtypes"][str(dt).removeprefix("torch.")] = make.tensor(shape, dt)
    if rng.random() < 0.4:  # one item above LARGE_ITEM_BYTES (aligned in the data file)
        state["dtypes"]["large"] = make.tensor((rng.randint(17_000, 40_000),), torch.float32)
    for b in range(rng.randint(1, 3)):
        base = make.tensor((rng.randint(2, 9), rng.randint(2, 9)), rng.choice(ALL_DTYPES))
        names = rng.sample(sorted(VIEWS), rng.randint(1, 4))
        group = {"base": base} if rng.random() < 0.6 else {}  # the views share its storage
        for name in names:
            group[name] = _view(VIEWS[name], base, blank, mirror and name != "expand")
        state["views"][f"b{b}"] = group
    state["dtensors"] = {f"d{k}": _dtensor(rng, layouts, make, meshes)
                         for k in range(rng.randint(2, 4))}
    return state


def _view(fn: Callable[[torch.Tensor], torch.Tensor], base: torch.Tensor, blank: bool,
          mirror: bool) -> torch.Tensor:
    """``fn(base)``; in a fresh template, a fresh blank tensor of its shape instead."""
    view = fn(base)
    if blank and not mirror:
        out = blank_like(view)
        assert isinstance(out, torch.Tensor)
        return out
    return view


def _plain_values(seed: int, rng: random.Random, make: _Make) -> dict:
    """Nested containers and non-tensor items (lists with tensors are DCP items each)."""
    return {
        "step": make.value(rng.randint(-2**40, 2**40)),
        "lr": make.value(rng.random()),
        "name": make.value(f"run-{seed}-ü-⚡"),
        "flags": make.value([True, False, None][: rng.randint(0, 3)]),
        "pair": make.value((seed, "x")),
        "blob": make.value(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 9)))),
        "big": make.value(2**70 + seed),
        "mixed": [make.value(seed), make.tensor((rng.randint(0, 5),), torch.int64),
                  {"k": make.value("v"), "t": make.tensor((2, 2), torch.float16)}],
        "deep": {"a": {"b": {"c": make.tensor((), torch.float64), "n": make.value(None)}}},
        "param": torch.nn.Parameter(make.tensor((3, 4), torch.float32)),
        "channels_last": make.tensor((2, 3, 4, 5), torch.bfloat16).to(
            memory_format=torch.channels_last),
    }


def _bit_state(rng: random.Random, make: _Make, mirror: bool) -> dict:
    """Conjugate and negative views of every dtype that has them, some sharing a base."""
    state: dict = {}
    neg = sorted(NEG_DTYPES, key=str)
    for k in range(rng.randint(2, 4)):  # the first one contiguous, the rest any
        kind = rng.choice(["conj", "neg", "neg_conj"] if k == 0 else sorted(BIT_VIEWS))
        # torch cannot copy a complex32 tensor with both bits ("neg_conj_cpu")
        dtype = rng.choice(COMPLEX[:2] if kind == "neg_conj" else
                           COMPLEX if "conj" in kind else neg)
        base = make.tensor((rng.randint(2, 6), rng.randint(2, 6)), dtype)
        group = {kind: _view(BIT_VIEWS[kind], base, make.blank, mirror)}
        if rng.random() < 0.5:  # a template's view and base share no storage: saved views
            # without their bits (DefaultStager's) would make the result the reads' order
            group["base"] = blank_like(base) if make.blank and mirror else base
        state[f"v{k}"] = group
    return state


def _placements(token: str, meshes: Meshes) -> tuple[DeviceMesh, list]:
    square = meshes.square
    return {
        "shard0": (meshes.flat, [Shard(0)]),
        "shard1": (meshes.flat, [Shard(1)]),
        "replicate": (meshes.flat, [Replicate()]),
        "strided": (square, [_StridedShard(0, split_factor=square.size(1)), Shard(0)]),
        "hsdp": (square, [Replicate(), Shard(0)]),
        "2d": (square, [Shard(0), Shard(1)]),
    }[token]


def _dtensor(rng: random.Random, layouts: random.Random, make: _Make,
             meshes: Meshes | None) -> torch.Tensor:
    """A DTensor of a full tensor every rank makes alike (no collective; placements from
    ``layouts``, the rest from ``rng``), or without ``meshes`` that full tensor."""
    full = make.tensor((rng.choice(SIZES), rng.choice(SIZES[1:])), rng.choice(DTENSOR_DTYPES))
    token = layouts.choice(PLACEMENTS)
    if meshes is None:
        return full
    mesh, placements = _placements(token, meshes)
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


# -- saves ---------------------------------------------------------------------------------------
@dataclass
class Saved:
    """A checkpoint of one path: ``directory`` (a DCP checkpoint), or a manager's tiers."""

    path: str
    directory: Path
    durable: Path | None = None
    memory: Path | None = None


def save_reference(state: dict, directory: Path, path: str = "save",
                   group: dist.ProcessGroup | None = None) -> Path:
    """``state`` through DCP's FileSystemWriter (on the default group, else ``group``): saved
    by ``dcp.save``, or for the ``stager`` path through the same DefaultStager (torch 2.13's
    drops conjugate and negative bits, whatever the writer)."""
    how = {"storage_writer": FileSystemWriter(directory), "process_group": group,
           "no_dist": not dist.is_initialized()}
    if path == "stager":
        dcp.async_save(state, async_stager=default_stager(), **how).upload_completion.result(
            timeout=TIMEOUT)
    else:
        dcp.save(state, **how)
    return directory


def default_stager() -> DefaultStager:
    """DCP's own stager, as its docs set it up (pinned memory only where CUDA is)."""
    return DefaultStager(StagingOptions(
        use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
        use_async_staging=True, use_non_blocking_copy=False))


def save_with(path: str, state: dict, root: Path, engine: Engine,
              group: dist.ProcessGroup | None = None) -> Saved:
    """Save ``state`` under ``root`` through ``path`` (one of SAVE_PATHS but ``process``,
    which :func:`process_saves` runs in a child; ``manager_*`` on the whole world)."""
    directory = root / "ckpt"
    how = {"checkpoint_id": directory, "storage_writer": DataStatesWriter(engine=engine),
           "process_group": group, "no_dist": not dist.is_initialized()}
    if path == "save":
        dcp.save(state, **how)
    elif path in ("async", "stager", "process"):
        if path == "stager":
            how["async_stager"] = default_stager()
        if path == "process":
            how["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        dcp.async_save(state, **how).upload_completion.result(timeout=TIMEOUT)
    elif path == "manager_memory":
        memory = root / f"memory_{_rank()}"
        with CheckpointManager(None, memory_dir=memory, engine=engine) as manager:
            manager.save(1, state).committed.result(timeout=TIMEOUT)
        return Saved(path, memory / "step_1", memory=memory)
    elif path == "manager_durable":
        durable, memory = root / "durable", root / f"memory_{_rank()}"
        with CheckpointManager(durable, memory_dir=memory, persist=1, engine=engine) as manager:
            manager.save(1, state)
            manager.wait()
        shutil.rmtree(memory)  # the node is gone: only the durable tier is left
        return Saved(path, durable / "step_1", durable=durable)
    else:
        raise ValueError(f"no save path {path!r}")
    return Saved(path, directory)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def load_with(saved: Saved, template: dict, engine: Engine, *, no_dist: bool = False,
              group: dist.ProcessGroup | None = None) -> dict:
    """Load ``saved`` into ``template`` as users do: a manager restarted on the whole world
    for the manager's paths, else (and with ``no_dist`` or ``group``) DataStatesReader on the
    checkpoint directory; return it."""
    whole = not no_dist and group is None
    if saved.memory is not None and whole:
        with CheckpointManager(None, memory_dir=saved.memory, engine=engine) as manager:
            manager.load(template)
    elif saved.durable is not None and whole:
        with scratch_dir("dcp_oracle_mem_") as memory:
            with CheckpointManager(saved.durable, memory_dir=memory / "m", engine=engine,
                                   persist=None) as manager:
                manager.load(template)
    else:
        dcp.load(template, checkpoint_id=saved.directory,
                 storage_reader=DataStatesReader(engine=engine), process_group=group,
                 no_dist=no_dist or not dist.is_initialized())
    return template


def load_reference(directory: Path, template: dict, *, no_dist: bool = False,
                   group: dist.ProcessGroup | None = None) -> dict:
    dcp.load(template, storage_reader=FileSystemReader(directory), process_group=group,
             no_dist=no_dist or not dist.is_initialized())
    return template


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A private directory under /dev/shm, removed after."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- comparison ----------------------------------------------------------------------------------
def _resolved_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (a DTensor's local shard), conjugate and negative bits
    applied; copied into fresh memory (``contiguous()`` keeps a size-1 dimension's stride,
    which ``view`` refuses)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    t = t.detach().resolve_conj().resolve_neg()
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def _tensor_differences(ours: object, theirs: torch.Tensor, where: str) -> list[str]:
    if not isinstance(ours, torch.Tensor):
        return [f"{where}: {type(ours).__name__} instead of a tensor"]
    if isinstance(ours, DTensor) != isinstance(theirs, DTensor):
        return [f"{where}: {type(ours).__name__}, DCP gives {type(theirs).__name__}"]
    out = []
    for what in ("dtype", "shape"):
        if getattr(ours, what) != getattr(theirs, what):
            out.append(f"{where}: {what} {getattr(ours, what)}, DCP gives "
                       f"{getattr(theirs, what)}")
    if isinstance(theirs, DTensor) and ours.placements != theirs.placements:
        out.append(f"{where}: placements {ours.placements}, DCP gives {theirs.placements}")
    for bit in ("is_conj", "is_neg"):
        if getattr(ours, bit)() != getattr(theirs, bit)():
            out.append(f"{where}: {bit}() {getattr(ours, bit)()}, DCP gives "
                       f"{getattr(theirs, bit)()}")
    if not out and not torch.equal(_resolved_bytes(ours), _resolved_bytes(theirs)):
        a, b = _resolved_bytes(ours), _resolved_bytes(theirs)
        first = int((a != b).nonzero()[0])
        out.append(f"{where}: bytes differ from byte {first} of {a.numel()} "
                   f"({int((a != b).sum())} differ)")
    return out


def differences(ours: object, theirs: object, where: str) -> list[str]:
    """Every difference of ``ours`` from DCP's ``theirs`` (tensors by dtype, shape, conj and
    neg bits and resolved bytes, DTensors by their local shards; the rest with ==), each
    named ``where`` + the item's path."""
    if isinstance(theirs, torch.Tensor):
        return _tensor_differences(ours, theirs, where)
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or ours.keys() != theirs.keys():
            return [f"{where}: {ours!r:.200}, DCP gives keys {sorted(map(str, theirs))}"]
        return [d for k in theirs for d in differences(ours[k], theirs[k], f"{where}.{k}")]
    if isinstance(theirs, (list, tuple)):
        if type(ours) is not type(theirs) or len(ours) != len(theirs):
            return [f"{where}: {ours!r:.200}, DCP gives {theirs!r:.200}"]
        return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                for d in differences(a, b, f"{where}[{i}]")]
    if type(ours) is not type(theirs) or ours != theirs:
        return [f"{where}: {ours!r:.200}, DCP gives {theirs!r:.200}"]
    return []


def report(problems: list[str], seed: int) -> str:
    """The failure message: the differences and how to run this seed alone."""
    shown = "\n".join(problems[:40]) + (f"\n... {len(problems) - 40} more"
                                        if len(problems) > 40 else "")
    return f"seed {seed} differs from DCP (rerun with DCP_ORACLE_SEEDS={seed}):\n{shown}"


# -- children ------------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """The environment of a one-rank child: the package and tests/ on its path, no MPI."""
    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"(OMPI_|PMIX_|PMI_|RANK$|WORLD_SIZE$|LOCAL_RANK$|MASTER_)", k)}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tests), str(tests.parent), env.get("PYTHONPATH")) if p)
    return env


def _process_saves(root: Path, seed_list: list[int]) -> None:
    """Save each seed's states (``main`` and ``bits``) through PROCESS mode into
    ``root/<seed>-<part>/ckpt``, on a one-rank gloo group."""
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0,
                            world_size=1)
    try:
        meshes = Meshes.of(1)
        with Engine(host_cache_size="8MiB", io_backend="threads") as engine:
            for seed in seed_list:
                for part in ("main", "bits"):
                    state = make_state(seed, meshes, bits=part == "bits")
                    save_with("process", state, root / f"{seed}-{part}", engine)
    finally:
        dist.destroy_process_group()


def _manager_load(durable: Path, memory: Path, seed: int, out: Path) -> None:
    """A manager restarted on one rank loads the latest step into ``seed``'s full template."""
    template = make_state(seed, None, blank=True)
    with Engine(host_cache_size="8MiB", io_backend="threads") as engine, \
            CheckpointManager(durable, memory_dir=memory, engine=engine, persist=None) as manager:
        manager.load(template)
    torch.save(template, out)


def main(argv: list[str]) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if argv[0] == "process":
        _process_saves(Path(argv[1]), [int(s) for s in argv[2:]])
    elif argv[0] == "manager-load":
        _manager_load(Path(argv[1]), Path(argv[2]), int(argv[3]), Path(argv[4]))
    print("ORACLE-CHILD-OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
