"""Memory commit: what a memory-tier save costs after its snapshot has landed.

A ``CheckpointManager`` (memory tier in /dev/shm, ``persist=None``, slots prepared off the
clock) saves a state shaped like ``bench_training.py``'s (a GPT's bf16 parameters and AdamW
moments, a 0-d step per parameter, the optimizer's param groups) ``--saves`` times, waiting for
each. Per save: ``snapshot_s`` (``save()`` to the snapshot copied) and ``commit_s``
(``memory_s - snapshot_s``: DCP's planning, checksums, header and bytes items, ``.metadata``,
rename, the manager's bookkeeping). Each run is done idle and with a second thread busy
running Python half the time (as a training thread holds the GIL between its CUDA calls).
Full (generation 2) collections of the cyclic GC during the clean saves are counted and timed
(``gc.callbacks``): they stop every thread, training's too, and what a save keeps alive while
it runs brings them sooner. Then ``--traced`` more saves with a profile hook on every thread
break the commit into phases (the hook slows Python code, the planning most: their total is
shown beside the clean one).
Goal: commit <= 0.15 s for 8 GiB on an H100 host.

    python benchmarks/bench_commit.py                # 8 GiB on the GPU (2 GiB on CPU)
    python benchmarks/bench_commit.py --gib 2 --saves 5
"""

from __future__ import annotations

import gc
import shutil
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from bench_training import GPT
from harness.machine import free_bytes, require
from harness.run import Run, log, parser
from harness.states import state_bytes, tensors
from harness.tables import Table
from harness.timing import median, sync
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._sizes import format_size

#: Phases traced: name -> (module, qualified name of the function whose call spans it); a
#: name may be there twice (a function renamed: either is traced, so older trees compare).
WATCHED = [
    ("dcp_save", "dcp_datastates.tiers._local_dcp", "save"),
    ("write_data", "dcp_datastates._jobs.flush", "write_data_file"),
    ("checksum_wait", "dcp_datastates._jobs.flush", "_Sums.result"),
    ("file_finish", "dcp_datastates._io.file_writer", "DataFile.finish"),
    ("commit", "dcp_datastates._jobs.commit", "commit"),
    ("write_metadata", "dcp_datastates._format.metadata_file", "write_metadata"),
    ("after_commit", "dcp_datastates.tiers._memory_save", "MemorySaver.after_commit"),
    ("hash", "dcp_datastates._jobs.flush", "_sum_pieces"),
    ("hash", "dcp_datastates._jobs.flush", "_sum_batch"),
]
#: Phases shown: name -> how it is read from one save's spans (``None``: not traced).
PHASES: dict[str, Callable[[dict, float], float | None]] = {
    "plan (DCP, to write_data)": lambda s, t0: _gap(t0, s, "write_data", "start"),
    "write_data": lambda s, t0: _span(s, "write_data"),
    "  checksum wait": lambda s, t0: _span(s, "checksum_wait"),
    "  file finish": lambda s, t0: _span(s, "file_finish"),
    "DCP between write and commit": lambda s, t0: _between(s, "write_data", "commit"),
    "commit (.metadata, fsync)": lambda s, t0: _span(s, "commit"),
    "  write_metadata": lambda s, t0: _span(s, "write_metadata"),
    "after DCP's commit (manager)": lambda s, t0: _between(s, "commit", "after_commit", 1),
    "hash thread-seconds": lambda s, t0: _span(s, "hash"),
}


def _first(spans: dict, key: str) -> tuple[float, float] | None:
    found = spans.get(key)
    return found[0] if found else None


def _span(spans: dict, key: str) -> float | None:
    found = spans.get(key)
    return sum(b - a for a, b in found) if found else None


def _gap(t0: float, spans: dict, key: str, edge: str) -> float | None:
    found = _first(spans, key)
    return None if found is None else found[0 if edge == "start" else 1] - t0


def _between(spans: dict, a: str, b: str, edge: int = 0) -> float | None:
    """From the end of ``a`` to the start (``edge`` 0) or end (1) of ``b``."""
    first, second = _first(spans, a), _first(spans, b)
    return None if first is None or second is None else second[edge] - first[1]


class Tracer:
    """Spans of the watched functions' calls, on every thread, through the profile hook."""

    def __init__(self) -> None:
        self.codes: dict[object, str] = {}
        for name, module, qualname in WATCHED:
            obj: object = sys.modules.get(module) or __import__(module, fromlist=["_"])
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            code = getattr(obj, "__code__", None)
            if code is not None:
                self.codes[code] = name
        self.events: list[tuple[str, int, str, float]] = []

    def _hook(self, frame, event: str, arg: object) -> None:
        if event in ("call", "return") and frame.f_code in self.codes:
            self.events.append((self.codes[frame.f_code], threading.get_ident(), event,
                                time.perf_counter()))

    @contextmanager
    def on(self) -> Iterator[None]:
        """Hook the calling thread and the threads started meanwhile."""
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    def spans(self, since: float, until: float) -> dict[str, list[tuple[float, float]]]:
        """The spans (start, end) of each phase that ended in ``[since, until]``."""
        open_: dict[tuple[str, int], float] = {}
        out: dict[str, list[tuple[float, float]]] = {}
        for name, thread, event, t in self.events:
            if event == "call":
                open_[name, thread] = t
            elif (start := open_.pop((name, thread), None)) is not None and since <= t <= until:
                out.setdefault(name, []).append((start, t))
        return out


class Sampler(threading.Thread):
    """Every ``PERIOD`` s, where each thread not idle in a pool is (its innermost frames): a
    profile that costs the others only this thread's GIL turns, unlike the profile hook."""

    PERIOD = 0.0005
    DEPTH = 4

    def __init__(self) -> None:
        super().__init__(name="sampler", daemon=True)
        self.samples: list[tuple[float, float, str, str]] = []  # (time, since last, ...)
        self._done = threading.Event()

    def run(self) -> None:
        last = time.perf_counter()
        while not self._done.wait(self.PERIOD):
            now = time.perf_counter()
            dt, last = now - last, now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                stack = _stack(frame)
                if name not in ("sampler", "busy") and not stack.startswith("_worker@"):
                    self.samples.append((now, dt, name.rstrip("_0123456789"), stack))

    def stop(self) -> None:
        self._done.set()
        self.join()

    def window(self, since: float, until: float) -> Counter:
        """Seconds per (thread, stack) in ``[since, until]`` (a sample stands for the time
        since the one before: the sampler waits for the GIL like any thread)."""
        out: Counter = Counter()
        for t, dt, name, stack in self.samples:
            if since <= t <= until:
                out[name, stack] += dt
        return out


def _stack(frame: object) -> str:
    parts = [f"{f.f_code.co_name}@{Path(f.f_code.co_filename).name}:{n}"
             for f, n in traceback.walk_stack(frame)][:Sampler.DEPTH]
    return " < ".join(parts)


class FullCollections:
    """The full (generation 2) collections of the cyclic GC while :meth:`on`'s block runs:
    how many, and the seconds they took."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self._start: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    @contextmanager
    def on(self) -> Iterator[FullCollections]:
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)


# -- the state -----------------------------------------------------------------------------------
def gpt_dim(nbytes: int, layers: int, vocab: int, seq: int) -> int:
    """The model width (a multiple of 64) whose bf16 parameters and two AdamW moments take
    about ``nbytes``: ``6 * (layers * 12 * d**2 + (vocab + seq) * d)``."""
    a, b = 6 * 12 * layers, 6 * (vocab + seq + 4 * layers)
    d = (-b + (b * b + 4 * a * nbytes) ** 0.5) / (2 * a)
    return max(64, int(d) // 64 * 64)


def gpt_state(nbytes: int, device: str, layers: int = 20, vocab: int = 32000,
              seq: int = 1024) -> dict:
    """``bench_training.py``'s state (its GPT in bf16, AdamW moments and 0-d steps as the
    fused optimizer keeps them on a GPU, the param groups, a step), about ``nbytes``, random."""
    dim = gpt_dim(nbytes, layers, vocab, seq)
    with torch.device("meta"):
        model = GPT(vocab, dim, layers, 16, seq)
    model = model.to_empty(device=device).to(torch.bfloat16)
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0, device=device if cuda else "cpu"),
                        "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    torch.manual_seed(0)
    for t in tensors(state):
        t.normal_()
    sync()
    return state


# -- the runs ------------------------------------------------------------------------------------
@contextmanager
def busy_thread(on: bool) -> Iterator[None]:
    """A second thread running Python for as long as the block runs (``on``), as a training
    thread does: about 1 ms of Python, then about 1 ms in a call that lets the GIL go (a
    thread spinning in Python alone makes every GIL hand-off wait 5 ms: no loop does that)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                pass
            stop.wait(0.001)

    thread = threading.Thread(target=spin, name="busy", daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def saves(state: dict, engine: Engine, memory: Path, n: int, tracer: Tracer | None,
          sampler: Sampler | None = None) -> list[dict]:
    """``n`` saves by a fresh manager, each waited for: their figures (and traced phases, or
    sampled stacks over the commit)."""
    shutil.rmtree(memory, ignore_errors=True)
    manager = CheckpointManager(memory / "durable", memory_dir=memory / "tier", persist=None,
                                keep_memory=2, engine=engine)
    out: list[dict] = []
    try:
        manager.prepare(state)
        for step in range(n):
            sync()
            handle = manager.save(step, state)
            staged = {}
            handle.staged.add_done_callback(lambda _f, s=staged: s.setdefault(
                "at", time.perf_counter()))
            manager.wait()
            f = manager.history[-1]
            row = {"snapshot_s": f.snapshot_s, "commit_s": f.memory_s - f.snapshot_s}
            if tracer is not None:
                spans = tracer.spans(staged["at"], time.perf_counter())
                row.update({k: read(spans, staged["at"]) for k, read in PHASES.items()})
            if sampler is not None:
                row["stacks"] = sampler.window(staged["at"], time.perf_counter())
            out.append(row)
    finally:
        manager.close()
        shutil.rmtree(memory, ignore_errors=True)
    return out


def variant(state: dict, memory: Path, args, busy: bool) -> dict:
    """Clean saves, then traced ones (an engine each: its threads are hooked), with or
    without a busy Python thread."""
    with busy_thread(busy):
        with Engine() as engine, FullCollections().on() as full:
            clean = saves(state, engine, memory, args.saves, None)
        traced: list[dict] = []
        if args.sampled:
            sampler = Sampler()
            sampler.start()
            with Engine() as engine:
                sampled = saves(state, engine, memory, args.sampled, None, sampler)
            sampler.stop()
            report_stacks(sampled[1:] or sampled)
        if args.traced:
            tracer = Tracer()
            with tracer.on(), Engine() as engine:
                traced = saves(state, engine, memory, args.traced, tracer)
    res = {"clean": clean, "traced": traced, "gen2": {"count": full.count, "s": full.seconds}}
    res["median"] = {k: median([r[k] for r in clean], skip=1) for k in clean[0]}
    res["traced_median"] = ({k: median([r[k] for r in traced], skip=1) for k in traced[0]}
                            if traced else {})
    log(f"{'busy' if busy else 'idle'}: snapshot {res['median']['snapshot_s']:.3f} s, commit "
        f"{res['median']['commit_s']:.3f} s (medians of {len(clean)}, first left out); "
        f"{full.count} full GCs ({full.seconds:.3f} s) in {len(clean)} saves; commits "
        + " ".join(f"{r['commit_s']:.3f}" for r in clean))
    return res


def report_stacks(rows: list[dict], top: int = 14) -> None:
    """Per thread, its busiest stacks over the commits (mean ms per save)."""
    total: Counter = Counter()
    for row in rows:
        total.update(row["stacks"])
    by_thread: dict[str, Counter] = {}
    for (name, stack), s in total.items():
        by_thread.setdefault(name, Counter())[stack] += s
    log(f"sampled commits ({len(rows)}): " + " ".join(f"{r['commit_s']:.3f}" for r in rows))
    for name, stacks in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
        log(f"  {name}: {sum(stacks.values()) / len(rows) * 1e3:.0f} ms per save")
        for stack, s in stacks.most_common(top):
            log(f"    {s / len(rows) * 1e3:6.1f} ms  {stack}")


def tables(res: dict) -> list[Table]:
    runs = res["runs"]
    t = Table(f"Memory-tier save of {format_size(res['bytes'])} ({res['tensors']} tensors) "
              f"on {res['device']}: medians, seconds",
              [("figure", ""), *[(f"{k}", ".3f") for k in runs],
               *[(f"{k} traced", ".3f") for k in runs]],
              ["commit_s = memory_s - snapshot_s; traced: with a profile hook on every "
               "thread (slows Python code); goal commit <= 0.15 s for 8 GiB (H100 host)"])
    keys = ["snapshot_s", "commit_s", *PHASES]
    for key in keys:
        t.add(key, *[r["median"].get(key) for r in runs.values()],
              *[r["traced_median"].get(key) for r in runs.values()])
    for key, name in (("count", "full GCs (clean saves)"), ("s", "full GCs' seconds")):
        t.add(name, *[r["gen2"][key] for r in runs.values()], *[None for _ in runs])
    return [t]


def main() -> None:
    ap = parser(__doc__)
    cuda = torch.cuda.is_available()
    ap.add_argument("--gib", type=float, default=8.0 if cuda else 2.0, help="state size")
    ap.add_argument("--saves", type=int, default=8, help="clean saves per variant")
    ap.add_argument("--traced", type=int, default=4, help="traced saves per variant (0: none)")
    ap.add_argument("--memory", type=Path, default=Path("/dev/shm/bench_commit"),
                    help="where the memory tier goes (tmpfs)")
    ap.add_argument("--no-busy", action="store_true", help="idle runs only")
    ap.add_argument("--sampled", type=int, default=0,
                    help="saves with every thread's stack sampled every 0.5 ms (0: none)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the state is made")
    args = ap.parse_args()
    device = "cuda" if cuda else "cpu"
    nbytes = int(args.gib * 2**30)
    require(str(args.memory.parent), int(3.2 * nbytes), free_bytes(args.memory.parent),
            "3 slots")
    run = Run("bench_commit", args, [args.memory.parent])
    run.header()
    state = gpt_state(nbytes, device)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    res = run.res
    res.update(device=device, bytes=state_bytes(state), tensors=len(tensors(state)), runs={})
    log(f"state: {format_size(res['bytes'])} in {res['tensors']} tensors on {device}")
    for busy in (False, True)[: 1 if args.no_busy else 2]:
        name = "busy" if busy else "idle"
        out = run.guard(name, variant, state, args.memory, args, busy)
        if out is not None:
            res["runs"][name] = out
    run.finish(tables, None)


if __name__ == "__main__":
    main()
