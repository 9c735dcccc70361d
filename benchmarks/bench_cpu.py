"""Save/load throughput of DataStatesWriter/Reader vs DCP's FileSystemWriter/Reader on CPU.

One run, one random state dict (model + optimizer look-alike: 8 bf16 weights with an fp32
moment each, 64 small blocks), every target directory: ``dcp.save`` (durable: both writers
fsync) and ``dcp.load`` into a preallocated state dict, cold (page cache dropped) and warm on
disk, plus the ceilings measured in the same run (disk: O_DIRECT write and read as dd does
them; tmpfs and warm loads: one write of the state's bytes and one read back). Medians over
``--reps`` repetitions; the order of the two sides alternates between repetitions.

    python benchmarks/bench_cpu.py --size 4GiB --reps 3
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch.distributed.checkpoint as dcp
from harness.ceilings import GiB, disk_ceiling, drop_cache, memory_ceiling
from harness.machine import free_bytes, fstype, meminfo, require
from harness.plots import bars, figure, save
from harness.run import Run, log, parser
from harness.states import blank, byte_views, model_state, poison, state_bytes, tensors, verify
from harness.tables import Table
from harness.timing import median, prewarm, rotated, timed
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, parse_size
from dcp_datastates._sizes import format_size

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
SIDES = ("dcp", "ours")


def ceilings(root: Path, tmpfs: bool, state: dict, dest: dict, nbytes: int) -> dict:
    """GiB/s each operation could reach here with ``nbytes``: a write of the state's bytes and
    a read back into the load destination (tmpfs; on disk: warm loads), and on disk an
    O_DIRECT write and cold read."""
    mem = memory_ceiling(root, byte_views(state, nbytes), byte_views(dest, nbytes))
    if tmpfs:
        return {"save": mem["write_gib_s"], "load": mem["read_gib_s"]}
    disk = disk_ceiling(root, nbytes)
    return {"save": disk["write_gib_s"], "load cold": disk["read_gib_s"],
            "load warm": mem["read_gib_s"]}


def save_ckpt(state: dict, path: Path, writer: DataStatesWriter | None) -> None:
    """``dcp.save``; ``writer`` None means DCP's FileSystemWriter (fsyncs: sync_files=True)."""
    w = writer if writer is not None else FileSystemWriter(path)
    dcp.save(state, checkpoint_id=path, storage_writer=w, no_dist=True)


def load_ckpt(dest: dict, path: Path, side: str, engine: Engine) -> None:
    reader = FileSystemReader(path) if side == "dcp" else DataStatesReader(engine=engine)
    dcp.load(dest, checkpoint_id=path, storage_reader=reader, no_dist=True)


def check_room(targets: dict[Path, str], total: int, cache: int, ceil: int) -> None:
    """The state, its copy to load into, two checkpoints per target, the ceiling files."""
    for t, kind in targets.items():
        need = int(2.05 * total) + ceil + (cache if kind == "tmpfs" else 0) + (64 << 20)
        require(str(t), need, free_bytes(t), "2 checkpoints + ceiling test; lower --size")
    ram = 2 * total + cache + sum(int(2.05 * total) + ceil
                                  for kind in targets.values() if kind == "tmpfs") + (512 << 20)
    require("RAM", ram, meminfo("MemAvailable"),
            "state + load destination + host cache + tmpfs checkpoints; lower --size")


def tables(res: dict) -> list[Table]:
    gib = res["size_bytes"] / GiB
    t = Table(f"{res['size_h']} state, {res['reps']} reps, medians; ours vs DCP = DCP's time / "
              "ours; ceilings measured in the same run",
              [("target", ""), ("operation", ""), ("DCP s", ".3f"), ("ours s", ".3f"),
               ("DCP GiB/s", ".2f"), ("ours GiB/s", ".2f"), ("ours vs DCP", ".2fx"),
               ("ceiling GiB/s", ".2f"), ("ours % ceiling", ".0f%"), ("goal", "")])
    res["summary"] = []
    for label, ops in res["times_s"].items():
        goal = 3.0 if "(tmpfs)" in label else 1.5
        for op, d in ops.items():
            dcp_s, ours_s = median(d["dcp"]), median(d["ours"])
            ceil = median(res["ceilings_gib_s"][label][op])
            row = {"target": label, "op": op, "dcp_s": dcp_s, "ours_s": ours_s,
                   "dcp_gib_s": gib / dcp_s, "ours_gib_s": gib / ours_s,
                   "speedup": dcp_s / ours_s, "ceiling_gib_s": ceil,
                   "ours_pct_ceiling": 100 * gib / ours_s / ceil, "goal": goal}
            res["summary"].append(row)
            t.add(*(row[k] for k in ("target", "op", "dcp_s", "ours_s", "dcp_gib_s",
                                     "ours_gib_s", "speedup", "ceiling_gib_s",
                                     "ours_pct_ceiling")),
                  f"{'met' if row['speedup'] >= goal else 'MISSED'} {goal}x")
    t.notes = [f"{res['n_tensors']} tensors; DCP: a fresh FileSystemWriter/Reader per call; "
               "ours: one DataStatesWriter on an Engine with a "
               f"{format_size(res['host_cache_bytes'])} host cache made once in "
               f"{res['host_cache_create_s']:.3f} s (excluded); "
               f"io backend {res['io_backend']}; cold reads via {res['cold_reads']}; prewarm "
               f"{'on' if res['prewarm'] else 'off'}"]
    t.notes += [f"per rep (s), {label} {op}: " + "; ".join(
        f"{side} " + " / ".join(f"{x:.2f}" for x in d[side]) for side in SIDES)
        for label, ops in res["times_s"].items() for op, d in ops.items()]
    return [t]


def plot(res: dict, png: Path) -> None:
    rows = res["summary"]
    fig, (ax,) = figure(size=(max(6.0, 1.7 * len(rows)), 4.8))
    bars(ax, [r["target"].replace(" (", "\n(") + "\n" + r["op"] for r in rows],
         {"DCP FileSystemWriter/Reader": [r["dcp_gib_s"] for r in rows],
          "DataStatesWriter/Reader": [r["ours_gib_s"] for r in rows]},
         ceilings={j: (r["ceiling_gib_s"], f"ceiling {r['ceiling_gib_s']:.2f}")
                   for j, r in enumerate(rows)},
         ylabel="GiB/s (state bytes / median time)")
    m = res["machine"]
    save(fig, png, f"{res['size_h']} state, {res['reps']} reps; {m['cpu']}, {m['cores']} cores, "
                   f"torch {m['torch']}, io={res['io_backend']}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--size", default="4GiB", help="total state bytes (default 4GiB)")
    ap.add_argument("--targets", nargs="+", default=["/tmp/bench_disk", "/dev/shm/bench_shm"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-cache-size", default="1GiB",
                    help="DataStatesWriter host cache; dcp.save (no staging) only uses its bounce "
                    "pool (<= 256 MiB), so more only costs RAM (default 1GiB)")
    ap.add_argument("--ceiling-size", default="1GiB", help="bytes moved by the ceiling tests")
    ap.add_argument("--prewarm", action="store_true",
                    help="before each save (and ceiling test) touch and free --size bytes of RAM, "
                    "untimed: on VMs whose host reclaims free guest memory a page's first touch "
                    "costs ~10 us, which otherwise dominates tmpfs and page-cache writes")
    args = ap.parse_args()
    total = parse_size(args.size, name="--size")
    cache = parse_size(args.host_cache_size, name="--host-cache-size")
    ceil_bytes = min(parse_size(args.ceiling_size, name="--ceiling-size"), total)
    targets = [Path(t).resolve() for t in args.targets]
    for t in targets:
        t.mkdir(parents=True, exist_ok=True)
    kinds = {t: fstype(t) for t in targets}
    check_room(kinds, total, cache, ceil_bytes)
    run = Run("bench_cpu", args, targets)
    run.header()

    warm = total if args.prewarm else 0
    t0 = time.perf_counter()
    state = model_state(total, layers=8, moments=1)
    dest = blank(state)
    nbytes = state_bytes(state)
    log(f"state: {format_size(nbytes)} in {len(tensors(state))} tensors "
        f"(built in {time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    engine = Engine(host_cache_size=cache)
    engine.reserve(cache // 2).release()  # maps the host cache, starts the I/O backend
    _ = engine.arenas.bounce
    writer = DataStatesWriter(engine=engine, overwrite=True)
    cache_s = time.perf_counter() - t0
    log(f"DataStatesWriter host cache {format_size(cache)} created in {cache_s:.3f} s "
        "(one-time, excluded)")

    times: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # target/op/side
    ceils: dict = defaultdict(lambda: defaultdict(list))  # target -> op -> [GiB/s]
    ours_stats: list = []
    evict = "n/a"
    for rep in range(args.reps):
        order = rotated(SIDES, rep + 1)
        for target in targets:
            label = f"{target} ({kinds[target]})"
            tmpfs = kinds[target] == "tmpfs"
            root = target / f"rep{rep}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            prewarm(warm)
            ceil = ceilings(root, tmpfs, state, dest, ceil_bytes)
            for op, v in ceil.items():
                ceils[label][op].append(v)
            rec = times[label]
            ckpt = {side: root / side for side in SIDES}
            for side in order:
                prewarm(warm)
                s = timed(save_ckpt, state, ckpt[side], writer if side == "ours" else None)
                rec["save"][side].append(s)
                if side == "ours":
                    st = writer.last_stats()
                    ours_stats.append({"target": label, "rep": rep, "backend": st.backend,
                                       "flush_s": st.flush_s, "durable_s": st.durable_s,
                                       "total_s": s, "o_direct": st.direct_io})
            for side in order:
                poison(dest)
                if not tmpfs:
                    evict = drop_cache([root])
                how = (dest, ckpt[side], side, engine)
                rec["load" if tmpfs else "load cold"][side].append(timed(load_ckpt, *how))
                verify(state, dest, f"{label} rep {rep} {side}")
                if not tmpfs:
                    rec["load warm"][side].append(timed(load_ckpt, *how))
            shutil.rmtree(root)
            cur = {op: {k: round(v[-1], 3) for k, v in d.items()} for op, d in rec.items()}
            log(f"rep {rep} {label}: seconds {cur}; ceiling GiB/s "
                f"{ {op: round(v, 2) for op, v in ceil.items()} }")
    for t in targets:
        try:
            t.rmdir()
        except OSError:
            pass
    engine.close()

    run.res.update(size_bytes=nbytes, size_h=format_size(nbytes), n_tensors=len(tensors(state)),
                   reps=args.reps, host_cache_bytes=cache, host_cache_create_s=cache_s,
                   io_backend=writer.last_stats().backend, cold_reads=evict,
                   prewarm=args.prewarm, times_s=times, ceilings_gib_s=ceils,
                   ours_save_stats=ours_stats)
    run.finish(tables, plot)


if __name__ == "__main__":
    main()
