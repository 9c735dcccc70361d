"""torchtitan's own trainer (llama3, synthetic data): checkpointing overhead, and resume checks.

Each run is ``examples/torchtitan_train.py`` in a subprocess (``--nproc`` > 1: under torchrun),
same seed and data: ``none`` (no checkpoints), then ``stock`` (torchtitan's CheckpointManager,
``async_with_pinned_mem``), ``enable`` (``enable_datastates(trainer.checkpointer)``) and
``tiers`` (``DataStatesCheckpointManager`` with ``memory_tier=True``), each with a checkpoint
every ``--interval`` steps (``--steps`` steps; ``--interval-modes`` picks some) and every step
(``--every-step-steps`` steps; the memory tier then with ``max_overhead=--every-step-budget``,
its overhead budget, which skips the saves it cannot pay for). A step's time runs from one
step's loss line to the next (its compute and the previous step's save); the first step
(warm-up, compilation) is left out, and so is the last step's save (synchronous, model and
optimizer, in every mode). The resume check of ``examples/torchtitan_resume.py`` for each of
``--resume-modes`` (SIGKILL mid-run, restart with the same command line, losses compared step
for step with the interval run of that mode; ``--drop-rank-tier R``: rank R's memory tier is
removed before the memory tier's restart) runs before the every-step runs. No run starts past
``--budget-s``. Every run's folder is removed once its figures are in; the JSON is written after
every run, so a run cut short keeps what it had. Works with torchtitan 0.2.x and 0.3.x
(whichever is installed).

    python benchmarks/bench_torchtitan.py --flavor debugmodel --steps 30 --every-step-steps 10 \\
        --dir /tmp/bench_titan
    python benchmarks/bench_torchtitan.py --nproc 2 --replicate --drop-rank-tier 1 \\
        --dir /tmp/bench_titan -- --parallelism.data_parallel_shard_degree 2
    python benchmarks/bench_torchtitan.py --cpu-smoke --dir /tmp/bench_titan   # code paths only
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from harness import REPO
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.tables import Table

sys.path.insert(0, str(REPO / "examples"))
from torchtitan_resume import Outcome, Spec, resume_check, run, stop_on_sigterm  # noqa: E402

CHECKPOINTING = ("stock", "enable", "tiers")
#: torchtitan's default async mode for the stock runs (the others are named after theirs).
PINNED = "async_with_pinned_mem"
SHM = Path("/dev/shm")
#: What ``--cpu-smoke`` runs: torchtitan 0.2.x's llama3 debug model on the CPU, few steps.
SMOKE = {"flavor": "debugmodel", "attention": "sdpa", "steps": 6, "interval": 2,
         "every_step_steps": 3, "titan": ["--cpu", "--training.seq_len", "128"]}


def arguments() -> object:
    ap = parser(__doc__, smoke="torchtitan 0.2.x's debug model on the CPU (gloo), few steps")
    ap.add_argument("--flavor", default="1B", help="llama3 flavour (debugmodel, 1B, 3B, ...)")
    ap.add_argument("--attention", default="flex", choices=("flex", "sdpa", "varlen"))
    ap.add_argument("--steps", type=int, default=30, help="steps of the none and interval runs")
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--interval-modes", default="",
                    help="comma-separated labels (stock, stock-async, enable, tiers) of the "
                    "runs every --interval steps besides none ('': every one compared; "
                    "'none': the baseline only)")
    ap.add_argument("--every-step-steps", type=int, default=5,
                    help="steps of the every-step runs (0: none of them)")
    ap.add_argument("--every-step-modes", default="",
                    help="comma-separated labels (stock, stock-async, enable, tiers) of the "
                    "every-step runs ('': every one compared)")
    ap.add_argument("--every-step-budget", type=float, default=0.05,
                    help="max_overhead of the memory tier's every-step run (0: none)")
    ap.add_argument("--stock-async", default=PINNED,
                    help="comma-separated torchtitan async modes of the stock runs, one run "
                    f"each ({PINNED}: 'stock'; async: 'stock-async', without pinned memory)")
    ap.add_argument("--resume-modes", default="tiers",
                    help="comma-separated modes to check the resume of (stock, enable, tiers; "
                    "'' for none)")
    ap.add_argument("--kill-after", type=int, default=None,
                    help="resume checks: kill once past this step (default: 2.5 intervals)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks of every run (torchrun)")
    ap.add_argument("--replicate", action="store_true",
                    help="the memory tier's runs: --checkpoint.memory_replicate (each rank's "
                    "checkpoints also in the next rank's tier)")
    ap.add_argument("--drop-rank-tier", type=int, default=None,
                    help="the memory tier's resume check: remove this rank's memory tier "
                    "before the restart")
    ap.add_argument("--dir", type=Path, required=True, help="where the runs write (emptied)")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="start no run after this many seconds (the rest is reported skipped)")
    ap.add_argument("titan", nargs="*", help="after --: torchtitan arguments for every run")
    args = ap.parse_args()
    if args.cpu_smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value + args.titan if key == "titan" else value)
    args.resume_modes = [m for m in args.resume_modes.split(",") if m]
    args.stock_async = [m for m in args.stock_async.split(",") if m]
    unknown = set(args.resume_modes) - set(CHECKPOINTING)
    if unknown:
        ap.error(f"--resume-modes: unknown modes {sorted(unknown)}")
    return args


def compared(args: object) -> list[tuple[str, str, list[str]]]:
    """(label, mode, torchtitan arguments) of each checkpointing compared: the stock trainer
    once per ``--stock-async`` mode, then ``enable`` and ``tiers``."""
    stock = [("stock" if m == PINNED else f"stock-{m}", "stock",
              [*args.titan] if m == PINNED else [*args.titan, "--checkpoint.async_mode", m])
             for m in args.stock_async]
    tiers = ["--checkpoint.memory_replicate"] if args.replicate else []
    return [*stock, ("enable", "enable", [*args.titan]), ("tiers", "tiers", [*args.titan, *tiers])]


def plan(args: object) -> tuple[list[tuple[str, Spec]], list[tuple[str, Spec]]]:
    """(name, spec) of the timed runs: none and one every ``--interval`` steps per
    checkpointing, then those every step."""
    base = {"flavor": args.flavor, "attention": args.attention, "nproc": args.nproc}
    interval = [("none", Spec("none", steps=args.steps, interval=args.interval,
                              extra=args.titan, **base))]
    picked = {m for m in args.interval_modes.split(",") if m}
    interval += [(f"{label}/{args.interval}", Spec(mode, steps=args.steps,
                                                   interval=args.interval, extra=extra, **base))
                 for label, mode, extra in compared(args) if not picked or label in picked]
    every = []
    chosen = {m for m in args.every_step_modes.split(",") if m}
    for label, mode, extra in compared(args) if args.every_step_steps else []:
        if chosen and label not in chosen:
            continue
        name = f"{label}/1"
        if mode == "tiers" and args.every_step_budget:
            extra = [*extra, "--checkpoint.max_overhead", str(args.every_step_budget)]
            name += f" max_overhead={args.every_step_budget:g}"
        every.append((name, Spec(mode, steps=args.every_step_steps, interval=1, extra=extra,
                                 **base)))
    return interval, every


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def timed(name: str, spec: Spec, root: Path) -> tuple[dict, Outcome]:
    """One run; its figures (the trainer's summary, or the log's tail where it failed)."""
    folder, memory = root / _slug(name), SHM / f"bench_titan_{_slug(name)}"
    started = time.perf_counter()
    try:
        out = run(spec.command(folder, memory), root / f"{_slug(name)}.log")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    row = {"name": name, "mode": spec.mode, "interval": spec.interval if spec.mode != "none"
           else None, "steps": spec.steps, "rc": out.rc, "run_s": time.perf_counter() - started,
           "first_step_s": out.first_step_s, "losses": out.losses}
    if out.summary is None or out.rc != 0:
        row["error"] = out.tail[-15:]
        log(f"!! {name} failed (exit {out.rc}):\n   " + "\n   ".join(out.tail[-15:]))
    else:
        row.update({k: out.summary.get(k) for k in (
            "mean_step_s", "median_step_s", "max_step_s", "steps_timed", "checkpoints_taken",
            "checkpoints_skipped", "checkpoints_persisted", "step_times_s")})
        log(f"{name}: median step {row['median_step_s']:.4f} s, mean {row['mean_step_s']:.4f} s,"
            f" max {row['max_step_s']:.4f} s; taken {row['checkpoints_taken']}, persisted "
            f"{row['checkpoints_persisted']}; slowest steps {slowest(out.summary)}")
    return row, out


def slowest(summary: dict, n: int = 3) -> str:
    """The ``n`` slowest steps of a run's summary, as ``step: seconds``."""
    first, times = summary.get("first_step"), summary.get("step_times_s") or []
    ranked = sorted(enumerate(times, start=(first or 0) + 1), key=lambda t: -t[1])[:n]
    return ", ".join(f"{step}: {t:.3f} s" for step, t in ranked)


def tables(res: dict) -> list[Table]:
    rows = res.get("runs", [])
    base = next((r for r in rows if r["mode"] == "none" and "median_step_s" in r), {})
    args = res["args"]
    t = Table(f"torchtitan llama3 {args['flavor']} ({args['nproc']} rank(s)): step time vs no "
              f"checkpoint",
              [("run", ""), ("steps", "d"), ("mean s", ".4f"), ("median s", ".4f"),
               ("max s", ".4f"), ("mean vs none", "+.1f%"), ("median vs none", "+.1f%"),
               ("max / median", ".2f"), ("taken", "d"), ("persisted", "d"),
               ("first step s", ".1f")],
              ["stock: torchtitan CheckpointManager, async_with_pinned_mem (stock-async: "
               "async_mode='async'); enable: "
               "enable_datastates(trainer.checkpointer); tiers: DataStatesCheckpointManager "
               "memory_tier=True", "name/N: a checkpoint every N steps; taken: checkpoints "
               "taken (the last step's included; the overhead budget skips some); persisted: "
               "committed to the checkpoint folder"])
    for r in rows:
        median = r.get("median_step_s")
        t.add(r["name"], r["steps"], r.get("mean_step_s"), median, r.get("max_step_s"),
              _pct(r.get("mean_step_s"), base.get("mean_step_s")),
              _pct(median, base.get("median_step_s")),
              r["max_step_s"] / median if median and r.get("max_step_s") else None,
              len(r["checkpoints_taken"]) if r.get("checkpoints_taken") is not None else None,
              len(r["checkpoints_persisted"]) if "checkpoints_persisted" in r else None,
              r.get("first_step_s"))
    out = [t]
    checks = res.get("resume") or {}
    if checks:
        rt = Table("Resume after SIGKILL, restarted with the same command line",
                   [("mode", ""), ("losses equal", ""), ("killed after", "d"),
                    ("newest committed", "d"), ("restarted at", "d"), ("restored from", ""),
                    ("steps compared", "d"), ("first step after restart s", ".1f")],
                   [f"{mode}: {p}" for mode, v in checks.items() if v
                    for p in v.get("problems", [])])
        for mode, v in checks.items():
            if not v:
                rt.add(mode, "ERROR", None, None, None, "", None, None)
                continue
            source = str(v.get("restored_from") or "torchtitan's folder")
            if v.get("from_replicas"):
                source += f"; {len(v['from_replicas'])} rank(s) from a replica"
            if v.get("dropped_rank_tier") is not None:
                source += f" (rank {v['dropped_rank_tier']}'s memory tier removed)"
            rt.add(mode, "yes" if v.get("ok") else "NO", v.get("killed_after_step"),
                   v.get("newest_committed"), v.get("resumed_at_step"), source,
                   v.get("steps_compared"), v.get("restart_first_step_s"))
        out.append(rt)
    return out


def _pct(x: float | None, base: float | None) -> float | None:
    return 100.0 * (x / base - 1.0) if x and base else None


def plot(res: dict, png: Path) -> None:
    rows = [r for r in res.get("runs", []) if "median_step_s" in r]
    fig, (ax,) = figure(size=(9, 4.8))
    bars(ax, [r["name"] for r in rows], {"median": [r["median_step_s"] for r in rows],
                                         "mean": [r["mean_step_s"] for r in rows]},
         spec=".3f", ylabel="step time (s)")
    save(fig, png, f"torchtitan llama3 {res['args']['flavor']}: step time per checkpoint mode")


def main() -> None:
    args = arguments()
    stop_on_sigterm()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    bench = Run("bench_torchtitan", args, [args.dir, SHM])
    bench.header()
    bench.res.update(runs=[], skipped=[], resume={})
    outcomes: dict[str, Outcome] = {}
    interval, every = plan(args)
    for name, spec in interval:
        outcomes[name] = timed_within_budget(bench, args, name, spec)
    for mode in args.resume_modes:
        resume(bench, args, mode, outcomes.get(f"{mode}/{args.interval}"))
    for name, spec in every:
        timed_within_budget(bench, args, name, spec)
    if bench.res["skipped"]:
        log(f"skipped (past --budget-s {args.budget_s:.0f}): {bench.res['skipped']}")
    bench.finish(tables, plot)


def over_budget(bench: Run, args: object, name: str) -> bool:
    """Whether no run may start any more (``name`` is then noted as skipped)."""
    if time.perf_counter() - bench.t0 <= args.budget_s:
        return False
    bench.res["skipped"].append(name)
    return True


def timed_within_budget(bench: Run, args: object, name: str, spec: Spec) -> Outcome | None:
    """One timed run, unless past the budget; its row goes into the JSON at once."""
    if over_budget(bench, args, name):
        return None
    row, out = timed(name, spec, args.dir)
    bench.res["runs"].append(row)
    bench.write()
    return out


def resume(bench: Run, args: object, mode: str, reference: Outcome | None) -> None:
    """The resume check of ``mode`` (its interval run, if it succeeded, is the reference)."""
    if over_budget(bench, args, f"resume {mode}"):
        return
    extra = next(e for _, m, e in compared(args) if m == mode)
    spec = Spec(mode, args.flavor, args.attention, args.steps, args.interval, extra, args.nproc)
    ok = reference is not None and reference.rc == 0
    drop = args.drop_rank_tier if mode == "tiers" else None
    result = bench.guard(f"resume {mode}", resume_check, spec, args.dir / f"resume_{mode}",
                         reference if ok else None, kill_after=args.kill_after,
                         drop_rank_tier=drop)
    bench.res["resume"][mode] = result
    if result is not None:
        log(f"resume {mode}: {'ok' if result['ok'] else 'FAILED'}: restarted at step "
            f"{result['resumed_at_step']} (newest committed {result['newest_committed']}, "
            f"from {result['restored_from'] or 'the folder'}), {result['steps_compared']} "
            f"losses compared; {'; '.join(result['problems']) or 'no problems'}")
    bench.write()


if __name__ == "__main__":
    main()
