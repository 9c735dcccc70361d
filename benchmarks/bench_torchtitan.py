"""torchtitan's own trainer (llama3, synthetic data, FSDP2 on one rank): checkpointing overhead.

Each run is ``examples/torchtitan_train.py`` in a subprocess, same seed and data: ``none`` (no
checkpoints), then ``stock`` (torchtitan's CheckpointManager, ``async_with_pinned_mem``),
``enable`` (``enable_datastates(trainer.checkpointer)``) and ``tiers``
(``DataStatesCheckpointManager.Config(memory_tier=True)``), each with a checkpoint every
``--interval`` steps (``--steps`` steps) and every step (``--every-step-steps`` steps). A step's
time runs from one step's loss line to the next (its compute and the previous step's save);
the first step (warm-up, compilation) is left out, and so is the last step's save (synchronous,
model and optimizer, in every mode). The resume check of ``examples/torchtitan_resume.py`` on
``--resume-mode`` (SIGKILL mid-run, restart, losses compared with the interval run of that
mode, step for step) runs before the every-step runs. No run starts past ``--budget-s``.
Every run's folder is removed once its figures are in; the JSON is
written after every run, so a run cut short keeps what it had.

    python benchmarks/bench_torchtitan.py --flavor 1B --steps 30 --every-step-steps 5 \\
        --dir /tmp/bench_titan
    python benchmarks/bench_torchtitan.py --flavor debugmodel --steps 12 --interval 4 \\
        --every-step-steps 4 --dir /tmp/bench_titan      # a quick pass
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
from torchtitan_resume import Outcome, Spec, resume_check, run  # noqa: E402

CHECKPOINTING = ("stock", "enable", "tiers")
SHM = Path("/dev/shm")


def arguments() -> object:
    ap = parser(__doc__)
    ap.add_argument("--flavor", default="1B", help="llama3 flavour (debugmodel, 1B, 3B, ...)")
    ap.add_argument("--attention", default="flex", choices=("flex", "varlen"))
    ap.add_argument("--steps", type=int, default=30, help="steps of the none and interval runs")
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--every-step-steps", type=int, default=5,
                    help="steps of the every-step runs (0: none of them)")
    ap.add_argument("--resume-mode", default="tiers", choices=(*CHECKPOINTING, "skip"))
    ap.add_argument("--dir", type=Path, required=True, help="where the runs write (emptied)")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="start no run after this many seconds (the rest is reported skipped)")
    ap.add_argument("titan", nargs="*", help="after --: torchtitan arguments for every run")
    return ap.parse_args()


def plan(args: object) -> list[tuple[str, Spec]]:
    """(name, spec) of every timed run, in order."""
    base = {"flavor": args.flavor, "attention": args.attention, "extra": args.titan}
    runs = [("none", Spec("none", steps=args.steps, interval=args.interval, **base))]
    runs += [(f"{m}/{args.interval}", Spec(m, steps=args.steps, interval=args.interval, **base))
             for m in CHECKPOINTING]
    if args.every_step_steps:
        runs += [(f"{m}/1", Spec(m, steps=args.every_step_steps, interval=1, **base))
                 for m in CHECKPOINTING]
    return runs


def timed(name: str, spec: Spec, root: Path) -> tuple[dict, Outcome]:
    """One run; its figures (the trainer's summary, or the log's tail where it failed)."""
    folder, memory = root / name.replace("/", "_"), SHM / f"bench_titan_{name.replace('/', '_')}"
    started = time.perf_counter()
    try:
        out = run(spec.command(folder, memory), root / f"{name.replace('/', '_')}.log")
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
        row.update({k: out.summary[k] for k in ("mean_step_s", "median_step_s", "max_step_s",
                                                "steps_timed", "checkpoints_persisted")})
        log(f"{name}: median step {row['median_step_s']:.4f} s, mean {row['mean_step_s']:.4f} s,"
            f" max {row['max_step_s']:.4f} s; persisted {row['checkpoints_persisted']}")
    return row, out


def tables(res: dict) -> list[Table]:
    rows = res.get("runs", [])
    base = next((r for r in rows if r["mode"] == "none" and "median_step_s" in r), {})
    t = Table(f"torchtitan llama3 {res['args']['flavor']}: step time vs no checkpoint",
              [("run", ""), ("steps", "d"), ("mean s", ".4f"), ("median s", ".4f"),
               ("max s", ".4f"), ("mean vs none", "+.1f%"), ("median vs none", "+.1f%"),
               ("persisted", "d"), ("first step s", ".1f")],
              ["stock: torchtitan CheckpointManager, async_with_pinned_mem; enable: "
               "enable_datastates(trainer.checkpointer); tiers: DataStatesCheckpointManager "
               "memory_tier=True", "name/N: a checkpoint every N steps; persisted: checkpoints "
               "committed to the checkpoint folder (the last step's included)"])
    for r in rows:
        t.add(r["name"], r["steps"], r.get("mean_step_s"), r.get("median_step_s"),
              r.get("max_step_s"), _pct(r.get("mean_step_s"), base.get("mean_step_s")),
              _pct(r.get("median_step_s"), base.get("median_step_s")),
              len(r["checkpoints_persisted"]) if "checkpoints_persisted" in r else None,
              r.get("first_step_s"))
    out = [t]
    if res.get("resume"):
        v = res["resume"]
        rt = Table(f"Resume after SIGKILL ({res['args']['resume_mode']})",
                   [("losses equal", ""), ("killed after", "d"), ("newest committed", "d"),
                    ("restarted at", "d"), ("restored from", ""), ("steps compared", "d"),
                    ("first step after restart s", ".1f")], v.get("problems", []))
        rt.add("yes" if v.get("ok") else "NO", v.get("killed_after_step"),
               v.get("newest_committed"), v.get("resumed_at_step"),
               str(v.get("restored_from") or "torchtitan's folder"), v.get("steps_compared"),
               v.get("restart_first_step_s"))
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
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    bench = Run("bench_torchtitan", args, [args.dir, SHM])
    bench.header()
    bench.res.update(runs=[], skipped=[], resume=None)
    outcomes: dict[str, Outcome] = {}
    runs = plan(args)
    for name, spec in runs[:1 + len(CHECKPOINTING)]:  # none and the interval runs
        outcomes[name] = timed_within_budget(bench, args, name, spec)
    resume(bench, args, outcomes.get(f"{args.resume_mode}/{args.interval}"))
    for name, spec in runs[1 + len(CHECKPOINTING):]:  # the every-step runs
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


def resume(bench: Run, args: object, reference: Outcome | None) -> None:
    """The resume check (the interval run of its mode, if it succeeded, is its reference)."""
    if args.resume_mode == "skip" or over_budget(bench, args, "resume"):
        return
    spec = Spec(args.resume_mode, args.flavor, args.attention, args.steps, args.interval,
                args.titan)
    ok = reference is not None and reference.rc == 0
    bench.res["resume"] = bench.guard("resume", resume_check, spec, args.dir / "resume",
                                      reference if ok else None)
    bench.write()

if __name__ == "__main__":
    main()
