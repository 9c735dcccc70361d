"""Snapshots: a state dict's tensors copied into one lease, laid out as the data file lays them.

``walk`` runs on the caller's thread and only records the structure (tensors become
references); ``issue_into`` runs on the engine's staging thread: every tensor gets the place the
data file will give it (:func:`~dcp_datastates._format.data_file.place_tensors`, kept in the
:class:`Snapshot` and reused by the flush), so a lease is an image of the file's tensor data
and the flush writes it in a few large requests; small tensors share the lease instead of
taking a 4 KiB region each. A snapshot goes to a lease of the engine's host cache, or to a
:class:`SnapshotTarget` (a memory-tier slot) whose memory becomes the data file in place.
GPU tensors are copied on a side stream after an event recorded by ``walk``'s caller (waited
for by :func:`copies_done`, on the engine's settle thread), small ones from copies made in the
call (:func:`keep_still`); CPU tensors with ``memmove`` (small) or torch (large). What does not
fit in the lease goes to pageable memory.
"""

from __future__ import annotations

import copy
import ctypes
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .._cuda.cuda_copy import Copy, CudaCopier, IssuedCopies
from .._format.data_file import ItemSpec, Placement, place_tensors
from .._memory.host_cache import MEMMOVE_BYTES, Lease, nbytes_of, resolved, set_storage

#: The attributes of DCP's ``CheckpointableTensor`` protocol (torch >= 2.14): a plain tensor
#: holding shards of a larger one. Its staged copy must carry them, or DCP plans the copy as a
#: whole tensor of the local buffer's shape.
SHARD_ATTRS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")


class SnapshotTarget(Protocol):
    """Where a snapshot goes instead of the engine's host cache: memory that then becomes the
    save's data file in place (a memory-tier slot). A lease it gives starts where the file's
    data starts (``lease.offset``; the header goes before it). ``str()`` names it in logs.
    ``pinned``: whether it is ready now, sized and pinned (if not, the snapshot is copied
    aside at once, and the target is sized and filled off the training's path; or, where the
    copy aside would go to pageable memory, the staging thread waits for :meth:`when_ready`)."""

    pinned: bool

    def lease(self, total: int, entries: int) -> Lease | None:
        """Memory for a snapshot of ``total`` bytes of ``entries`` tensors (None: busy).
        Raises ``OSError`` or ``RuntimeError`` where the memory cannot be had."""

    def need_room(self, header_len: int) -> None:
        """A header of ``header_len`` bytes did not fit before the data: the next lease
        leaves room for it."""

    def adopt(self, path: Path) -> Path:
        """Move the memory's file to ``path`` (the save's data file); return ``path``."""

    def when_ready(self, queue: Callable[[], None]) -> None:
        """Call ``queue`` (the move of a snapshot copied aside) once :meth:`lease` can be
        had without waiting: at once, or later from another thread."""


@dataclass
class Snapshot:
    """A staged snapshot, as the flush needs it: where each source went, and in what lease."""

    lease: Lease | None
    placements: list[Placement]  # place_tensors of the sources (spec names: source indices)
    in_target: bool = False  # the lease is a SnapshotTarget's: the data file in place
    overflow: int = 0  # bytes staged in pageable memory instead
    copies: dict[int, int] = field(default_factory=dict)  # data_ptr of a copy -> its source
    #: source -> digests of its GPU_SUM_BLOCK blocks, made on the GPU as it was copied
    sums: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _TensorRef:
    index: int
    attrs: tuple[tuple[str, object], ...] = ()  # set on the staged copy (SHARD_ATTRS)


@dataclass(frozen=True)
class _DTensorRef:
    """A DTensor's place in a skeleton: its local tensor is source ``index``; ``spec`` (mesh,
    placements, global shape and stride) is the source's, reused as it is."""

    index: int
    spec: DTensorSpec


#: Values :func:`walk` keeps as they are (no copy): immutable.
_IMMUTABLE = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype,
                        torch.device})


def walk(obj: object, sources: list[torch.Tensor], memo: dict[int, object],
         dtensors: dict[int, DTensor], path: str = "") -> object:
    """The structure of ``obj`` (at ``path`` in the state) with tensors replaced by references
    numbering ``sources`` (conjugate and negative views
    :func:`~dcp_datastates._memory.host_cache.resolved`); the DTensors go to ``dtensors``
    under their locals' numbers.

    Only dicts and lists are entered, as DCP does; other values are deep-copied here, on the
    caller's thread (the loop may change them once the call returns), immutable ones kept: one
    that cannot be copied (a lock) is a TypeError naming it.
    """
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, DTensor):
        dtensors[len(sources)] = obj
        out: object = _DTensorRef(len(sources), obj._spec)
        local = resolved(obj._local_tensor.detach())  # to_local(): autograd, far slower
        sources.append(local.contiguous() if local.is_cuda else local)
    elif isinstance(obj, torch.Tensor):
        attrs = tuple((a, getattr(obj, a)) for a in SHARD_ATTRS if hasattr(obj, a))
        out = _TensorRef(len(sources), attrs)
        tensor = resolved(obj.detach())
        sources.append(tensor.contiguous() if tensor.is_cuda else tensor)
    elif isinstance(obj, dict):
        out = {k: walk(v, sources, memo, dtensors, f"{path}.{k}" if path else str(k))
               for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [walk(v, sources, memo, dtensors, f"{path}.{i}" if path else str(i))
               for i, v in enumerate(obj)]
    elif type(obj) in _IMMUTABLE:
        out = obj
    else:
        try:
            out = copy.deepcopy(obj)
        except Exception as exc:  # a lock, a file, a generator: what pickle refuses
            raise TypeError(f"{path!r}: a {type(obj).__name__} that cannot be copied or saved "
                            f"({exc}); a state holds tensors and picklable values") from exc
    memo[id(obj)] = out
    return out


#: GPU tensors of at most this many bytes each are copied in the call, as CPU tensors are: a
#: write that no version counter tells of (BatchNorm's running statistics in forward, a write
#: through ``p.data``) cannot reach them. 1 MiB holds any normalization layer's statistics
#: and the biases and norms of every usual width, and little of a model's bytes.
AT_CALL_BYTES = 1 << 20
#: The most bytes of small GPU tensors one save copies in the call (the rest go lazily): the
#: call's GPU time and memory stay bounded (64 MiB: microseconds of device copies).
AT_CALL_TOTAL_BYTES = 64 << 20


def keep_still(sources: list[torch.Tensor], skeleton: object) -> set[int]:
    """Replace, in ``sources`` (of ``walk``'s ``skeleton``), those a lazy copy cannot take at
    their values of the call by copies made now; return their indices. CPU tensors (the
    staging thread copies them while the caller goes on), inference tensors (no version
    counter tells of a write to them) and small GPU tensors (:data:`AT_CALL_BYTES`, up to
    :data:`AT_CALL_TOTAL_BYTES` in all, in order: one foreach copy), GPU ones on the current
    stream, in the call's order. Other GPU tensors stay: their copies are lazy. Raises
    TypeError naming a tensor torch cannot copy, or a meta tensor."""
    copied, small, room = set(), [], AT_CALL_TOTAL_BYTES
    for i, t in enumerate(sources):
        if t.is_meta:
            raise meta_error(source_paths(skeleton).get(i, f"tensor {i}"))
        if not t.is_cuda or t.is_inference():
            sources[i] = _copy(t, i, skeleton)
            copied.add(i)
        elif (n := nbytes_of(t)) <= min(AT_CALL_BYTES, room):
            small.append(i)
            room -= n
    if small:
        copies = [torch.empty_like(sources[i], memory_format=torch.contiguous_format)
                  for i in small]
        try:
            torch._foreach_copy_(copies, [sources[i] for i in small])
        except (RuntimeError, NotImplementedError):  # a dtype foreach ops lack: one by one
            copies = [_copy(sources[i], i, skeleton) for i in small]
        for i, c in zip(small, copies, strict=True):
            sources[i] = c
    return copied | set(small)


def meta_error(name: str) -> TypeError:
    """The error for item ``name``, a tensor on the meta device: it holds no data (a copy of
    it would read a null pointer)."""
    return TypeError(f"{name!r}: a tensor on the meta device, which holds no data (made there "
                     f"and never materialized?); a save takes tensors that hold their values")


def _copy(t: torch.Tensor, i: int, skeleton: object) -> torch.Tensor:
    """A contiguous copy of source ``i``; TypeError naming it where torch cannot copy it."""
    try:
        return t.clone(memory_format=torch.contiguous_format)
    except (RuntimeError, NotImplementedError) as exc:
        raise TypeError(f"{source_paths(skeleton).get(i, f'tensor {i}')!r}: a "
                        f"{t.dtype} tensor torch cannot copy ({exc})") from exc


def source_paths(skeleton: object) -> dict[int, str]:
    """Each source's place in the state dict (``model.layers.0.weight``), by source index."""
    out: dict[int, str] = {}
    todo: list[tuple[object, str]] = [(skeleton, "")]
    while todo:
        obj, path = todo.pop()
        if isinstance(obj, (_TensorRef, _DTensorRef)):
            out.setdefault(obj.index, path)
        elif isinstance(obj, dict):
            todo += [(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()]
        elif isinstance(obj, list):
            todo += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    return out


def rebuild(obj: object, staged: list[torch.Tensor], memo: dict[int, object]) -> object:
    """The state dict of ``walk``'s skeleton over the ``staged`` copies; a DTensor's is a
    DTensor of the source's mesh and placements whose local tensor is its staged (host) copy,
    as DCP's own staging makes it: nothing goes back to the mesh's device."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, _TensorRef):
        out: object = staged[obj.index]
        for name, value in obj.attrs:
            setattr(out, name, copy.deepcopy(value))
    elif isinstance(obj, _DTensorRef):
        # not DTensor.from_local: it moves the local tensor to the mesh's device (a CUDA
        # mesh: every staged shard copied back to the GPU)
        out = DTensor(staged[obj.index], obj.spec, requires_grad=False)
    elif isinstance(obj, dict):
        out = {k: rebuild(v, staged, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [rebuild(v, staged, memo) for v in obj]
    else:  # walk's copy (the skeleton is the save's own)
        out = obj
    memo[id(obj)] = out
    return out


def place_sources(sources: list[torch.Tensor]) -> list[Placement]:
    """Where the data file puts each source (spec names are the sources' indices)."""
    return place_tensors([ItemSpec(str(i), t.dtype, tuple(t.shape), nbytes_of(t))
                          for i, t in enumerate(sources)])


def offsets_of(placements: list[Placement], count: int) -> tuple[list[int], int]:
    """Each of ``count`` sources' byte offset in ``placements``, and the bytes they span."""
    offsets = [0] * count
    for p in placements:
        if p.spec is not None:
            offsets[int(p.spec.name)] = p.begin
    return offsets, placements[-1].end if placements else 0


def layout(sources: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each source's byte offset in a lease, and the bytes the lease needs."""
    return offsets_of(place_sources(sources), len(sources))


def copy_into(
    lease: Lease | None,
    sources: list[torch.Tensor],
    offsets: list[int],
    cuda: CudaCopier | None,
    ready: dict[int, object] | None,
    own_storage: AbstractSet[int] = frozenset(),
    issued: Callable[[dict[int, object] | None], None] | None = None,
) -> tuple[list[torch.Tensor], int, float | None]:
    """:func:`issue_into` and wait for the copies: the copies, the bytes that did not fit and
    the seconds the GPU copies took on the GPU (None: none made with cuda-python)."""
    staged, overflow, copies = issue_into(lease, sources, offsets, cuda, ready, own_storage,
                                          issued, hashed=False)  # the flush hashes them
    return staged, overflow, copies_done(copies)


def copies_done(copies: IssuedCopies | None) -> float | None:
    """Wait for the GPU copies of :func:`issue_into`; the seconds they took on the GPU (None:
    none made with cuda-python)."""
    return copies.wait() if copies is not None else None


def issue_into(
    lease: Lease | None,
    sources: list[torch.Tensor],
    offsets: list[int],
    cuda: CudaCopier | None,
    ready: dict[int, object] | None,
    own_storage: AbstractSet[int] = frozenset(),
    issued: Callable[[dict[int, object] | None], None] | None = None, hashed: bool = True,
) -> tuple[list[torch.Tensor], int, IssuedCopies | None]:
    """Copy ``sources`` into ``lease`` at ``offsets`` (GPU ones: issued); return the copies,
    the bytes that did not fit (staged in pageable memory instead) and the GPU copies in flight
    (None: none; wait with :func:`copies_done` before the sources or the copies' memory go;
    their ``checksums`` then hold GPU sources' block digests by source index, where made and
    ``hashed``). Gaps in the lease are zeroed. ``issued``: see :meth:`CudaCopier.issue`.
    Sources in ``own_storage`` (DTensor locals) get a storage of their own: torch pickles a
    DTensor whose local tensor sits at a storage offset as a plain tensor."""
    base = lease.storage() if lease is not None else None
    staged: list[torch.Tensor] = []
    gpu: dict[int, Copy] = {}  # source index -> its copy
    overflow, filled = 0, []
    for i, src in enumerate(sources):
        n, offset = nbytes_of(src), offsets[i]
        if lease is None or offset + n > lease.capacity or n == 0:
            overflow += n
            dst = torch.empty(src.shape, dtype=src.dtype)
            staged.append(dst)
            if n and src.is_cuda and cuda is not None:  # after the event, like the rest
                gpu[i] = (src.device.index, dst.data_ptr(), src.data_ptr(), n)
            elif n:
                dst.copy_(src)
            continue
        assert base is not None  # the lease's storage (lease is not None here)
        if i in own_storage:
            dst = set_storage(torch.empty(0, dtype=src.dtype), base[offset : offset + n], 0,
                              src.shape)
        else:
            dst = set_storage(torch.empty(0, dtype=src.dtype), base,
                              offset // src.element_size(), src.shape)
        staged.append(dst)
        filled.append((offset, n))
        addr = lease.addr + offset
        if src.is_cuda and cuda is not None:
            gpu[i] = (src.device.index, addr, src.data_ptr(), n)
        elif n < MEMMOVE_BYTES and src.device.type == "cpu" and src.is_contiguous():
            ctypes.memmove(addr, src.data_ptr(), n)
        else:
            dst.copy_(src)
    if lease is not None:
        _zero_gaps(lease, filled)
    copies = None
    if gpu:
        assert cuda is not None  # gpu holds only copies made with cuda
        copies = cuda.issue(list(gpu.values()), "d2h", after=ready, issued=issued,
                            checksums=list(gpu) if hashed else None)
    return staged, overflow, copies


def _zero_gaps(lease: Lease, filled: list[tuple[int, int]]) -> None:
    """Zero what no copy fills, up to the lease's capacity (padding, tail): no stale bytes."""
    cursor = 0
    for offset, n in sorted(filled):
        if offset > cursor:
            ctypes.memset(lease.addr + cursor, 0, offset - cursor)
        cursor = max(cursor, offset + n)
    if lease.capacity > cursor:
        ctypes.memset(lease.addr + cursor, 0, lease.capacity - cursor)
