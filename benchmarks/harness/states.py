"""States to checkpoint, and blank / poison / verify of the state a load fills."""

from __future__ import annotations

import copy
import ctypes

import torch
from torch.distributed.tensor import DTensor

HIDDEN = 4096
MOMENTS = ("exp_avg", "exp_avg_sq")


def leaves(obj: object, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted name, value) of every leaf of nested dicts and lists; DTensors as local shards."""
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in leaves(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in leaves(v, f"{prefix}{i}.")]
    return [(prefix[:-1], obj.to_local() if isinstance(obj, DTensor) else obj)]


def tensors(obj: object) -> list[torch.Tensor]:
    return [v for _, v in leaves(obj) if isinstance(v, torch.Tensor)]


def state_bytes(obj: object) -> int:
    return sum(t.nbytes for t in tensors(obj))


def model_state(total: int, device: str = "cpu", *, layers: int, moments: int = 0,
                small: int = 64, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A seeded random model + optimizer look-alike of about ``total`` bytes on ``device``.

    ``layers`` [rows, 4096] ``dtype`` weights holding the bulk of the bytes, each with
    ``moments`` (0-2) fp32 moments of its shape; ``small`` blocks of a bf16 bias and an fp32
    norm, whose optimizer entries hold two fp32 moments and a 0-d step; an int ``step``.
    """
    model: dict = {}
    optim: dict = {}
    for i in range(small):
        model[f"blocks.{i}.bias"] = torch.empty(HIDDEN, dtype=torch.bfloat16, device=device)
        model[f"blocks.{i}.norm.weight"] = torch.empty(HIDDEN, device=device)
        optim[f"blocks.{i}.bias"] = {**{m: torch.empty(HIDDEN, device=device) for m in MOMENTS},
                                     "step": torch.empty((), device=device)}
    per_row = layers * HIDDEN * (dtype.itemsize + 4 * moments)
    rows = (total - state_bytes(model) - state_bytes(optim)) // per_row
    if rows < 1:
        raise SystemExit(f"{total} bytes is too small for {layers} layers and {small} blocks")
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.empty(rows, HIDDEN, dtype=dtype, device=device)
        if moments:
            optim[f"layers.{i}.weight"] = {m: torch.empty(rows, HIDDEN, device=device)
                                           for m in MOMENTS[:moments]}
    state = {"model": model, **({"optim": {"state": optim}} if optim else {}), "step": 7}
    torch.manual_seed(0)
    for k, t in enumerate(tensors(state)):
        if t.dim() == 0:
            t.fill_(k)
        else:
            t.normal_()
    return state


def tiny_state(n: int) -> dict:
    """``n`` tensors of a few bytes: step counters, norms and biases in turn."""
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for i in range(n):
        kind = i % 3
        out[f"p{i}"] = (torch.tensor(float(i)) if kind == 0 else
                        torch.randn(4, generator=g) if kind == 1 else
                        torch.randint(0, 9, (3,), generator=g, dtype=torch.int64))
    return out


def poison(obj: dict) -> None:
    """Overwrite what a load must restore: tensors with -3, ints with -1 (in place)."""
    for k, v in obj.items():
        if isinstance(v, dict):
            poison(v)
        elif isinstance(v, torch.Tensor):
            v.fill_(-3)
        elif isinstance(v, int):
            obj[k] = -1


def _like(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _like(v) for k, v in obj.items()}
    return torch.empty_like(obj) if isinstance(obj, torch.Tensor) else obj


def blank(state: dict) -> dict:
    """A poisoned copy of ``state``'s structure to load into (every page faulted in once)."""
    out = _like(state)
    poison(out)
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8).to(a.device))
    return a == b


def host_copy(obj: object) -> dict[str, object]:
    """``obj``'s leaves by dotted name (what :func:`differs` compares), tensors (DTensors: their
    local shards) copied into host memory, other values copied."""
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in leaves(obj)}


def differs(src: object, dst: object) -> list[str]:
    """Names of the entries of ``dst`` that are not ``src``'s, bit for bit."""
    a, b = leaves(src), leaves(dst)
    if [k for k, _ in a] != [k for k, _ in b]:
        return ["<structure>"]
    return [k for (k, x), (_, y) in zip(a, b, strict=True) if not _same(x, y)]


def verify(src: object, dst: object, what: str) -> None:
    bad = differs(src, dst)
    if bad:
        raise RuntimeError(f"{what}: loaded state differs in {len(bad)} entries, e.g. {bad[:3]}")


def byte_views(obj: object, nbytes: int | None = None) -> list[memoryview]:
    """Byte views of ``obj``'s CPU tensors, largest first, ``nbytes`` in all (default: all).

    The views do not keep the tensors alive.
    """
    out, left = [], state_bytes(obj) if nbytes is None else nbytes
    for t in sorted(tensors(obj), key=lambda t: -t.nbytes):
        n = min(t.nbytes, left)
        if n <= 0:
            break
        out.append(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))
        left -= n
    return out
