"""Probe: why some training steps near a memory-tier checkpoint are slow.

Runs bench_training.py's model (6 GiB bf16 state) with a CheckpointManager as bench_training's
``tiers`` mode sets it up, in variants, and records per step: the step's wall time, the time the
training thread took to issue it (forward/backward, the guard's wait, ``optimizer.step``, the
save call), the GPU time of its compute (CUDA events on the compute stream), how late a thread
sleeping 1 ms woke up (GIL and CPU contention), where the training thread was (its Python frame,
sampled every 2 ms), and which checkpoint phases ran meanwhile (snapshot, commit, persist).

    python benchmarks/probe_steps.py [--variants base,nopersist,nice,stream] [--steps 30]

Variants: ``base`` (bench_training's tiers: every 10 steps, persist "idle", device-wide sync
per step); ``nopersist`` (persist=None); ``nice`` (the library's threads reniced to 19);
``hash4``/``hash8`` (4/8 hash threads); ``stream`` (steps synced on the compute stream only, as
``loss.item()`` does); ``every1`` (a save every step); ``budget`` (a save every step,
``max_overhead=0.05``, the budget's account printed per step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench_training as bt
import torch
from harness.states import state_bytes

from dcp_datastates import CheckpointManager, Engine, guard

MEM = Path("/dev/shm/probe_steps")


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,stream,nopersist,nice,hash4,every1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/probe_steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--stream-sync", action="store_true",
                    help="every variant syncs the compute stream only (as loss.item() does)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once set up")
    a = ap.parse_args()
    a.layers, a.dim, a.heads, a.vocab, a.seq, a.batch = 20, 2048, 16, 32000, 1024, 16
    a.fp32 = False
    if a.cpu_smoke:
        a.layers, a.dim, a.heads, a.vocab, a.seq, a.batch = 2, 64, 4, 128, 16, 2
    return a


class Sampler:
    """A thread waking every ms: its lateness (GIL/CPU contention) and the main thread's frame."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.late: list[tuple[float, float]] = []
        self.frames: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            now = time.perf_counter()
            self.late.append((now, now - t - 0.001))
            n += 1
            if n % 2 == 0:
                frame = sys._current_frames().get(self.main)
                where = []
                while frame is not None and len(where) < 3:
                    where.append(f"{frame.f_code.co_name}@{Path(frame.f_code.co_filename).name}"
                                 f":{frame.f_lineno}")
                    frame = frame.f_back
                self.frames.append((now, " < ".join(where)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> dict:
        late = [x for t, x in self.late if t0 <= t <= t1]
        frames = Counter(f for t, f in self.frames if t0 <= t <= t1)
        return {"late_max_ms": 1e3 * max(late, default=0.0),
                "late_sum_ms": 1e3 * sum(late),
                "frames": frames.most_common(4)}


def renice(value: int) -> None:
    """Renice the library's threads (a probe's hack: no API for it yet)."""
    for t in threading.enumerate():
        if t.name.startswith(("dcp_datastates", "CheckpointManager")) and t.native_id:
            try:
                os.setpriority(os.PRIO_PROCESS, t.native_id, value)
            except OSError:
                pass


def run_variant(tr: bt.Trainer, a: argparse.Namespace, name: str, sampler: Sampler) -> dict:
    cuda = torch.cuda.is_available()
    state = tr.state(0)
    nbytes = state_bytes(state)
    engine = Engine(host_cache_size=nbytes + (512 << 20))
    engine.reserve(nbytes).release()
    if name in ("hash4", "hash8"):
        workers = int(name[4:])
        engine.threads.hash.shutdown()
        engine.threads.hash = ThreadPoolExecutor(workers, thread_name_prefix="dcp_datastates-hash")
        engine.threads.hash_workers = workers
    shutil.rmtree(MEM, ignore_errors=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    manager = CheckpointManager(Path(a.dir) / "durable", memory_dir=MEM, keep_memory=2,
                                keep_durable=2, engine=engine,
                                persist=None if name == "nopersist" else "idle",
                                max_overhead=0.05 if name == "budget" else None)
    manager.prepare(state, wait=True)
    marks: dict[str, float] = {}
    def mark(key: str):
        return lambda *_: marks.__setitem__(key, time.perf_counter())
    pre = tr.opt.register_step_pre_hook(mark("guard0"))
    hook = guard(tr.opt, manager)
    post = tr.opt.register_step_pre_hook(mark("guard1"))
    every = 1 if name in ("every1", "budget") else a.every

    def sync() -> None:
        if not cuda:
            return
        if name == "stream" or a.stream_sync:
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()

    rows, saves = [], []
    try:
        for _ in range(3):
            tr.step()
        sync()
        for s in range(1, (min(a.steps, 20) if name == "every1" else a.steps) + 1):
            budget = manager._budget  # a probe's look inside
            if name == "nice":
                renice(19)
            sync()
            t0 = time.perf_counter()
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            tr.step()
            if cuda:
                e1.record()
            t_step = time.perf_counter()
            if s % every == 0:
                st = tr.state(s)
                t_call = time.perf_counter()
                h = manager.save(s, st)
                saves.append((s, t_call, h))
            t_issued = time.perf_counter()
            sync()
            t1 = time.perf_counter()
            row = {"step": s, "ms": 1e3 * (t1 - t0), "issue_ms": 1e3 * (t_issued - t0),
                   "fwdbwd_issue_ms": 1e3 * (marks["guard0"] - t0),
                   "guard_ms": 1e3 * (marks["guard1"] - marks["guard0"]),
                   "opt_issue_ms": 1e3 * (t_step - marks["guard1"]),
                   "save_call_ms": 1e3 * (t_issued - t_step),
                   "gpu_ms": e0.elapsed_time(e1) if cuda else None, "t0": t0, "t1": t1}
            if budget is not None:
                row["budget"] = (f"expected={budget.account.expected} credit="
                                 f"{budget.account.credit:.3f} open={budget._open is not None} "
                                 f"costs={[round(f.cost_s or 0, 3) for f in manager.history]}"
                                 f" skipped={saves[-1][2].skipped if saves else None}")
            rows.append(row)
        manager.wait()
    finally:
        hook.remove(), pre.remove(), post.remove()
        manager.close()
        engine.close()
        shutil.rmtree(MEM, ignore_errors=True)
        shutil.rmtree(a.dir, ignore_errors=True)
    phases = []
    for s, t_call, h in saves:
        f = h.figures
        for what, dur in (("snapshot", f.snapshot_s), ("memory", f.memory_s)):
            if dur is not None:
                phases.append((what, s, t_call, t_call + dur))
        if f.persist_s is not None and f.memory_s is not None:
            phases.append(("persist", s, t_call + f.memory_s, t_call + f.memory_s + f.persist_s))
    for row in rows:
        row.update(sampler.window(row["t0"], row["t1"]))
        row["active"] = sorted({f"{w}{s}" for w, s, b, e in phases
                                if b < row["t1"] and e > row["t0"]})
    return {"rows": rows, "saves": [{"step": s, "snapshot_s": h.figures.snapshot_s,
                                     "memory_s": h.figures.memory_s,
                                     "persist_s": h.figures.persist_s,
                                     "copy_s": h.figures.copy_s,
                                     "blocked_s": h.figures.blocked_s} for s, _, h in saves]}


def show(name: str, res: dict) -> None:
    rows = res["rows"]
    med = sorted(r["ms"] for r in rows)[len(rows) // 2]
    mean = sum(r["ms"] for r in rows) / len(rows)
    print(f"\n== {name}: median {med:.1f} ms, mean {mean:.1f} ms", flush=True)
    print(" step    ms  issue fwdbwd guard  opt  save  gpu_ms late_max late_sum  active")
    for r in rows:
        gpu = f"{r['gpu_ms']:7.1f}" if r["gpu_ms"] is not None else "      -"
        print(f"{r['step']:5d} {r['ms']:6.1f} {r['issue_ms']:6.1f} {r['fwdbwd_issue_ms']:6.1f}"
              f" {r['guard_ms']:5.1f} {r['opt_issue_ms']:5.1f} {r['save_call_ms']:5.1f} {gpu}"
              f" {r['late_max_ms']:8.1f} {r['late_sum_ms']:8.1f}  {','.join(r['active'])}")
        if "budget" in r:
            print("          ", r["budget"][:300])
        if r["ms"] > 1.15 * med:
            for f, n in r["frames"]:
                print(f"          {n:4d} x {f}")
    for s in res["saves"]:
        print("   save", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()})


def main() -> None:
    a = args()
    device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
    tr = bt.Trainer(a, device)
    if a.gc_freeze:
        tr.step()  # the optimizer's state
        gc.freeze()
    sampler = Sampler()
    out = {}
    for name in a.variants.split(","):
        t = time.perf_counter()
        out[name] = run_variant(tr, a, name, sampler)
        show(name, out[name])
        print(f"   ({name} took {time.perf_counter() - t:.1f} s)", flush=True)
    sampler.stop()
    if a.json:
        for res in out.values():
            for r in res["rows"]:
                r["frames"] = [list(x) for x in r["frames"]]
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
