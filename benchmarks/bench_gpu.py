"""GPU checkpoint benchmark: DCP save / async_save variants vs DataStatesWriter, side by side.

One bf16 state on the GPU (32 large tensors plus small ones). Per variant and repetition: how
long the call blocks, when the snapshot is done, when the checkpoint is durable, then cold and
warm loads into a preallocated GPU state (checked bit-exact outside the timings). Ceilings
(D2H/H2D pinned copies, O_DIRECT disk write and read as dd does them) are re-measured in every
repetition. Medians over --reps past --warmup; tables print at the end, JSON + PNG to --json.

    python benchmarks/bench_gpu.py --size 8GiB --reps 4 --budget 400 --dir /tmp/bench_gpu
    python benchmarks/bench_gpu.py --cpu-smoke        # tiny state on CPU: exercises the code paths
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from harness.baselines import async_save_pinned, futures
from harness.ceilings import GiB, copy_ceiling, disk_ceiling, drop_cache
from harness.machine import free_bytes, require
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.states import blank, model_state, poison, state_bytes, tensors, verify
from harness.tables import Table, fmt, ratio, ratio_table
from harness.timing import DoneAt, median, rotated, sync, timed
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, parse_size
from dcp_datastates._sizes import format_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
VARIANTS = {
    "dcp_save": "dcp.save FileSystemWriter",
    "dcp_async": "dcp.async_save default",
    "dcp_async_pinned": "dcp.async_save DefaultStager(pinned)",
    "ours": "ours: DataStatesWriter() per save, defaults",
    "ours_tuned": "ours_tuned: one writer, sized engine",
}
OURS = ("ours", "ours_tuned")
METRICS = {"block_s": "block", "snapshot_s": "snapshot", "durable_s": "durable",
           "load_cold_s": "cold load", "load_warm_s": "warm load"}
CEILINGS = ("d2h_gib_s", "h2d_gib_s", "write_gib_s", "read_gib_s")


class Ctx:
    """What lives across repetitions: the state, its load target, our tuned engine and writer."""

    def __init__(self, state: dict, dest: dict, gpu: bool) -> None:
        self.state, self.dest, self.gpu = state, dest, gpu
        self.engine: Engine | None = None  # ours_tuned: made once, sized, warmed
        self.writer: DataStatesWriter | None = None


def save_ckpt(kind: str, ctx: Ctx, path: Path) -> dict:
    """Save ``ctx.state`` to ``path`` the ``kind`` way; seconds from the call's start."""
    sync()
    t0 = time.perf_counter()
    if kind == "dcp_save":
        dcp.save(ctx.state, checkpoint_id=path, storage_writer=FileSystemWriter(path),
                 no_dist=True)
        t = time.perf_counter() - t0
        return {"block_s": t, "snapshot_s": t, "durable_s": t}
    if kind == "dcp_async":
        resp = dcp.async_save(ctx.state, checkpoint_id=path, storage_writer=FileSystemWriter(path),
                              no_dist=True)
    elif kind == "dcp_async_pinned":
        resp = async_save_pinned(ctx.state, path, ctx.gpu)
    else:
        writer = ctx.writer if kind == "ours_tuned" else DataStatesWriter(overwrite=True)
        resp = dcp.async_save(ctx.state, checkpoint_id=path, storage_writer=writer, no_dist=True)
    block = time.perf_counter() - t0
    staging, upload = futures(resp)
    snap_at = DoneAt(staging) if staging is not None else None
    durable_at = DoneAt(upload)
    upload.result()
    if staging is not None:
        staging.result()
    out = {"block_s": block, "snapshot_s": snap_at.wait() - t0 if snap_at else block,
           "durable_s": durable_at.wait() - t0}
    if kind in OURS:
        st = writer.last_stats()
        out.update(backend=st.backend, o_direct=st.direct_io, bytes_written=st.bytes_written,
                   flush_s=st.flush_s, stats_durable_s=st.durable_s)
    return out


def load_ckpt(kind: str, ctx: Ctx, path: Path) -> float:
    reader = (DataStatesReader(engine=ctx.engine if kind == "ours_tuned" else None)
              if kind in OURS else FileSystemReader(path))
    poison(ctx.dest)
    t = timed(dcp.load, ctx.dest, checkpoint_id=path, storage_reader=reader, no_dist=True)
    verify(ctx.state, ctx.dest, f"{kind} load from {path}")
    return t


def run_variant(kind: str, ctx: Ctx, root: Path, do_load: bool, rec: dict) -> None:
    path = root / kind
    try:
        rec.update(save_ckpt(kind, ctx, path))
        if do_load:
            rec["evict"] = drop_cache([path])
            rec["load_cold_s"] = load_ckpt(kind, ctx, path)
            rec["load_warm_s"] = load_ckpt(kind, ctx, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()


def tune(run: Run, ctx: Ctx, nbytes: int, cache_size: str | None) -> None:
    """ours_tuned's engine and writer, built, mapped and pinned once, off the clock."""
    cache = (parse_size(cache_size, name="--host-cache-size") if cache_size
             else nbytes + (512 << 20))
    log(f"ours_tuned: host_cache_size {format_size(cache)}")
    t0 = time.perf_counter()
    ctx.engine = Engine(host_cache_size=cache)
    ctx.engine.reserve(nbytes).release()
    _ = ctx.engine.arenas.bounce
    ctx.writer = DataStatesWriter(engine=ctx.engine, overwrite=True)
    run.res["setup"]["ours_tuned_engine_s"] = time.perf_counter() - t0


def summarize(res: dict) -> list[dict]:
    """Per variant: medians past the warm-up, GiB/s, and % of the ceilings' medians."""
    gib = res["size_bytes"] / GiB
    ceil = res["ceiling_medians"] = {k: median([c.get(k) for c in res["ceilings"]])
                                     for k in CEILINGS}
    rows = []
    for kind, recs in res["runs"].items():
        recs = [r for r in recs if r["rep"] >= res["warmup_reps"]] or recs
        row = {"variant": kind, "n": sum("durable_s" in r for r in recs)}
        for m in METRICS:
            row[m] = median([r.get(m) for r in recs])
            row[m.replace("_s", "_gib_s")] = ratio(gib, row[m])
        row["durable_pct_ceiling"] = ratio(100 * (row["durable_gib_s"] or 0), ceil["write_gib_s"])
        row["load_cold_pct_ceiling"] = ratio(100 * (row["load_cold_gib_s"] or 0),
                                             ceil["read_gib_s"])
        rows.append(row)
    return rows


def goals(res: dict, ours: dict) -> Table:
    snap_goal = 0.35 * res["size_bytes"] / (8 * GiB)
    t = Table("goals (ours: a fresh DataStatesWriter() per save, defaults)",
              [("goal", ""), ("figure", ""), ("verdict", "")])
    for name, v, ok, spec in (
            ("async_save call blocks <= 10 ms", ours["block_s"] and 1e3 * ours["block_s"],
             lambda v: v <= 10, "{:.1f} ms"),
            (f"snapshot done <= {snap_goal:.3f} s (0.35 s per 8 GiB)", ours["snapshot_s"],
             lambda v: v <= snap_goal, "{:.3f} s"),
            ("durable >= 90% of the O_DIRECT write ceiling", ours["durable_pct_ceiling"],
             lambda v: v >= 90, "{:.0f}%"),
            ("cold load >= 90% of the O_DIRECT read ceiling", ours["load_cold_pct_ceiling"],
             lambda v: v >= 90, "{:.0f}%")):
        t.add(name, None if v is None else spec.format(v),
              "n/a" if v is None else ("met" if ok(v) else "MISSED"))
    return t


def tables(res: dict) -> list[Table]:
    rows = res["summary"]
    c = res["ceiling_medians"]
    t = Table(f"{res['size_h']} bf16 state on {res['device']}, {res['reps_done']} reps, medians "
              f"past {res['warmup_reps']} warm-up; dir {res['dir']}",
              [("variant", ""), ("block ms", ".1f"), ("snapshot s", ".3f"), ("durable s", ".2f"),
               ("GiB/s", ".2f"), ("% write ceil", ".0f%"), ("cold load s", ".2f"),
               ("GiB/s", ".2f"), ("% read ceil", ".0f%"), ("warm load s", ".2f"),
               ("GiB/s", ".2f")])
    for r in rows:
        t.add(VARIANTS[r["variant"]], r["block_s"] and r["block_s"] * 1e3, r["snapshot_s"],
              r["durable_s"], r["durable_gib_s"], r["durable_pct_ceiling"], r["load_cold_s"],
              r["load_cold_gib_s"], r["load_cold_pct_ceiling"], r["load_warm_s"],
              r["load_warm_gib_s"])
    t.notes = [f"ceilings (medians): D2H pinned {fmt(c['d2h_gib_s'], '.1f')} GiB/s, H2D "
               f"pinned {fmt(c['h2d_gib_s'], '.1f')} GiB/s, O_DIRECT write "
               f"{fmt(c['write_gib_s'], '.2f')} GiB/s, O_DIRECT cold read "
               f"{fmt(c['read_gib_s'], '.2f')} GiB/s",
               "one-time (excluded): " + ", ".join(f"{k} {v:.2f} s"
                                                   for k, v in res["setup"].items())]
    by = {r["variant"]: r for r in rows}
    if "ours" not in by:
        return [t]
    pairs = {f"{VARIANTS[k]} / ours": (by[k], by["ours"]) for k in VARIANTS
             if k not in OURS and k in by}
    if "ours_tuned" in by:
        pairs["ours / ours_tuned (fresh vs kept writer)"] = (by["ours"], by["ours_tuned"])
    return [t, ratio_table("ratios of median times (> 1: the second is faster)", pairs, METRICS),
            goals(res, by["ours"])]


def plot(res: dict, png: Path) -> None:
    rows = res["summary"]
    fig, (ax1, ax2) = figure(2, size=(13, 4.8))
    bars(ax1, [m.replace("_s", "").replace("_", " ") for m in METRICS],
         {VARIANTS[r["variant"]]: [r[m] for m in METRICS] for r in rows}, spec=".3g", log=True,
         ylabel="seconds (median, log scale)")
    ops = ("snapshot_gib_s", "durable_gib_s", "load_cold_gib_s", "load_warm_gib_s")
    c = res["ceiling_medians"]
    bars(ax2, [m[:-6].replace("_", " ") for m in ops],
         {VARIANTS[r["variant"]]: [r[m] for m in ops] for r in rows}, log=True,
         ceilings={j: (c[k], f"{name} {c[k] or 0:.1f}") for j, k, name in (
             (0, "d2h_gib_s", "D2H pinned"), (1, "write_gib_s", "write"),
             (2, "read_gib_s", "read"))},
         ylabel="GiB/s (state / median time, log scale)")
    save(fig, png, f"{res['size_h']} bf16 state, {res['reps_done']} reps; "
                   f"{res['machine'].get('gpu', 'CPU')}; torch {res['machine']['torch']}")


def main() -> None:
    t_start = time.perf_counter()
    ap = parser(__doc__, smoke="64MiB state on CPU, no GPU-only measurements")
    ap.add_argument("--size", default="8GiB", help="state bytes (default 8GiB)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1,
                    help="first reps left out of the medians (the default engine sizes its "
                         "cache in the first save; DCP's first save warms up too)")
    ap.add_argument("--dir", default="/tmp/bench_gpu", help="checkpoint directory (on the disk)")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(VARIANTS), metavar="VARIANT",
                    help=f"variants to leave out: {', '.join(VARIANTS)}")
    ap.add_argument("--load-all", action="store_true",
                    help="also load the dcp_async* checkpoints (same format as dcp_save's)")
    ap.add_argument("--ceiling-size", default="4GiB",
                    help="bytes for the disk ceiling (default 4GiB)")
    ap.add_argument("--host-cache-size", default=None, help="ours (default: state + 512MiB)")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds: start no repetition that would end after this (default 480)")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.size = "64MiB" if args.size == "8GiB" else args.size
        args.ceiling_size = "64MiB" if args.ceiling_size == "4GiB" else args.ceiling_size
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu-smoke to check the script on CPU")
    device = "cpu" if args.cpu_smoke else "cuda"
    kinds = [k for k in VARIANTS if k not in args.skip]
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)

    state = model_state(parse_size(args.size, name="--size"), device, layers=32)
    dest = blank(state)
    sync()
    nbytes = state_bytes(state)
    require(str(root), 2 * nbytes + parse_size(args.ceiling_size) + (256 << 20),
            free_bytes(root), "2 checkpoints + the ceiling file")
    run = Run("bench_gpu", args, [root])
    run.header()
    res = run.res
    res.update(device=device, size_bytes=nbytes, size_h=format_size(nbytes),
               n_tensors=len(tensors(state)), dir=str(root), setup={}, ceilings=[],
               runs={k: [] for k in kinds}, reps_done=0, warmup_reps=args.warmup)
    log(f"state: {format_size(nbytes)} in {len(tensors(state))} tensors on {device}; "
        f"variants {kinds}")
    ctx = Ctx(state, dest, gpu=not args.cpu_smoke)
    try:
        if "ours_tuned" in kinds:
            run.guard("setup ours_tuned", tune, run, ctx, nbytes, args.host_cache_size)
            if ctx.writer is None:
                kinds.remove("ours_tuned")
        rep_s = 0.0
        for rep in range(args.reps):
            elapsed = time.perf_counter() - t_start
            if rep and elapsed + 1.1 * rep_s > args.budget:
                log(f"stopping after {rep} reps: another (~{rep_s:.0f} s) would pass --budget "
                    f"{args.budget:.0f} s (elapsed {elapsed:.0f} s)")
                break
            t_rep = time.perf_counter()
            rep_dir = root / f"rep{rep}"
            shutil.rmtree(rep_dir, ignore_errors=True)
            rep_dir.mkdir()
            ceil: dict = {}
            if not args.cpu_smoke:
                ceil.update(run.guard("ceiling copy", copy_ceiling) or {})
            ceil.update(run.guard("ceiling disk", disk_ceiling, rep_dir,
                                  parse_size(args.ceiling_size)) or {})
            res["ceilings"].append(ceil)
            log(f"rep {rep} ceilings: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ceil.items()))
            for kind in rotated(kinds, rep):
                rec: dict = {"rep": rep}
                do_load = kind in ("dcp_save", *OURS) or args.load_all
                run.guard(kind, run_variant, kind, ctx, rep_dir, do_load, rec)
                res["runs"][kind].append(rec)
                log(f"rep {rep} {kind}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in rec.items() if k.endswith("_s")))
            shutil.rmtree(rep_dir, ignore_errors=True)
            res["reps_done"] = rep + 1
            rep_s = time.perf_counter() - t_rep
            log(f"rep {rep} took {rep_s:.1f} s (elapsed {time.perf_counter() - t_start:.0f} s)")
            run.write()  # what is done so far survives a kill
    finally:
        if ctx.engine is not None:
            ctx.engine.close()
    res["summary"] = summarize(res)
    run.finish(tables, plot)


if __name__ == "__main__":
    main()
