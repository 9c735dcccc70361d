"""First-save stall: how long the first save of a process holds the
training thread up, and the 2nd and 3rd saves for comparison.

A fresh process (nothing of dcp_datastates made before the first save), a bf16 state of
``--gib`` GiB on the GPU (square ``--dim`` tensors, the parameters of an SGD optimizer with
``dcp_datastates.guard`` on it), and a loop of ``--matmuls`` matmuls plus the optimizer step,
each step ended by a synchronization of the training's stream (as ``loss.item()`` does; not
of the checkpoint's side stream). ``--api dcp``: the DCP idiom, a fresh default
``DataStatesWriter()`` (the process's default engine) per ``dcp.async_save``; ``--api
manager``: one ``CheckpointManager`` (memory tier, slots prepared in the background once the
baseline is measured). Per save, over the window from the call until the save is committed:

- ``call_s``: the time the save call took to return;
- ``stall_s``: the longest step less the median step without checkpoints (goal <= 10 ms);
- ``guard_s``: the longest ``optimizer.step()`` call less its median without checkpoints;
- ``gap_s``: the longest time a sampler thread (polling every 1 ms) saw the main thread make no
  progress outside its waits for the GPU, less the longest such time without checkpoints, and
  ``gap_where``: every thread's innermost frames at that time.

    python benchmarks/bench_first_save.py               # 8 GiB on the GPU, 3 saves
    python benchmarks/bench_first_save.py --api manager
    python benchmarks/bench_first_save.py --cpu-smoke   # tiny, on CPU: checks the code paths

JSON to ``benchmarks/out/bench_first_save.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import CheckpointManager, DataStatesWriter, guard

GOAL_S = 0.010
OUT = Path(__file__).resolve().parent / "out" / "bench_first_save.json"


class Sampler(threading.Thread):
    """Polls every 1 ms whether the main thread made progress outside its waits for the GPU
    (``waiting``); keeps the longest time it did not since the last :meth:`take`, and where
    the main thread and the other threads were then (their innermost frames)."""

    def __init__(self) -> None:
        super().__init__(name="sampler", daemon=True)
        self.progress = 0
        self.waiting = False
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._longest, self._where = 0.0, {}
        self._done = threading.Event()

    def run(self) -> None:
        seen, since = self.progress, time.perf_counter()
        while not self._done.wait(0.001):
            now = time.perf_counter()
            if self.progress != seen or self.waiting:
                seen, since = self.progress, now
            if now - since > max(self._longest, 0.005):
                where = frames()
                with self._lock:
                    self._longest, self._where = now - since, where

    def take(self) -> tuple[float, dict]:
        with self._lock:
            taken = self._longest, self._where
            self._longest, self._where = 0.0, {}
        return taken

    def stop(self) -> None:
        self._done.set()
        self.join()


def frames() -> dict[str, list[str]]:
    """Each thread's three innermost frames (file:line function), by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        if name == "sampler":
            continue
        out[name] = [f"{Path(f.f_code.co_filename).name}:{n} {f.f_code.co_name}"
                     for f, n in traceback.walk_stack(frame)][:3]
    return out


class Loop:
    """The training loop: matmuls, then the (guarded) optimizer step, then a sync."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        count = max(1, int(args.gib * 2**30) // (args.dim * args.dim * 2))
        self.params = [torch.nn.Parameter(torch.randn(args.dim, args.dim, device=device)
                                          .bfloat16()) for _ in range(count)]
        grad = torch.full((args.dim, args.dim), 1e-3, device=device, dtype=torch.bfloat16)
        for p in self.params:
            p.grad = grad  # one shared gradient: the step still writes every parameter
        self.opt = torch.optim.SGD(self.params, lr=1e-3)
        self.x = torch.randn(args.dim, args.dim, device=device).bfloat16()
        self.matmuls = args.matmuls
        self.sampler = Sampler()

    def state(self, step: int) -> dict:
        return {**{f"w{i}": p for i, p in enumerate(self.params)}, "step": step}

    def state_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def step(self) -> tuple[float, float]:
        """One step: (its seconds, the optimizer.step() call's seconds)."""
        t0 = time.perf_counter()
        y = self.x
        for _ in range(self.matmuls):
            y = self.x @ y
        self.sampler.progress += 1
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.sampler.progress += 1
        if self.device.type == "cuda":  # as loss.item() does: not the side streams
            self.sampler.waiting = True
            torch.cuda.current_stream().synchronize()
            self.sampler.waiting = False
        self.sampler.progress += 1
        return time.perf_counter() - t0, t2 - t1


def baseline(loop: Loop, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        loop.step()
    loop.sampler.take()
    times = [loop.step() for _ in range(steps)]
    return {"median_step_s": statistics.median(t for t, _ in times),
            "median_opt_s": statistics.median(o for _, o in times),
            "longest_step_s": max(t for t, _ in times), "longest_gap_s": loop.sampler.take()[0]}


class Saver:
    """Saves as a user does: the DCP idiom (a fresh default ``DataStatesWriter`` per
    ``dcp.async_save``) or one ``CheckpointManager`` (memory tier only), made once the
    baseline is measured, with ``guard`` on the optimizer."""

    def __init__(self, api: str, folder: Path, loop: Loop) -> None:
        self.api, self.folder, self.manager, self.writer = api, folder, None, None
        t0 = time.perf_counter()
        if api == "manager":
            self.manager = CheckpointManager(memory_dir=folder / "memory", keep_memory=1,
                                             persist=None)
            self.manager.prepare(loop.state(0))  # in the background, as a user does at setup
            guard(loop.opt, self.manager)
        else:
            guard(loop.opt)  # the process's engine of the moment (none yet)
        self.setup_s = time.perf_counter() - t0

    def save(self, k: int, state: dict) -> tuple[Future, Future]:
        """Start save ``k``: (its staged, its committed) futures."""
        if self.manager is not None:
            handle = self.manager.save(k, state)
            return handle.staged, handle.committed
        self.writer = DataStatesWriter()
        resp = dcp.async_save(state, checkpoint_id=self.folder / f"save{k}",
                              storage_writer=self.writer, no_dist=True)
        return resp.staging_completion, resp.upload_completion

    def stats(self) -> dict | None:
        if self.manager is not None:
            return dataclasses.asdict(self.manager.history[-1]) if self.manager.history else None
        stats = self.writer.last_stats()
        return {k: v for k, v in dataclasses.asdict(stats).items() if k != "start"} \
            if stats else None

    def close(self, k: int) -> None:
        if self.manager is None:
            shutil.rmtree(self.folder / f"save{k}", ignore_errors=True)


def one_save(loop: Loop, saver: Saver, k: int, base: dict, args: argparse.Namespace) -> dict:
    """Save ``k``; step until it is committed; its figures."""
    loop.sampler.take()
    t0 = time.perf_counter()
    staged, done = saver.save(k, loop.state(k))
    call_s = time.perf_counter() - t0
    loop.sampler.progress += 1
    times, staged_at = [], None
    while len(times) < args.min_steps or not done.done():
        times.append(loop.step())
        if staged_at is None and staged.done():
            staged_at = len(times)
        if len(times) >= args.max_steps:
            break
    done.result()
    gap, where = loop.sampler.take()
    saver.close(k)
    longest = max(t for t, _ in times)
    return {
        "save": k, "call_s": call_s,
        "stall_s": max(0.0, longest - base["median_step_s"]),
        "guard_s": max(0.0, max(o for _, o in times) - base["median_opt_s"]),
        "gap_s": max(0.0, gap - base["longest_gap_s"]), "gap_where": where,
        "longest_step_s": longest, "slowest_step": times.index(max(times)) + 1,
        "steps": len(times), "staged_after_steps": staged_at, "stats": saver.stats(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--api", choices=["dcp", "manager"], default="dcp",
                   help="dcp: dcp.async_save with a fresh DataStatesWriter per save; manager: "
                        "one CheckpointManager (memory tier)")
    p.add_argument("--matmuls", type=int, default=120,
                   help="matmuls per step (120: ~0.2 s on an H100, longer than the snapshot)")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--base-steps", type=int, default=30)
    p.add_argument("--min-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temp)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny state on CPU")
    args = p.parse_args()
    if args.cpu_smoke:
        args.gib, args.dim, args.matmuls, args.base_steps = 1 / 64, 256, 2, 10
    logging.basicConfig(format="%(relativeCreated)9.0f ms  %(message)s")
    logging.getLogger("dcp_datastates").setLevel(logging.INFO)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    loop = Loop(args, device)
    loop.sampler.start()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench_first_save."))
    try:
        base = baseline(loop, args.warmup, args.base_steps)
        saver = Saver(args.api, folder, loop)
        saves = [one_save(loop, saver, k, base, args) for k in range(1, args.saves + 1)]
        if saver.manager is not None:
            saver.manager.close()
    finally:
        loop.sampler.stop()
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    report(args, device, loop.state_bytes(), base, saves)


def report(args: argparse.Namespace, device: torch.device, nbytes: int, base: dict,
           saves: list[dict]) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, state {nbytes / 2**30:.2f} GiB bf16, "
          f"median step {base['median_step_s'] * 1e3:.1f} ms (longest "
          f"{base['longest_step_s'] * 1e3:.1f} ms, sampler gap "
          f"{base['longest_gap_s'] * 1e3:.1f} ms) without checkpoints")
    print(f"{'save':>4} {'call ms':>8} {'stall ms':>9} {'guard ms':>9} {'gap ms':>7} "
          f"{'steps':>6} {'staged@':>8} {'durable s':>10}")
    for s in saves:
        stats = s["stats"] or {}
        durable = stats.get("durable_s", stats.get("memory_s"))
        print(f"{s['save']:>4} {s['call_s'] * 1e3:8.1f} {s['stall_s'] * 1e3:9.1f} "
              f"{s['guard_s'] * 1e3:9.1f} {s['gap_s'] * 1e3:7.1f} {s['steps']:>6} "
              f"{s['staged_after_steps']!s:>8} {durable or float('nan'):10.2f}")
    first = saves[0] if saves else None
    if first and first["gap_where"]:
        print("first save's longest gap: " + "; ".join(
            f"{name}: {' < '.join(where)}" for name, where in first["gap_where"].items()))
    ok = first is not None and max(first["call_s"], first["stall_s"]) <= GOAL_S
    print(f"first save: call {first['call_s'] * 1e3:.1f} ms, stall "
          f"{first['stall_s'] * 1e3:.1f} ms: {'within' if ok else 'OVER'} the goal of "
          f"{GOAL_S * 1e3:.0f} ms" if first else "no save")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": name, "torch": torch.__version__, "state_bytes": nbytes,
        "args": {k: str(v) for k, v in vars(args).items()}, "goal_s": GOAL_S,
        "baseline": base, "saves": saves, "first_within_goal": ok}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
