"""First-save stall (issue 17, point 4): how long the first ``dcp.async_save`` of a process
holds the training thread up, and the 2nd and 3rd saves for comparison.

A fresh process (nothing of dcp_datastates made before the first save), a bf16 state of
``--gib`` GiB on the GPU (square ``--dim`` tensors, the parameters of an SGD optimizer with
``dcp_datastates.guard`` on it), and a loop of ``--matmuls`` matmuls plus the optimizer step,
each step ended by ``torch.cuda.synchronize()``. A save is the DCP idiom: a fresh default
``DataStatesWriter()`` (the process's default engine) per ``dcp.async_save``. Per save, over
the window from the call until the save is durable:

- ``call_s``: the time ``dcp.async_save`` took to return;
- ``stall_s``: the longest step less the median step without checkpoints (goal <= 10 ms);
- ``guard_s``: the longest ``optimizer.step()`` call less its median without checkpoints;
- ``gap_s``: the longest time a sampler thread (polling every 1 ms) saw the main thread make no
  progress, less the longest such time without checkpoints.

    python benchmarks/bench_first_save.py               # 8 GiB on the GPU, 3 saves
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
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter, guard

GOAL_S = 0.010
OUT = Path(__file__).resolve().parent / "out" / "bench_first_save.json"


class Sampler(threading.Thread):
    """Polls every 1 ms whether the main thread made progress; keeps the longest time it did
    not since the last :meth:`take`."""

    def __init__(self) -> None:
        super().__init__(name="sampler", daemon=True)
        self.progress = 0
        self._lock = threading.Lock()
        self._longest = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        seen, since = self.progress, time.perf_counter()
        while not self._done.wait(0.001):
            now = time.perf_counter()
            if self.progress != seen:
                seen, since = self.progress, now
            with self._lock:
                self._longest = max(self._longest, now - since)

    def take(self) -> float:
        with self._lock:
            longest, self._longest = self._longest, 0.0
        return longest

    def stop(self) -> None:
        self._done.set()
        self.join()


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
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.sampler.progress += 1
        return time.perf_counter() - t0, t2 - t1


def baseline(loop: Loop, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        loop.step()
    loop.sampler.take()
    times = [loop.step() for _ in range(steps)]
    return {"median_step_s": statistics.median(t for t, _ in times),
            "median_opt_s": statistics.median(o for _, o in times),
            "longest_step_s": max(t for t, _ in times), "longest_gap_s": loop.sampler.take()}


def one_save(loop: Loop, k: int, folder: Path, base: dict, args: argparse.Namespace) -> dict:
    """Save ``k`` with a fresh default writer; step until it is durable; its figures."""
    loop.sampler.take()
    writer = DataStatesWriter()
    t0 = time.perf_counter()
    resp = dcp.async_save(loop.state(k), checkpoint_id=folder / f"save{k}",
                          storage_writer=writer, no_dist=True)
    call_s = time.perf_counter() - t0
    loop.sampler.progress += 1
    times, staged_at = [], None
    while len(times) < args.min_steps or not resp.upload_completion.done():
        times.append(loop.step())
        if staged_at is None and resp.staging_completion.done():
            staged_at = len(times)
        if len(times) >= args.max_steps:
            break
    resp.upload_completion.result()
    gap = loop.sampler.take()
    shutil.rmtree(folder / f"save{k}", ignore_errors=True)
    stats = writer.last_stats()
    longest = max(t for t, _ in times)
    return {
        "save": k, "call_s": call_s,
        "stall_s": max(0.0, longest - base["median_step_s"]),
        "guard_s": max(0.0, max(o for _, o in times) - base["median_opt_s"]),
        "gap_s": max(0.0, gap - base["longest_gap_s"]),
        "longest_step_s": longest, "steps": len(times), "staged_after_steps": staged_at,
        "stats": {k: v for k, v in dataclasses.asdict(stats).items() if k != "start"}
        if stats else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--matmuls", type=int, default=4)
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
        guard(loop.opt)  # the process's engine of the moment (none yet)
        saves = [one_save(loop, k, folder, base, args) for k in range(1, args.saves + 1)]
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
        durable = (s["stats"] or {}).get("durable_s")
        print(f"{s['save']:>4} {s['call_s'] * 1e3:8.1f} {s['stall_s'] * 1e3:9.1f} "
              f"{s['guard_s'] * 1e3:9.1f} {s['gap_s'] * 1e3:7.1f} {s['steps']:>6} "
              f"{s['staged_after_steps']!s:>8} {durable or float('nan'):10.2f}")
    first = saves[0] if saves else None
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
