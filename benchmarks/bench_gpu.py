"""GPU checkpoint benchmark: DCP save / async_save variants vs DataStatesWriter, side by side.

One bf16 state on the GPU (32 large tensors plus small ones). Per variant and repetition: how
long the call blocks, when the snapshot is done, when the checkpoint is durable, then cold and
warm loads into a preallocated GPU state (checked bit-exact outside the timings). Ceilings
(D2H/H2D pinned copies, dd O_DIRECT write and read) are re-measured in every repetition.
Medians over --reps; a compact table is printed at the end, PNG + JSON go to --out.

    python benchmarks/bench_gpu.py --size 8GiB --reps 3 --dir /tmp/bench_gpu
    python benchmarks/bench_gpu.py --cpu-smoke        # tiny state on CPU: exercises the code paths
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from common import (
    DoneAt,
    GiB,
    disk_ceiling,
    drop_cache,
    fmt,
    free_bytes,
    fstype,
    guarded,
    log,
    machine,
    median,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, parse_size
from dcp_datastates.sizes import format_size

VARIANTS = {
    "dcp_save": "dcp.save FileSystemWriter",
    "dcp_async": "dcp.async_save default",
    "dcp_async_pinned": "dcp.async_save DefaultStager(pinned)",
    "ours": "async_save DataStatesWriter(), fresh per save, defaults",
    "ours_tuned": "async_save one DataStatesWriter, own Engine sized to the state",
}
OURS = ("ours", "ours_tuned")
HIDDEN = 4096
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
N_LARGE = 32
N_SMALL = 64
METRICS = ("block_s", "snapshot_s", "durable_s", "load_cold_s", "load_warm_s")


# -- state ---------------------------------------------------------------------------------------
def make_state(total: int, device: str) -> dict:
    """32 bf16 tensors of total/32 bytes each, 64 small bf16 vectors, 32 fp32 scalars, an int."""
    rows = max(1, total // (N_LARGE * HIDDEN * 2))
    torch.manual_seed(0)
    model = {}
    for i in range(N_LARGE):
        model[f"layers.{i}.weight"] = torch.randn(rows, HIDDEN, device=device).bfloat16()
    for i in range(N_SMALL):
        model[f"layers.{i}.norm.weight"] = torch.randn(HIDDEN, device=device).bfloat16()
    optim = {f"state.{i}.step": torch.tensor(float(i), device=device) for i in range(N_LARGE)}
    return {"model": model, "optim": optim, "step": 1000}


def tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def empty_like_state(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    return torch.empty_like(obj) if isinstance(obj, torch.Tensor) else obj


def poison(dest: dict) -> None:
    for t in tensors(dest):
        t.fill_(-3)
    dest["step"] = -1


def verify(src: dict, dst: dict, what: str) -> None:
    """Raise unless every tensor of ``dst`` equals ``src`` bit for bit."""
    bits = [a.reshape(-1).view(torch.uint8) for a in tensors(src)]
    got = [b.reshape(-1).view(torch.uint8) for b in tensors(dst)]
    bad = sum(not torch.equal(a, b) for a, b in zip(bits, got, strict=True))
    if bad or dst["step"] != src["step"]:
        raise RuntimeError(f"{what}: loaded state differs from the saved one ({bad} tensors)")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- ceilings ------------------------------------------------------------------------------------
def copy_ceiling(nbytes: int = GiB, reps: int = 5) -> dict:
    """Pinned D2H and H2D bandwidth of one ``nbytes`` copy (median of ``reps``), GiB/s."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h_gib_s", host, dev), ("h2d_gib_s", dev, host)):
        dst.copy_(src, non_blocking=True)
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / GiB / median(times)
    return out


# -- one variant ---------------------------------------------------------------------------------
class Ctx:
    """What lives across repetitions: the state, its load target, our writer/reader, DCP stager."""

    def __init__(self, state: dict, dest: dict) -> None:
        self.state, self.dest = state, dest
        self.engine: Engine | None = None  # ours_tuned: made once, sized, warmed
        self.writer: DataStatesWriter | None = None
        self.stager: DefaultStager | None = None
        self.dest_is_gpu = False


def pinned_stager(gpu: bool) -> DefaultStager:
    """DCP's own fast stager: pinned memory, async staging, non-blocking copies (GPU only)."""
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=gpu))


def save(kind: str, ctx: Ctx, path: Path) -> dict:
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
        # A fresh stager per save: reusing one raises KeyError(<class 'type'>) in torch 2.11's
        # StateDictStager deep copy (seen on the H100 machine), so each save pins anew.
        ctx.stager = pinned_stager(gpu=ctx.dest_is_gpu)
        resp = dcp.async_save(ctx.state, checkpoint_id=path, storage_writer=FileSystemWriter(path),
                              async_stager=ctx.stager, no_dist=True)
    else:
        writer = ctx.writer if kind == "ours_tuned" else DataStatesWriter(overwrite=True)
        resp = dcp.async_save(ctx.state, checkpoint_id=path, storage_writer=writer, no_dist=True)
    block = time.perf_counter() - t0
    staging = getattr(resp, "staging_completion", None)  # a plain Future: staging was blocking
    upload = getattr(resp, "upload_completion", resp)
    snap_at = DoneAt(staging) if staging is not None else None
    durable_at = DoneAt(upload)
    upload.result()
    if staging is not None:
        staging.result()
    if kind == "dcp_async_pinned":
        ctx.stager.close()
    out = {"block_s": block, "snapshot_s": snap_at.wait() - t0 if snap_at else block,
           "durable_s": durable_at.wait() - t0}
    if kind in OURS:
        st = writer.last_stats()
        out.update(backend=st.backend, o_direct=st.direct_io, bytes_written=st.bytes_written,
                   flush_s=st.flush_s, stats_durable_s=st.durable_s)
    return out


def load(kind: str, ctx: Ctx, path: Path) -> float:
    reader = (DataStatesReader(engine=ctx.engine if kind == "ours_tuned" else None)
              if kind in OURS else FileSystemReader(path))
    poison(ctx.dest)
    sync()
    t0 = time.perf_counter()
    dcp.load(ctx.dest, checkpoint_id=path, storage_reader=reader, no_dist=True)
    sync()
    t = time.perf_counter() - t0
    verify(ctx.state, ctx.dest, f"{kind} load from {path}")
    return t


def run_variant(kind: str, ctx: Ctx, root: Path, do_load: bool, rec: dict) -> None:
    path = root / kind
    try:
        rec.update(save(kind, ctx, path))
        if do_load:
            rec["evict"] = drop_cache([path])
            rec["load_cold_s"] = load(kind, ctx, path)
            rec["load_warm_s"] = load(kind, ctx, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()


# -- setup, report -------------------------------------------------------------------------------
def setup(args: argparse.Namespace, ctx: Ctx, nbytes: int, kinds: list[str], res: dict) -> None:
    """Build the one-time pieces (timed separately, never inside a repetition)."""
    errs = res["errors"]
    if "ours_tuned" in kinds:
        cache = (parse_size(args.host_cache_size, name="--host-cache-size")
                 if args.host_cache_size else nbytes + (512 << 20))
        log(f"ours_tuned: host_cache_size {format_size(cache)}")

        def build() -> None:
            t0 = time.perf_counter()
            ctx.engine = Engine(host_cache_size=cache)
            ctx.engine.reserve(nbytes).release()  # map, pin and register once, off the clock
            _ = ctx.engine.bounce
            ctx.writer = DataStatesWriter(engine=ctx.engine, overwrite=True)
            res["setup"]["ours_tuned_engine_s"] = time.perf_counter() - t0

        guarded("setup ours_tuned", build, errs)
        if ctx.writer is None:
            kinds.remove("ours_tuned")
    ctx.dest_is_gpu = not args.cpu_smoke
    for k, v in res["setup"].items():
        log(f"one-time {k}: {v:.2f} s (excluded from the timings)")


def summarize(res: dict) -> list[dict]:
    gib = res["size_bytes"] / GiB
    ceil = {k: median([c.get(k) for c in res["ceilings"]])
            for k in ("write_gib_s", "read_gib_s", "d2h_gib_s", "h2d_gib_s")}
    res["ceiling_medians"] = ceil
    rows = []
    for kind, recs in res["runs"].items():
        recs = [r for r in recs if r.get("rep", 0) >= res["warmup_reps"]] or recs
        row = {"variant": kind, "n": sum("durable_s" in r for r in recs)}
        for m in METRICS:
            row[m] = median([r.get(m) for r in recs])
        for m, c in (("durable_s", "write_gib_s"), ("load_cold_s", "read_gib_s")):
            gbs = gib / row[m] if row[m] else None
            row[m.replace("_s", "_gib_s")] = gbs
            row[m.replace("_s", "_pct_ceiling")] = (
                100 * gbs / ceil[c] if gbs is not None and ceil[c] else None)
        row["load_warm_gib_s"] = gib / row["load_warm_s"] if row["load_warm_s"] else None
        row["snapshot_gib_s"] = gib / row["snapshot_s"] if row["snapshot_s"] else None
        rows.append(row)
    return rows


def print_table(res: dict, rows: list[dict]) -> None:
    c = res["ceiling_medians"]
    m = res["machine"]
    log(f"\n=== bench_gpu: {res['size_h']} state, {res['reps_done']} reps (medians), "
        f"device {res['device']}, dir {res['dir']} ({res['fstype']}) ===")
    log(f"machine: {m.get('gpu', 'no GPU')}; {m['cpu']} x{m['cores']}; torch {m['torch']}; "
        f"python {m['python']}; cuda-bindings {m.get('cuda_bindings')}")
    log(f"ceilings: D2H pinned {fmt(c['d2h_gib_s'], '.1f')} GiB/s, H2D pinned "
        f"{fmt(c['h2d_gib_s'], '.1f')} GiB/s, dd write {fmt(c['write_gib_s'], '.2f')} GiB/s, "
        f"dd read cold {fmt(c['read_gib_s'], '.2f')} GiB/s (cold via "
        f"{res['ceilings'][0]['evict'] if res['ceilings'] else '?'})")
    log("one-time: " + ", ".join(f"{k} {v:.2f} s" for k, v in res["setup"].items()))
    head = (f"{'variant':<36} {'block ms':>9} {'snap s':>7} {'durabl s':>8} {'GiB/s':>6} "
            f"{'%dd-w':>5} {'cold s':>7} {'GiB/s':>6} {'%dd-r':>5} {'warm s':>7} {'GiB/s':>6}")
    log(head + "\n" + "-" * len(head))
    for r in rows:
        log(f"{VARIANTS[r['variant']]:<36} {fmt(r['block_s'] and r['block_s'] * 1e3, '9.1f')} "
            f"{fmt(r['snapshot_s'], '7.3f')} {fmt(r['durable_s'], '8.2f')} "
            f"{fmt(r['durable_gib_s'], '6.2f')} {fmt(r['durable_pct_ceiling'], '5.0f')} "
            f"{fmt(r['load_cold_s'], '7.2f')} {fmt(r['load_cold_gib_s'], '6.2f')} "
            f"{fmt(r['load_cold_pct_ceiling'], '5.0f')} {fmt(r['load_warm_s'], '7.2f')} "
            f"{fmt(r['load_warm_gib_s'], '6.2f')}")
    ours = next((r for r in rows if r["variant"] == "ours"), None)
    if ours:
        snap_goal = 0.35 * res["size_bytes"] / (8 * GiB)
        goals = [
            ("call blocks <= 10 ms", ours["block_s"], lambda v: v * 1e3 <= 10, "{:.1f} ms", 1e3),
            (f"snapshot done <= {snap_goal:.3f} s (0.35 s per 8 GiB)", ours["snapshot_s"],
             lambda v: v <= snap_goal, "{:.3f} s", 1),
            ("durable >= 90% of dd O_DIRECT write", ours["durable_pct_ceiling"],
             lambda v: v >= 90, "{:.0f}%", 1),
            ("cold load >= 90% of dd O_DIRECT read", ours["load_cold_pct_ceiling"],
             lambda v: v >= 90, "{:.0f}%", 1),
        ]
        log("goals (ours):")
        for name, v, ok, spec, scale in goals:
            verdict = "n/a" if v is None else ("met" if ok(v) else "MISSED")
            shown = "-" if v is None else spec.format(v * scale)
            log(f"  {name:<46} {shown:>9}  {verdict}")
        by = {r["variant"]: r for r in rows}
        for base in ("dcp_save", "dcp_async", "dcp_async_pinned"):
            b = by.get(base)
            if not b:
                continue
            parts = [f"{m[:-2]} {b[m] / ours[m]:.1f}x" for m in METRICS
                     if b.get(m) and ours.get(m)]
            if parts:
                log(f"  speedup vs {VARIANTS[base]}: " + ", ".join(parts))
        st = [r for r in res["runs"]["ours"] if "backend" in r]
        if st:
            log(f"  ours: backend {st[-1]['backend']}, O_DIRECT {st[-1]['o_direct']}, flush "
                f"{median([r['bytes_written'] / GiB / r['flush_s'] for r in st]):.2f} GiB/s")
    if res["errors"]:
        log("errors: " + "; ".join(f"{k}: {v[0]}" + (f" (x{len(v)})" if len(v) > 1 else "")
                                   for k, v in res["errors"].items()))


def plot(res: dict, rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(METRICS))]
        bars = ax1.bar(xs, [r[m] or 0 for m in METRICS], width, label=VARIANTS[r["variant"]])
        ax1.bar_label(bars, labels=[fmt(r[m], ".3g") for m in METRICS], fontsize=6, rotation=90)
    ax1.set_xticks(range(len(METRICS)), [m[:-2].replace("_", " ") for m in METRICS])
    ax1.set_yscale("log")
    ax1.set_ylabel("seconds (median, log scale)")
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    ops = ("snapshot_gib_s", "durable_gib_s", "load_cold_gib_s", "load_warm_gib_s")
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(ops))]
        bars = ax2.bar(xs, [r[m] or 0 for m in ops], width, label=VARIANTS[r["variant"]])
        ax2.bar_label(bars, labels=[fmt(r[m], ".2f") for m in ops], fontsize=6, rotation=90)
    c = res["ceiling_medians"]
    for j, key, name in ((0, "d2h_gib_s", "D2H pinned"), (1, "write_gib_s", "dd write"),
                         (2, "read_gib_s", "dd read")):
        if c.get(key):
            ax2.hlines(c[key], j - 0.45, j + 0.45, colors="k", linestyles="--")
            ax2.annotate(f"{name} {c[key]:.1f}", (j, c[key]), fontsize=7, ha="center",
                         va="bottom")
    ax2.set_xticks(range(len(ops)), [m[:-6].replace("_", " ") for m in ops])
    ax2.set_yscale("log")
    ax2.set_ylabel("GiB/s (state / median time, log scale)")
    fig.suptitle(f"{res['size_h']} bf16 state, {res['reps_done']} reps; "
                 f"{res['machine'].get('gpu', 'CPU')}; torch {res['machine']['torch']}", fontsize=9)
    for ax in (ax1, ax2):
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(png, dpi=120)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8GiB", help="state bytes (default 8GiB)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1,
                    help="first reps left out of the medians (the default engine sizes its "
                         "cache in the first save; DCP's first save warms up too)")
    ap.add_argument("--dir", default="/tmp/bench_gpu", help="checkpoint directory (on the disk)")
    ap.add_argument("--out", default="benchmarks/out", help="folder for the PNG and JSON")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(VARIANTS), metavar="VARIANT",
                    help=f"variants to leave out: {', '.join(VARIANTS)}")
    ap.add_argument("--load-all", action="store_true",
                    help="also load the dcp_async* checkpoints (same format as dcp_save's)")
    ap.add_argument("--dd-size", default="4GiB", help="bytes for the dd ceiling (default 4GiB)")
    ap.add_argument("--host-cache-size", default=None, help="ours (default: state + 512MiB)")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds: start no repetition that would end after this (default 480)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="64MiB state on CPU, no GPU-only measurements (debugging)")
    args = ap.parse_args()
    if args.cpu_smoke:
        if args.size == "8GiB":
            args.size = "64MiB"
        if args.dd_size == "4GiB":
            args.dd_size = "64MiB"
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu-smoke to check the script on CPU")
    device = "cpu" if args.cpu_smoke else "cuda"
    kinds = [k for k in VARIANTS if k not in args.skip]
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_gpu_cpu_smoke" if args.cpu_smoke else "bench_gpu"

    state = make_state(parse_size(args.size, name="--size"), device)
    dest = empty_like_state(state)
    poison(dest)
    sync()
    nbytes = sum(t.nbytes for t in tensors(state))
    need = 2 * nbytes + parse_size(args.dd_size) + (256 << 20)
    if free_bytes(root) < need:
        sys.exit(f"{root}: needs {format_size(need)} free, has {format_size(free_bytes(root))}")
    res = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine(torch),
           "device": device, "size_bytes": nbytes, "size_h": format_size(nbytes),
           "n_tensors": len(tensors(state)), "dir": str(root), "fstype": fstype(root),
           "setup": {}, "ceilings": [], "runs": {k: [] for k in kinds}, "errors": {},
           "reps_done": 0, "warmup_reps": args.warmup}
    log(f"state: {format_size(nbytes)} in {len(tensors(state))} tensors on {device}; "
        f"variants {kinds}; dir {root} ({res['fstype']})")
    ctx = Ctx(state, dest)
    try:
        setup(args, ctx, nbytes, kinds, res)
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
                ceil.update(guarded("ceiling copy", copy_ceiling, res["errors"]) or {})
            ceil.update(guarded("ceiling dd", disk_ceiling, res["errors"], rep_dir,
                                parse_size(args.dd_size)) or {})
            res["ceilings"].append(ceil)
            log(f"rep {rep} ceilings: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ceil.items()))
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]  # rotate the order
            for kind in order:
                rec: dict = {"rep": rep}
                do_load = kind in ("dcp_save", *OURS) or args.load_all
                guarded(f"{kind}", run_variant, res["errors"], kind, ctx, rep_dir, do_load, rec)
                res["runs"][kind].append(rec)
                log(f"rep {rep} {kind}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in rec.items() if k.endswith("_s")))
            shutil.rmtree(rep_dir, ignore_errors=True)
            res["reps_done"] = rep + 1
            rep_s = time.perf_counter() - t_rep
            log(f"rep {rep} took {rep_s:.1f} s (elapsed {time.perf_counter() - t_start:.0f} s)")
            (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    finally:
        if ctx.stager is not None:
            ctx.stager.close()
        if ctx.engine is not None:
            ctx.engine.close()
    rows = summarize(res)
    res["summary"] = rows
    res["total_s"] = time.perf_counter() - t_start
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    guarded("plot", plot, res["errors"], res, rows, out / f"{stem}.png")
    log(f"wrote {out / (stem + '.png')} and {out / (stem + '.json')}; "
        f"total {res['total_s']:.0f} s")
    print_table(res, rows)


if __name__ == "__main__":
    main()
