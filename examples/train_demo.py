"""Train a small model on CPU with async checkpoints through dcp_datastates, then resume and verify.

Every ``--every`` steps the model and AdamW state go to ``dcp.async_save`` with a fresh
``DataStatesWriter()`` (DCP's idiom: a writer per save costs nothing; the host cache, streams and
I/O live in the process's engine): the call returns at once, the snapshot runs in the
background, and ``guard(optimizer)`` makes the loop wait only before ``optimizer.step()`` (the
first point that changes what is being saved), and only if the snapshot is still running. At the
end a fresh model and optimizer load the last checkpoint with ``DataStatesReader()``; the demo
checks every tensor is bit-identical to the state at that step and that training continues
exactly as the original run did.

Then the same training with a ``CheckpointManager``: a checkpoint every ``--tier-every`` steps
into node memory (``/dev/shm``), persisted to disk in the background whenever the previous
persist is over; a new manager (as after a crash) restores the newest step from memory.
"""

from __future__ import annotations

import argparse
import copy
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dcp_datastates import CheckpointManager, DataStatesReader, DataStatesWriter, guard


class TinyLM(nn.Module):
    """A two-layer transformer language model, small enough to train on a laptop CPU."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def make_run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 512, (8, 33), generator=gen)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    opt.zero_grad()
    loss.backward()
    opt.step()  # with guard(opt): waits here for a snapshot still copying, only then
    return loss.item()


def app_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--tier-every", type=int, default=2, help="memory-tier checkpoints")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint root (default: temp)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.dir or Path(tempfile.mkdtemp(prefix="dcp_datastates_demo_"))
    # DCP is made for process groups: one process is a world of one rank (gloo), which is also
    # what async_save's upload thread expects (no_dist=True works too, with a warning per call).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run(args, root)
        run_tiers(args, root)
    finally:
        dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(root)


def run(args: argparse.Namespace, root: Path) -> None:

    model, opt = make_run()
    handle = guard(opt)  # optimizer.step() waits for the snapshots of the process's engine
    pending = None
    expected: dict = {}
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = train_step(model, opt, step)
        if step % args.every == 0:
            if pending is not None:
                pending.upload_completion.result()  # one checkpoint in flight at a time
            state = app_state(model, opt, step)
            expected = copy.deepcopy(state)
            t = time.perf_counter()
            pending = dcp.async_save(state, checkpoint_id=root / f"step_{step}",
                                     storage_writer=DataStatesWriter(overwrite=True))
            print(f"step {step:3d} loss {loss:.4f}  async_save returned in "
                  f"{(time.perf_counter() - t) * 1e3:.1f} ms")
    pending.upload_completion.result()
    handle.remove()
    last = root / f"step_{args.steps // args.every * args.every}"
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s; resuming from {last}")

    continued = [train_step(model, opt, s) for s in range(args.steps + 1, args.steps + 4)]

    model2, opt2 = make_run(seed=123)
    state = app_state(model2, opt2, 0)
    dcp.load(state, checkpoint_id=last, storage_reader=DataStatesReader())
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    check_equal(app_state(model2, opt2, state["step"]), expected)
    resumed = [train_step(model2, opt2, s) for s in range(args.steps + 1, args.steps + 4)]
    if resumed != continued:
        raise SystemExit(f"FAIL: resumed losses {resumed} != original {continued}")
    print(f"OK: checkpoint {last.name} restored bit-exactly; the next 3 losses match: {resumed}")


def run_tiers(args: argparse.Namespace, root: Path) -> None:
    """Checkpoints every few steps into memory, persisted in the background; restore."""
    memory = Path(tempfile.mkdtemp(prefix="dcp_datastates_demo_", dir="/dev/shm"))
    try:
        model, opt = make_run()
        manager = CheckpointManager(root / "tiers", memory_dir=memory, keep_memory=2)
        hook = guard(opt, manager)
        expected: dict = {}
        for step in range(1, args.steps + 1):
            train_step(model, opt, step)
            if step % args.tier_every == 0:
                state = app_state(model, opt, step)
                expected = copy.deepcopy(state)
                manager.save(step, state)
        manager.close()  # waits, and persists the newest step if the disk lacks it
        hook.remove()
        figures = manager.history
        persisted = [f.step for f in figures if f.persist_s is not None]
        print(f"tiers: {len(figures)} checkpoints into memory, steps {persisted} persisted "
              f"while training ran; memory keeps "
              f"{sorted(p.name for p in memory.glob('step_*'))}")
        model2, opt2 = make_run(seed=123)
        state = app_state(model2, opt2, 0)
        again = CheckpointManager(root / "tiers", memory_dir=memory)  # a restarted process
        step = again.load(state)
        again.close()
        check_equal(state, expected)
        print(f"OK: step {step} restored bit-exactly from the memory tier")
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def check_equal(got: object, want: object, where: str = "state") -> None:
    """Raise unless ``got`` equals ``want`` exactly (tensors bit for bit)."""
    if isinstance(want, torch.Tensor):
        ok = got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
        if not ok:
            raise SystemExit(f"FAIL: {where} differs after restore")
    elif isinstance(want, dict):
        if set(got) != set(want):
            raise SystemExit(f"FAIL: {where} keys differ: {sorted(got)} vs {sorted(want)}")
        for k in want:
            check_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            check_equal(g, w, f"{where}[{i}]")
    elif got != want:
        raise SystemExit(f"FAIL: {where}: {got!r} != {want!r}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


if __name__ == "__main__":
    main()
