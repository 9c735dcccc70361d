"""DCP's idiom on CPU: a fresh writer/reader per call, and many tiny tensors, side by side with DCP.

Two scenarios, each run on the same data for DCP's FileSystemWriter/Reader and ours:

* ``fresh``: a 1 GiB fp32 state saved ``--saves`` times into ``--dir`` (default /dev/shm) with
  a new writer per save and default arguments (ours also with one writer kept for the run on an
  engine sized to the state), then loaded as many times with a new reader per load. Medians of
  saves (and loads) 2..N: the first one warms each side up (our engine sizes its cache there).
  The file system's ceiling is measured as many times in the same run: one write of the
  state's bytes into a new file (then fsync) and one read back, no checksums, no planning.
* ``tiny``: ``--tiny`` tensors of a few bytes each (step counters, norms, biases): ``dcp.save``,
  ``dcp.async_save`` until durable, and ``dcp.load``; medians of ``--reps`` after a warm-up.

    python benchmarks/bench_engine.py --dir /dev/shm/bench_engine --saves 6
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from harness.ceilings import memory_ceiling
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.states import blank, byte_views, model_state, poison, state_bytes, tiny_state, verify
from harness.tables import Table, ratio
from harness.timing import median, timed
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine
from dcp_datastates._sizes import format_size, parse_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
FRESH = {"dcp": "DCP", "ours": "ours, fresh", "ours_kept": "ours, one writer kept"}
TINY = {"save_s": "dcp.save", "async_durable_s": "dcp.async_save until durable",
        "load_s": "dcp.load"}


def save_durable(state: dict, path: Path, writer: object) -> None:
    """``dcp.async_save`` until durable (DCP returns a bare Future where it stages in line)."""
    response = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
    getattr(response, "upload_completion", response).result()


def writer_of(side: str, kept: DataStatesWriter | None):
    if side == "dcp":
        return lambda path: FileSystemWriter(path, overwrite=True)
    if side == "ours_kept":
        return lambda path: kept
    return lambda path: DataStatesWriter(overwrite=True)


def reader_of(side: str, engine: Engine | None):
    if side == "dcp":
        return lambda path: FileSystemReader(path)
    return lambda path: DataStatesReader(engine=engine if side == "ours_kept" else None)


def fresh(root: Path, nbytes: int, saves: int) -> dict:
    state = model_state(nbytes, layers=8, small=0, dtype=torch.float32)
    dest = blank(state)
    size = state_bytes(state)
    engine = Engine(host_cache_size=size + (256 << 20))
    kept = DataStatesWriter(engine=engine, overwrite=True)
    ceil = [memory_ceiling(root, byte_views(state), byte_views(dest)) for _ in range(saves)]
    out: dict = {"state_bytes": size, "ceiling_write_s": [c["write_s"] for c in ceil],
                 "ceiling_read_s": [c["read_s"] for c in ceil]}
    log(f"ceiling write {[round(s, 3) for s in out['ceiling_write_s']]}, "
        f"read {[round(s, 3) for s in out['ceiling_read_s']]}")
    try:
        for side in FRESH:
            make_w, make_r = writer_of(side, kept), reader_of(side, engine)
            path = root / side
            save_s = [timed(dcp.save, state, checkpoint_id=path, storage_writer=make_w(path),
                            no_dist=True) for _ in range(saves)]
            poison(dest)
            load_s = [timed(dcp.load, dest, checkpoint_id=path, storage_reader=make_r(path),
                            no_dist=True) for _ in range(saves)]
            verify(state, dest, f"fresh/{side}")
            shutil.rmtree(path, ignore_errors=True)
            out[side] = {"save_s": save_s, "load_s": load_s}
            log(f"fresh {side}: saves {[round(s, 3) for s in save_s]} "
                f"loads {[round(s, 3) for s in load_s]}")
    finally:
        engine.close()
    return out


def tiny(root: Path, n: int, reps: int) -> dict:
    state = tiny_state(n)
    out: dict = {"tensors": n}
    for side in ("dcp", "ours"):
        make_w, make_r = writer_of(side, None), reader_of(side, None)
        rec: dict = {m: [] for m in TINY}
        path, path2 = root / f"tiny_{side}", root / f"tiny_{side}_async"
        for rep in range(reps + 1):
            rec["save_s"].append(timed(dcp.save, state, checkpoint_id=path,
                                       storage_writer=make_w(path), no_dist=True))
            rec["async_durable_s"].append(timed(save_durable, state, path2, make_w(path2)))
            dest = blank(state)
            rec["load_s"].append(timed(dcp.load, dest, checkpoint_id=path,
                                       storage_reader=make_r(path), no_dist=True))
            verify(state, dest, f"tiny/{side} rep {rep}")
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path2, ignore_errors=True)
        out[side] = rec
        log(f"tiny {side}: " + ", ".join(f"{m} {median(v, skip=1):.3f}" for m, v in rec.items()))
    return out


def verdict(x: float, goal: float, below: bool = False) -> str:
    return f"{x:.2f}x {'met' if (x <= goal if below else x >= goal) else 'MISSED'}"


def tables(res: dict) -> list[Table]:
    f, t = res["fresh"], res["tiny"]
    n = len(f["dcp"]["save_s"])
    med = {side: {op: median(f[side][f"{op}_s"], skip=1) for op in ("save", "load")}
           for side in FRESH}
    ceil = {op: median(f[f"ceiling_{rw}_s"], skip=1) for op, rw in (("save", "write"),
                                                                     ("load", "read"))}
    t1 = Table(f"fresh writer per save, {format_size(f['state_bytes'])} fp32 in {res['dir']}, "
               f"medians of saves/loads 2..{n}",
               [("", ""), *((f"{label} s", ".3f") for label in FRESH.values()),
                ("ours vs DCP", ".2fx"), ("fresh / kept", ".2f"), ("ceiling s", ".3f")])
    for op in ("save", "load"):
        d, o, k = (med[side][op] for side in FRESH)
        t1.add(f"dcp.{op}", d, o, k, ratio(d, o), ratio(o, k), ceil[op])
    t1.notes = [
        "ceiling: one write of the state's bytes into a new file (then fsync) and one read "
        "back, no checksums, no planning",
        f"save: DCP takes {ratio(med['dcp']['save'], ceil['save']):.2f}x the ceiling, ours "
        f"{ratio(med['ours']['save'], ceil['save']):.2f}x",
        *(f"per save (s), {label}: " + ", ".join(f"{s:.2f}" for s in f[side]["save_s"])
          for side, label in FRESH.items()),
        f"goals: load >= 3x DCP ({verdict(ratio(med['dcp']['load'], med['ours']['load']), 3)})"
        "; a fresh writer within 10% of a kept one (fresh / kept <= 1.1: save "
        f"{verdict(ratio(med['ours']['save'], med['ours_kept']['save']), 1.1, below=True)}, load "
        f"{verdict(ratio(med['ours']['load'], med['ours_kept']['load']), 1.1, below=True)})"]
    t2 = Table(f"{t['tensors']} tiny tensors (step counters, norms, biases), medians of "
               f"{len(t['ours']['save_s']) - 1} after a warm-up",
               [("", ""), ("DCP s", ".3f"), ("ours s", ".3f"), ("ours vs DCP", ".2fx")])
    for m, label in TINY.items():
        d, o = median(t["dcp"][m], skip=1), median(t["ours"][m], skip=1)
        t2.add(label, d, o, ratio(d, o))
    t2.notes = ["goal: at least DCP's speed for each (" + ", ".join(
        verdict(ratio(median(t["dcp"][m], skip=1), median(t["ours"][m], skip=1)), 1)
        for m in TINY) + ")"]
    return [t1, t2]


def plot(res: dict, png: Path) -> None:
    f, t = res["fresh"], res["tiny"]
    fig, (ax1, ax2) = figure(2, size=(11, 4.4))
    bars(ax1, ["save", "load"], {label: [median(f[side][f"{op}_s"], skip=1)
                                         for op in ("save", "load")]
                                 for side, label in FRESH.items()},
         spec=".3f", ylabel="seconds (median)")
    ax1.set_title(f"fresh writer per save, {format_size(f['state_bytes'])}", fontsize=9)
    bars(ax2, list(TINY.values()), {side: [median(t[side][m], skip=1) for m in TINY]
                                    for side in ("dcp", "ours")}, spec=".2f")
    ax2.set_title(f"{t['tensors']} tiny tensors", fontsize=9)
    save(fig, png, f"{res['machine']['cpu']}, {res['machine']['cores']} cores; {res['dir']}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dir", default="/dev/shm/bench_engine")
    ap.add_argument("--size", default="1GiB", help="bytes of the fresh state (default 1GiB)")
    ap.add_argument("--saves", type=int, default=5, help="saves and loads per side (fresh)")
    ap.add_argument("--tiny", type=int, default=30000, help="how many tiny tensors")
    ap.add_argument("--reps", type=int, default=3, help="tiny: repetitions after a warm-up")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    run = Run("bench_engine", args, [root])
    run.header()
    run.res["dir"] = str(root)
    try:
        run.res["fresh"] = fresh(root, parse_size(args.size), args.saves)
        run.res["tiny"] = tiny(root, args.tiny, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    run.finish(tables, plot)


if __name__ == "__main__":
    main()
