"""Training-loop overhead of checkpointing: a ~1B-parameter GPT with AdamW in bf16 on one GPU.

Modes (the table ``MODES``), in one process on the same model: ``none`` (no checkpoints; run
first and again last), ``dcp_pinned`` (``dcp.async_save`` + FileSystemWriter + DCP's
DefaultStager with pinned memory, waiting for ``staging_completion`` right before the next
``optimizer.step()``) and ``ours`` (``dcp.async_save`` + DataStatesWriter with
``dcp_datastates.guard`` on the optimizer), and the ``CheckpointManager`` modes: ``tiers``,
``tiers_every_step`` and ``tiers_budget`` (every step, ``max_overhead=0.05``). A checkpoint
of model + optimizer state starts every ``--every`` steps; before starting one, the previous
checkpoint of the same mode must be durable. Every step is timed between synchronizations of
the training's stream (as ``loss.item()`` does; a device-wide ``torch.cuda.synchronize()``
would also wait for checkpoint copies on side streams, which no training loop does). Goal:
ours <= 2% slower than no checkpoint (median step).

    python benchmarks/bench_training.py                 # ~1.07B params, 40 steps per mode
    python benchmarks/bench_training.py --cpu-smoke     # tiny model on CPU: checks the code paths
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from harness.baselines import async_save_pinned, futures
from harness.ceilings import copy_ceiling, disk_ceiling, drop_cache
from harness.machine import free_bytes, require
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.states import state_bytes
from harness.tables import Table, ratio_table
from harness.timing import DoneAt, median, step_sync, sync
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import CheckpointManager, DataStatesReader, DataStatesWriter, Engine, guard
from dcp_datastates.sizes import format_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


# -- model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal SDPA attention and a 4x GELU MLP, no biases."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, LM head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.embed.weight)


# -- training loop -------------------------------------------------------------------------------
class Trainer:
    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args, self.device = args, device
        torch.manual_seed(0)
        with torch.device(device):  # initialise on the GPU: 1B parameters are slow on CPU
            self.model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
        if not args.fp32:
            self.model.to(torch.bfloat16)
        cuda = device == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda or None)
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def step(self, before_step=None) -> None:
        a = self.args
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=self.device)
        with torch.autocast(self.device, torch.bfloat16, enabled=a.fp32 and self.device == "cuda"):
            logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if before_step is not None:
            before_step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self, step: int) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": step}


# -- modes ---------------------------------------------------------------------------------------
Save = Callable[[dict, Path], object]  # (state, path) -> what dcp.async_save returned


@dataclass(frozen=True)
class Mode:
    """One way to checkpoint during training.

    ``saver(trainer, path, setup, rec)`` is a context manager: it builds what the mode needs
    (off the clock; one-time seconds go in ``setup``), yields a ``Save`` that starts one
    checkpoint, and adds its own figures to ``rec`` when the mode is done. None: no checkpoints.
    ``reuse_state``: build the state dict once and save it again at each checkpoint (its
    tensors are the live parameters and optimizer states, updated in place), so an every-step
    mode does not time ``get_state_dict`` at every step.
    """

    label: str
    saver: Callable[[Trainer, Path, dict, dict], AbstractContextManager[Save]] | None = None
    snapshot_before_step: bool = False  # wait for the snapshot right before optimizer.step()
    every: int | None = None  # checkpoint interval of its own (None: --every)
    wait_previous: bool = True  # the previous checkpoint must be done before the next starts
    reuse_state: bool = False


@contextmanager
def dcp_pinned(tr: Trainer, path: Path, setup: dict, rec: dict) -> Iterator[Save]:
    yield lambda state, path: async_save_pinned(state, path, tr.device == "cuda")


@contextmanager
def ours(tr: Trainer, path: Path, setup: dict, rec: dict) -> Iterator[Save]:
    """DataStatesWriter (made once, outside the timing) with the optimizer guard, whose waits
    are timed by one hook before it and one after."""
    t0 = time.perf_counter()
    nbytes = state_bytes(tr.state(0))
    engine = Engine(host_cache_size=nbytes + (512 << 20))
    writer = DataStatesWriter(engine=engine, overwrite=True)
    handles = []
    try:
        engine.reserve(nbytes).release()  # map and pin the cache once
        setup["ours_writer_s"] = time.perf_counter() - t0
        mark = [0.0]
        waits = []
        handles.append(tr.opt.register_step_pre_hook(
            lambda *_: mark.__setitem__(0, time.perf_counter())))
        handles.append(guard(tr.opt, writer))
        handles.append(tr.opt.register_step_pre_hook(
            lambda *_: waits.append(time.perf_counter() - mark[0])))
        stats = []

        def save(state: dict, path: Path) -> object:
            resp = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
            stats.append(writer.last_stats())
            return resp

        yield save
        rec["staging_wait_s"] = waits[-len(rec["step_s"]):] if rec["step_s"] else []
        rec["snapshots"] = {"bytes": state_bytes(tr.state(0)),
                            "copy_s": [st.copy_s for st in stats],
                            "snapshot_s": [st.snapshot_s for st in stats]}
        st = writer.last_stats()
        if st is not None:
            rec["ours_last_stats"] = {"backend": st.backend, "o_direct": st.direct_io,
                                      "bytes": st.bytes_written, "flush_s": st.flush_s,
                                      "durable_s": st.durable_s}
    finally:
        for h in handles:
            h.remove()
        engine.close()


class _Response:
    """A managed save as the loop sees a DCP response: its snapshot and its memory commit."""

    def __init__(self, handle: object) -> None:
        self.staging_completion, self.upload_completion = handle.staged, handle.committed


@contextmanager
def tiers(tr: Trainer, path: Path, setup: dict, rec: dict,
          max_overhead: float | None = None, restarts: bool = True) -> Iterator[Save]:
    """CheckpointManager: every checkpoint snapshotted into /dev/shm slots (mapped and pinned
    by ``prepare``, off the clock), persisted to the checkpoint directory whenever the previous
    persist is over, saves over ``max_overhead`` skipped; then the restart figures."""
    t0 = time.perf_counter()
    state = tr.state(0)
    nbytes = state_bytes(state)
    engine = Engine(host_cache_size=nbytes + (512 << 20))  # for a save that finds no free slot
    engine.reserve(nbytes).release()  # map and pin the cache once
    memory = Path("/dev/shm/bench_training_tiers")
    shutil.rmtree(memory, ignore_errors=True)
    manager = CheckpointManager(path / "durable", memory_dir=memory, keep_memory=2,
                                keep_durable=2, engine=engine, max_overhead=max_overhead)
    manager.prepare(state, wait=True)  # off the clock: the steady state has pinned slots
    setup["tiers_engine_s"] = time.perf_counter() - t0
    hook = guard(tr.opt, manager)
    box = {"t0": None}
    reasons: Counter[str] = Counter()

    def save(state: dict, path: Path) -> _Response:
        box["t0"] = box["t0"] or time.perf_counter()
        handle = manager.save(state["step"], state)
        if handle.skipped:
            reasons[handle.reason.split(";")[0].split(" (")[0]] += 1
        return _Response(handle)

    try:
        yield save
        if box["t0"] is not None:
            manager.wait()
            span = time.perf_counter() - box["t0"]
            taken = [f for f in manager.history if not f.skipped]
            persisted = [f for f in taken if f.persist_s is not None]
            rec["tiers"] = {"saves": len(taken), "persisted": len(persisted),
                            "skipped": len(manager.history) - len(taken),
                            "span_s": span, "bytes": nbytes,
                            "persist_s": [f.persist_s for f in persisted],
                            "memory_s": [f.memory_s for f in taken],
                            "snapshot_s": [f.snapshot_s for f in taken],
                            "copy_s": [f.copy_s for f in taken],
                            "blocked_s": [f.blocked_s for f in taken],
                            "cost_s": [f.cost_s for f in taken],
                            "skip_reasons": dict(reasons)}
            rec["snapshots"] = {k: rec["tiers"][k] for k in ("bytes", "copy_s", "snapshot_s")}
            manager.close()
            if restarts and not tr.args.no_restart:  # a child process: once, in "tiers"
                rec["tiers"]["restart"] = restart(tr, manager, engine)
    finally:
        hook.remove()
        manager.close()
        shutil.rmtree(memory, ignore_errors=True)
        engine.close()


def restart(tr: Trainer, manager: CheckpointManager, engine: Engine) -> dict:
    """Seconds to restore the newest checkpoint: from the memory tier (a new manager on the
    same directories, as after a crash) and cold from the durable tier."""
    state = tr.state(0)
    again = CheckpointManager(manager.durable, memory_dir=manager.memory, persist=None,
                              engine=engine)
    sync()
    t = time.perf_counter()
    step = again.load(state)
    sync()
    memory_s = time.perf_counter() - t
    again.close()
    durable = manager.durable / f"step_{step}"
    how = drop_cache([durable])
    t = time.perf_counter()
    dcp.load(state, checkpoint_id=durable, storage_reader=DataStatesReader(engine=engine),
             no_dist=True)
    sync()
    return {"step": step, "memory_s": memory_s, "durable_cold_s": time.perf_counter() - t,
            "evict": how, **resume_in_child(manager)}


RESUMED = "RESUMED "


def resume_in_child(manager: CheckpointManager) -> dict:
    """A new process resumes from the memory tier (as a job restarted after a crash: a new
    manager, ``load``, ``prepare``, a training step, a save): its marks in seconds from its
    start, and the goal's ratio: manager + load + prepare + first step over the load."""
    t0 = time.time()
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
                          "--resume-child", str(manager.memory), str(manager.durable)],
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith(RESUMED)), None)
    if line is None:
        log(f"resume child failed (rc {out.returncode}): {out.stderr[-3000:]}")
        return {}
    got = json.loads(line[len(RESUMED):])
    marks = {k: v - t0 for k, v in got.pop("marks").items()}
    load_s = marks["loaded"] - marks["manager"]
    to_step = marks["first_step"] - marks["manager"]
    return {"resume": {**got, "marks": marks, "load_s": load_s, "to_first_step_s": to_step,
                       "over_load": to_step / load_s if load_s else None,
                       "start_to_first_step_s": marks["first_step"]}}


def resume_child(args: argparse.Namespace, device: str) -> None:
    """The child of :func:`resume_in_child`: prints its marks (``time.time()``) as JSON."""
    marks = {"imported": time.time()}
    tr = Trainer(args, device)
    tr.step()  # the optimizer state exists to load into, as in any DCP resume
    sync()
    memory, durable = args.resume_child
    state = tr.state(0)
    marks["manager"] = time.time()
    manager = CheckpointManager(durable, memory_dir=memory, keep_memory=1, persist=None)
    marks["made"] = time.time()
    step = manager.load(state)
    sync()
    marks["loaded"] = time.time()
    manager.prepare(state)  # slots sized and pinned in the background
    marks["prepared"] = time.time()
    tr.step()
    sync()
    marks["first_step"] = time.time()
    tr.step()
    sync()
    marks["second_step"] = time.time()
    handle = manager.save(step + 1, tr.state(step + 1))  # while the slots are being pinned
    handle.committed.result()
    marks["first_save"] = time.time()
    manager.close()
    marks["closed"] = time.time()
    f = handle.figures
    print(RESUMED + json.dumps({"marks": marks, "step": step, "save_blocked_s": f.blocked_s,
                                "save_snapshot_s": f.snapshot_s, "save_memory_s": f.memory_s}),
          flush=True)


MODES = {
    "none": Mode("no checkpoint"),
    "dcp_pinned": Mode("DCP async_save + pinned DefaultStager", dcp_pinned,
                       snapshot_before_step=True),
    "ours": Mode("DataStatesWriter + guard", ours),
    "tiers": Mode("CheckpointManager: memory tier + persist", tiers, wait_previous=False),
    "tiers_every_step": Mode("CheckpointManager, every step",
                             functools.partial(tiers, restarts=False), every=1,
                             wait_previous=False, reuse_state=True),
    "tiers_budget": Mode("CheckpointManager, every step, max_overhead=0.05",
                         functools.partial(tiers, max_overhead=0.05, restarts=False), every=1,
                         wait_previous=False, reuse_state=True),
}


def run_mode(mode: Mode, tr: Trainer, path: Path, setup: dict, rec: dict) -> None:
    """Warm up, then time ``--steps`` steps, starting a checkpoint every ``--every``."""
    a = tr.args
    rec.update(step_s=[], ckpt_steps=[], block_s=[], state_dict_s=[], upload_wait_s=[],
               staging_wait_s=[], durable_s=[])
    pending = None  # (response, call time, completion stamp)
    earlier: list[tuple] = []  # checkpoints not waited for (mode.wait_previous False)
    every = mode.every or a.every
    staging = None  # snapshot_before_step: the staging future to wait for
    state = None

    def wait_staging() -> None:
        nonlocal staging
        if staging is not None:
            t = time.perf_counter()
            staging.result()
            rec["staging_wait_s"].append(time.perf_counter() - t)
            staging = None

    def finish(p: tuple) -> None:
        resp, t_call, stamp = p
        futures(resp)[1].result()
        rec["durable_s"].append(stamp.wait() - t_call)

    try:
        with mode.saver(tr, path, setup, rec) if mode.saver else nullcontext() as start:
            for _ in range(a.warmup):
                tr.step()
            sync()
            ok = False
            try:
                for s in range(1, a.steps + 1):
                    step_sync()
                    t0 = time.perf_counter()
                    tr.step(wait_staging if mode.snapshot_before_step else None)
                    if start is not None and s % every == 0:
                        if pending is not None and not mode.wait_previous:
                            earlier.append(pending)
                        elif pending is not None:
                            t = time.perf_counter()
                            finish(pending)
                            rec["upload_wait_s"].append(time.perf_counter() - t)
                        t = time.perf_counter()
                        if mode.reuse_state and state is not None:
                            state["step"] = s
                        else:
                            state = tr.state(s)
                        t_call = time.perf_counter()
                        rec["state_dict_s"].append(t_call - t)
                        resp = start(state, path)
                        rec["block_s"].append(time.perf_counter() - t_call)
                        rec.setdefault("ckpt_bytes", state_bytes(state))
                        if mode.snapshot_before_step:
                            staging = futures(resp)[0]
                        pending = (resp, t_call, DoneAt(futures(resp)[1]))
                        rec["ckpt_steps"].append(s)
                    step_sync()
                    rec["step_s"].append(time.perf_counter() - t0)
                wait_staging()
                ok = True
            finally:
                try:
                    for p in [*earlier, pending] if pending is not None else earlier:
                        finish(p)  # the last checkpoint(s): durable time only, no step waits
                except Exception:
                    if ok:
                        raise
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- report --------------------------------------------------------------------------------------
def params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(rec: dict, base: float | None) -> dict:
    steps = rec.get("step_s", [])
    ck = set(rec.get("ckpt_steps", []))
    med = median(steps)
    mean = sum(steps) / len(steps) if steps else None
    return {"median_s": med, "mean_s": mean, "max_s": max(steps, default=None),
            "ckpt_step_median_s": median([t for i, t in enumerate(steps, 1) if i in ck]),
            "after_ckpt_median_s": median([t for i, t in enumerate(steps, 1) if i - 1 in ck]),
            "slowdown_pct": 100 * (med / base - 1) if med and base else None,
            "mean_slowdown_pct": 100 * (mean / base - 1) if mean and base else None,
            "block_median_s": median(rec.get("block_s", [])),
            "state_dict_median_s": median(rec.get("state_dict_s", [])),
            "staging_wait_total_s": sum(rec.get("staging_wait_s", [])) if ck else None,
            "upload_wait_total_s": sum(rec.get("upload_wait_s", [])) if ck else None,
            "durable_median_s": median(rec.get("durable_s", [])),
            "ckpt_bytes": rec.get("ckpt_bytes"), "n_steps": len(steps)}


def tables(res: dict) -> list[Table]:
    t = Table(f"GPT {params(res['n_params'])} params ({res['layers']} layers, dim {res['dim']}), "
              f"{'fp32 (bf16 autocast)' if res.get('fp32') else 'bf16'} + AdamW, "
              f"batch {res['batch']} x seq {res['seq']} on {res['device']}, "
              f"{res['steps']} steps per mode, checkpoint of "
              f"{format_size(res['ckpt_bytes'] or 0)} every {res['every']} to {res['dir']}",
              [("mode", ""), ("median ms", ".1f"), ("slowdown", "+.2f%"), ("mean +", "+.1f%"),
               ("ckpt-step ms", ".1f"), ("next-step ms", ".1f"), ("max ms", ".1f"),
               ("call ms", ".1f"), ("sd ms", ".1f"), ("stage-w s", ".3f"), ("upload-w s", ".2f"),
               ("durable s", ".2f")])
    for mode, r in res["summary"].items():
        t.add(mode, ms(r["median_s"]), r["slowdown_pct"], r["mean_slowdown_pct"],
              ms(r["ckpt_step_median_s"]), ms(r["after_ckpt_median_s"]), ms(r["max_s"]),
              ms(r["block_median_s"]), ms(r["state_dict_median_s"]), r["staging_wait_total_s"],
              r["upload_wait_total_s"], r["durable_median_s"])
    t.notes = [
        "slowdown: median step vs no checkpoint; mean +: mean step vs the no-checkpoint median",
        "ckpt-step: median of the steps starting a checkpoint; next-step: the steps after them",
        "call: async_save; sd: get_state_dict; stage-w: total wait for the snapshot before "
        "optimizer.step (ours: in the guard); upload-w: total wait for the previous checkpoint "
        "to be durable before the next starts",
        "one-time (excluded): " + ", ".join(f"{k} {v:.2f} s" for k, v in res["setup"].items())]
    s = res["summary"]
    interval = s.get("none", {}).get("median_s")
    for mode, r in s.items():
        if interval and r["durable_median_s"] and r["durable_median_s"] > interval * res["every"]:
            t.notes.append(f"{mode} needs {r['durable_median_s']:.2f} s to be durable, more than "
                           f"the {interval * res['every']:.2f} s between checkpoints: the next "
                           "checkpoint waits")
    if res.get("baseline_drift_pct") is not None:
        t.notes.append(f"baseline drift: the second no-checkpoint run "
                       f"{res['baseline_drift_pct']:+.2f}% vs the first")
    if s.get("ours", {}).get("slowdown_pct") is not None:
        v = s["ours"]["slowdown_pct"]
        t.notes.append(f"goal: ours median step <= 2% slower than no checkpoint: {v:+.2f}% -> "
                       f"{'met' if v <= 2 else 'MISSED'}")
    out = [t, *snapshot_tables(res), *tier_tables(res)]
    if "ours" not in s:
        return out
    metrics = {"mean_s": "mean step", "ckpt_step_median_s": "ckpt step", "max_s": "max step",
               "staging_wait_total_s": "snapshot waits", "upload_wait_total_s": "durable waits",
               "durable_median_s": "durable"}
    pairs = {f"{m} / ours": (r, s["ours"]) for m, r in s.items() if m not in ("none", "ours")}
    return [*out, ratio_table("ratios of times (> 1: ours is faster)", pairs, metrics)]


def snapshot_tables(res: dict) -> list[Table]:
    """The snapshots' D2H copies during training against the idle pinned D2H ceiling, the
    memory commits, and the longest step against the median."""
    ceiling = res.get("copy", {}).get("d2h_gib_s")
    runs = {m: r for m, r in res["runs"].items() if r.get("snapshots")}
    if not runs:
        return []
    t = Table(f"snapshots during training: GPU time of the D2H copies against the idle pinned "
              f"D2H ceiling ({ceiling or 0:.1f} GiB/s, one copy, measured in this run)",
              [("mode", ""), ("saves", "d"), ("copy s", ".3f"), ("GiB/s", ".1f"),
               ("of idle", ".0f%"), ("worst", ".0f%"), ("snapshot s", ".3f"),
               ("commit s", ".3f"), ("max/median step", ".2f")])
    for mode, r in runs.items():
        snap = r["snapshots"]
        copies = [c for c in snap["copy_s"] if c]
        rate = snap["bytes"] / 2**30 / median(copies) if copies else None
        worst = snap["bytes"] / 2**30 / max(copies) if copies else None
        tier = r.get("tiers") or {}
        commits = [m - s for m, s in zip(tier.get("memory_s", []), tier.get("snapshot_s", []),
                                         strict=True) if m is not None and s is not None]
        steps = r.get("step_s", [])
        t.add(mode, len(snap["copy_s"]), median(copies), rate,
              100 * rate / ceiling if rate and ceiling else None,
              100 * worst / ceiling if worst and ceiling else None,
              median([x for x in snap["snapshot_s"] if x is not None]), median(commits),
              max(steps) / median(steps) if steps else None)
    t.notes = ["copy s: median GPU time of a snapshot's device-to-host copies (CUDA events on "
               "the side stream, from the first byte); GiB/s and of idle: the state's bytes "
               "over it, against the ceiling; worst: the slowest snapshot",
               "snapshot s: median from the save call to the staged snapshot (it includes the "
               "wait for the GPU work queued before the call, whose results it copies)",
               "commit s: median memory-tier commit after the snapshot (memory s - snapshot s)"]
    return [t]


def tier_tables(res: dict) -> list[Table]:
    """Persists per minute against the disk's write bandwidth, and restart times."""
    runs = {m: r["tiers"] for m, r in res["runs"].items() if r.get("tiers")}
    if not runs:
        return []
    disk = res.get("disk", {})
    t = Table(f"checkpoint tiers: memory tier in /dev/shm, persisted to {res['dir']} whenever "
              f"the previous persist is over; disk write ceiling "
              f"{disk.get('write_gib_s', 0):.2f} GiB/s (O_DIRECT {disk.get('o_direct')})",
              [("mode", ""), ("saves", "d"), ("skipped", "d"), ("committed/min", ".1f"),
               ("persisted", "d"), ("per min", ".1f"),
               ("persist GiB/s", ".2f"), ("of disk", ".0f%"), ("memory s", ".2f"),
               ("restart mem s", ".2f"), ("cold disk s", ".2f"), ("speed-up", ".1f"),
               ("resume step s", ".2f"), ("÷ load", ".2f")])
    for mode, r in runs.items():
        gib_s = r["persisted"] * r["bytes"] / 2**30 / r["span_s"] if r["span_s"] else None
        rs = r.get("restart", {})
        rz = rs.get("resume", {})
        t.add(mode, r["saves"], r.get("skipped", 0), 60 * r["saves"] / r["span_s"],
              r["persisted"], 60 * r["persisted"] / r["span_s"], gib_s,
              100 * gib_s / disk["write_gib_s"] if gib_s and disk.get("write_gib_s") else None,
              median(r["memory_s"]), rs.get("memory_s"), rs.get("durable_cold_s"),
              rs["durable_cold_s"] / rs["memory_s"] if rs.get("memory_s") else None,
              rz.get("to_first_step_s"), rz.get("over_load"))
    t.notes = ["saves: taken (committed in memory); skipped: refused under max_overhead; "
               "committed/min: memory-tier checkpoints per minute of training",
               "per min: checkpoints persisted per minute of training; persist GiB/s: their "
               "bytes over the mode's span; of disk: that against the disk write ceiling",
               "memory s: median time from save() to the memory-tier commit; restart: a new "
               "manager loading the newest step from memory, vs a cold DataStatesReader load "
               "of the same step from the durable tier",
               "resume step s: a new process (started after the mode) from a new manager to "
               "the end of its first training step after load (manager, load, prepare: slots "
               "pinned in the background, one step); ÷ load: that over its memory load (goal "
               "<= 2); its marks and first save (taken while pinning) are in the JSON"]
    return [t]


def plot(res: dict, png: Path) -> None:
    fig, (ax1, ax2) = figure(2, size=(13, 4.6), width_ratios=(2.2, 1))
    for name, rec in res["runs"].items():
        if rec.get("step_s"):
            mode = MODES[name.split("#")[0]]
            ax1.plot(range(1, len(rec["step_s"]) + 1), [t * 1e3 for t in rec["step_s"]],
                     marker=".", lw=1, label=mode.label + (" (again)" if "#" in name else ""))
    for s in range(res["every"], res["steps"] + 1, res["every"]):
        ax1.axvline(s, color="grey", ls=":", lw=0.8)
    ax1.set_xlabel("step (dotted: checkpoint starts)")
    ax1.set_ylabel("step time, ms")
    ax1.legend(fontsize=8)
    rows = {m: r for m, r in res["summary"].items() if r.get("median_s")}
    bars(ax2, list(rows), {label: [ms(r[key]) for r in rows.values()] for key, label in (
        ("median_s", "median"), ("ckpt_step_median_s", "ckpt steps"), ("max_s", "max"))},
         spec=".0f", ylabel="ms")
    m = res["machine"]
    save(fig, png, f"GPT {params(res['n_params'])} params bf16, AdamW, batch {res['batch']} x "
                   f"seq {res['seq']}, checkpoint ({format_size(res['ckpt_bytes'] or 0)}) every "
                   f"{res['every']} steps; {m.get('gpu', 'CPU')}")


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    t_start = time.perf_counter()
    ap = parser(__doc__, smoke="tiny model on CPU, 8 steps, checkpoint every 4")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fp32", action="store_true",
                    help="fp32 parameters and AdamW state, bf16 autocast compute")
    ap.add_argument("--preset", choices=["6g", "8g"],
                    help="6g: the defaults (6 GiB bf16 state, ~220 ms steps on an H100); 8g: "
                         "12 layers, fp32 state (~7.5 GiB), batch 16 (~160 ms steps)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each mode")
    ap.add_argument("--dir", default="/tmp/bench_training", help="checkpoint directory")
    ap.add_argument("--gc", choices=["default", "freeze"], default="default",
                    help="freeze: gc.freeze() once the model and optimizer are made (every "
                         "mode): a full collection then skips them (README: 'Python's GC')")
    ap.add_argument("--no-restart", action="store_true",
                    help="leave out the restart figures of 'tiers' (a new manager's load and "
                         "a child process's resume: ~50 s of an H100 run)")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(MODES), metavar="MODE",
                    help=f"modes to leave out: {', '.join(MODES)}")
    ap.add_argument("--resume-child", nargs=2, metavar=("MEMORY", "DURABLE"),
                    help=argparse.SUPPRESS)  # the process resume_in_child starts
    args = ap.parse_args()
    if args.preset == "8g":
        args.layers, args.batch, args.fp32 = 12, 16, True
    if args.cpu_smoke:
        args.layers, args.dim, args.heads, args.vocab, args.seq, args.batch = 2, 64, 4, 256, 32, 4
        args.steps, args.every, args.warmup = 8, 4, 1
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu-smoke to check the script on CPU")
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.resume_child:
        return resume_child(args, device)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)

    tr = Trainer(args, device)
    tr.step()  # creates the optimizer state
    sync()
    if args.gc == "freeze":  # what a long training loop may do once it is set up
        gc.freeze()
    ckpt_bytes = state_bytes(tr.state(0))
    require(str(root), int(2.2 * ckpt_bytes), free_bytes(root), "2 checkpoints")
    run = Run("bench_training", args, [root, Path("/dev/shm")])
    run.header()
    res = run.res
    res.update(**{k: getattr(args, k) for k in ("layers", "dim", "heads", "vocab", "seq",
                                                 "batch", "steps", "every", "warmup", "fp32")},
               device=device, n_params=tr.n_params, ckpt_bytes=ckpt_bytes, dir=str(root),
               setup={}, runs={}, summary={})
    log(f"model: {params(tr.n_params)} params on {device}; checkpoint "
        f"{format_size(ckpt_bytes)}; {format_size(free_bytes(root))} free in {root}, "
        f"{format_size(free_bytes('/dev/shm'))} in /dev/shm (ours' host cache lives there)")
    modes = [m for m in MODES if m not in args.skip]
    plan = [*modes, "none"] if "none" in modes and len(modes) > 1 else modes
    for i, mode in enumerate(plan):
        name = mode if mode not in plan[:i] else f"{mode}#2"
        rec: dict = {}
        res["runs"][name] = rec
        t_mode = time.perf_counter()
        run.guard(name, run_mode, MODES[mode], tr, root / mode, res["setup"], rec)
        steps = rec.get("step_s", [])
        mean = sum(steps) / len(steps) if steps else 0.0
        tier = rec.get("tiers")
        log(f"{name}: {len(steps)} steps, median {ms(median(steps)) or 0:.1f} ms, mean "
            f"{ms(mean):.1f} ms, max {ms(max(steps, default=0)):.1f} ms"
            + (f"; {tier['saves']} saves, {tier.get('skipped', 0)} skipped, "
               f"{tier['persisted']} persisted" if tier else "")
            + f"; mode took {time.perf_counter() - t_mode:.1f} s (elapsed "
              f"{time.perf_counter() - t_start:.0f} s)")

    runs = res["runs"]
    if device == "cuda" and any(r.get("snapshots") for r in runs.values()):
        res["copy"] = run.guard("D2H ceiling", copy_ceiling, min(ckpt_bytes, 2 << 30))
    if any(r.get("tiers") for r in runs.values()):
        res["disk"] = run.guard("disk ceiling", disk_ceiling, root, min(ckpt_bytes, 4 << 30))
    both = runs.get("none", {}).get("step_s", []) + runs.get("none#2", {}).get("step_s", [])
    if "none#2" in runs:
        first, again = median(runs["none"].get("step_s", [])), median(runs["none#2"]["step_s"])
        res["baseline_drift_pct"] = 100 * (again / first - 1) if first and again else None
    base = median(both)
    res["summary"] = {m: summarize({"step_s": both} if m == "none" else r, base)
                      for m, r in runs.items() if m != "none#2"}
    run.finish(tables, plot)


if __name__ == "__main__":
    main()
