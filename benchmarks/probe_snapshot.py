"""Probe: where a snapshot's time goes while training runs (torch.profiler / CUPTI trace).

Runs bench_training.py's model and, under the profiler, a few steps with a checkpoint every
``--every`` steps through (a) a CheckpointManager (memory-tier slots) and (b) a kept
DataStatesWriter (the engine's arena), each with the optimizer guard; then the same saves on an
idle GPU. From the trace, per save: the call -> copy issued (staging thread's Python), issued ->
first GPU byte (waiting for the caller's event), the GPU span of the D2H copies and its GiB/s,
the share of that span with kernels running, and the guard's wait.

    python benchmarks/probe_snapshot.py [--every 3] [--steps 9]
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

import bench_training as bt
import torch
import torch.distributed.checkpoint as dcp
from harness.states import state_bytes
from harness.timing import sync
from torch.profiler import ProfilerActivity, profile, record_function

from dcp_datastates import CheckpointManager, DataStatesWriter, Engine, guard

MEM = Path("/dev/shm/probe_snapshot")
CALLS: list[float] = []  # perf_counter of each save call (a probe: module state is fine here)


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--dir", default="/tmp/probe_snapshot")
    ap.add_argument("--trace-dir", default="/tmp/probe_traces")
    ap.add_argument("--no-idle", action="store_true")
    a = ap.parse_args()
    a.layers, a.dim, a.heads, a.vocab, a.seq, a.batch = 20, 2048, 16, 32000, 1024, 16
    return a


def timed_loop(tr: bt.Trainer, a: argparse.Namespace, save, waits: list) -> list[float]:
    """Steps as bench_training times them; ``save(step)`` every ``a.every`` steps."""
    steps = []
    for s in range(1, a.steps + 1):
        sync()
        t0 = time.perf_counter()
        tr.step()
        if s % a.every == 0:
            CALLS.append(time.perf_counter())
            with record_function("probe_save"):
                save(s)
        sync()
        steps.append(time.perf_counter() - t0)
    return steps


def guard_timer(opt: torch.optim.Optimizer, target) -> tuple[list, list]:
    """guard() between two hooks that time its wait."""
    mark, waits = [0.0], []
    hooks = [opt.register_step_pre_hook(lambda *_: mark.__setitem__(0, time.perf_counter())),
             guard(opt, target),
             opt.register_step_pre_hook(lambda *_: waits.append(time.perf_counter() - mark[0]))]
    return hooks, waits


def analyse(trace: Path) -> list[dict]:
    """Per probe_save annotation: the D2H copies that follow it, and the kernels beside them."""
    ev = json.loads(trace.read_text())["traceEvents"]
    saves = sorted(e["ts"] for e in ev if e.get("name") == "probe_save" and e.get("ph") == "X"
                   and e.get("cat") == "user_annotation")
    d2h = sorted((e for e in ev if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")),
                 key=lambda e: e["ts"])
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel")
    issues = sorted(e["ts"] for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and "Memcpy" in e.get("name", "") and "Async" in e.get("name", ""))
    out = []
    for i, t in enumerate(saves):
        end = saves[i + 1] if i + 1 < len(saves) else float("inf")
        mine = [e for e in d2h if t <= e["ts"] < end and e.get("args", {}).get("bytes", 0) > 0]
        if not mine:
            continue
        lo, hi = mine[0]["ts"], max(e["ts"] + e["dur"] for e in mine)
        nbytes = sum(e["args"]["bytes"] for e in mine)
        busy = sum(max(0, min(k1, hi) - max(k0, lo)) for k0, k1 in kernels if k1 > lo and k0 < hi)
        issued = next((x for x in issues if x >= t), None)
        out.append({"call_to_gpu_ms": (lo - t) / 1e3,
                    "call_to_issue_ms": None if issued is None else (issued - t) / 1e3,
                    "issue_to_gpu_ms": None if issued is None else (lo - issued) / 1e3,
                    "gpu_span_ms": (hi - lo) / 1e3, "copies": len(mine),
                    "copy_sum_ms": sum(e["dur"] for e in mine) / 1e3,
                    "gib": nbytes / 2**30, "gib_s": nbytes / 2**30 / ((hi - lo) / 1e6),
                    "kernel_busy_share": busy / max(1, hi - lo),
                    "streams": sorted({e.get("args", {}).get("stream") for e in mine})})
    return out


def run(name: str, tr: bt.Trainer, a: argparse.Namespace, save, target, res: dict) -> None:
    hooks, waits = guard_timer(tr.opt, target)
    try:
        for _ in range(2):
            tr.step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            steps = timed_loop(tr, a, save, waits)
        trace = Path(a.trace_dir) / f"{name}.json"
        prof.export_chrome_trace(str(trace))
        res[name] = {"step_ms": [s * 1e3 for s in steps],
                     "guard_wait_ms": [w * 1e3 for w in waits if w > 1e-3],
                     "saves": analyse(trace)}
    finally:
        for h in hooks:
            h.remove()


def idle(name: str, tr: bt.Trainer, a: argparse.Namespace, save_and_wait, res: dict) -> None:
    out = []
    for s in range(3):
        sync()
        t0 = time.perf_counter()
        save_and_wait(s)
        out.append((time.perf_counter() - t0) * 1e3)
    res[name] = {"snapshot_ms": out}


WATCH = {"_stage", "place_sources", "offsets_of", "_target_lease", "lease", "hold", "copy_into",
         "_zero_gaps", "copy", "rebuild", "deliver", "_staged", "record_current", "stage",
         "_upload", "save", "write_data_file", "commit", "after_commit", "wait_for_staging"}


def timeline(events: list) -> None:
    """Record calls and returns of the functions in WATCH on threads started from now on."""
    def prof(frame, event, arg):
        if event in ("call", "return") and frame.f_code.co_name in WATCH:
            events.append((time.perf_counter(), threading.current_thread().name[:28],
                           frame.f_code.co_name, event))
    threading.setprofile(prof)


def main() -> None:
    a = args()
    events: list = []
    timeline(events)
    Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    tr = bt.Trainer(a, "cuda")
    tr.step()
    sync()
    state = tr.state(0)
    nbytes = state_bytes(state)
    print(f"state {nbytes / 2**30:.2f} GiB, {len(list(_tensors(state)))} tensors", flush=True)
    engine = Engine(host_cache_size=nbytes + (512 << 20))
    engine.reserve(nbytes).release()
    shutil.rmtree(MEM, ignore_errors=True)
    manager = CheckpointManager(Path(a.dir) / "durable", memory_dir=MEM, keep_memory=2,
                                persist=None, engine=engine)
    manager.prepare(state, wait=True)
    writer = DataStatesWriter(engine=engine, overwrite=True)
    res: dict = {}
    try:
        def tier_save(s: int):
            state["step"] = s
            return manager.save(s, state)

        last = []

        def writer_save(s: int):
            if last:  # the previous flush first (to tmpfs), as bench_training waits for it
                last.pop().upload_completion.result()
            state["step"] = s
            last.append(dcp.async_save(state, checkpoint_id=MEM / f"w{s % 2}",
                                       storage_writer=writer, no_dist=True))
            return last[-1]

        t_base = time.perf_counter()
        del events[:]
        run("tiers_training", tr, a, tier_save, manager, res)
        res["tiers_timeline"] = [(round((t - t_base) * 1e3, 2), n, f, e) for t, n, f, e in events]
        res["tiers_calls"] = [round((t - t_base) * 1e3, 2) for t in CALLS]
        manager.wait()
        run("writer_training", tr, a, writer_save, writer, res)
        last.pop().upload_completion.result()
        if not a.no_idle:
            idle("tiers_idle", tr, a, lambda s: (tier_save(s).staged.result(), manager.wait()),
                 res)
            idle("writer_idle", tr, a, lambda s: writer_save(s).staging_completion.result(), res)
        res["tiers_history"] = [{"snapshot_s": f.snapshot_s, "memory_s": f.memory_s,
                                 "blocked_s": f.blocked_s} for f in manager.history]
    finally:
        manager.close()
        engine.close()
        shutil.rmtree(MEM, ignore_errors=True)
        shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps(res, indent=1, default=str), flush=True)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _tensors(v)


if __name__ == "__main__":
    main()
