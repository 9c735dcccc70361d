"""Save/load throughput of DataStatesWriter/Reader vs DCP's FileSystemWriter/Reader on CPU.

One run, one random state dict (model + optimizer look-alike), every target directory:
``dcp.save`` (durable: both writers fsync) and ``dcp.load`` into a preallocated state dict,
cold (page cache dropped) and warm on disk, plus the device ceiling measured with dd (disk) or
one large write/read syscall (tmpfs). Medians over ``--reps`` repetitions; the order of the two
sides alternates between repetitions.

    python benchmarks/bench_cpu.py --size 4GiB --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from common import dd, drop_cache, fstype
from plot import plot
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine, parse_size
from dcp_datastates.sizes import format_size

GiB = 2**30
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
SIDES = ("dcp", "ours")
HIDDEN = 4096


# -- state ---------------------------------------------------------------------------------------
def make_state(total: int, n_large: int = 16, n_small: int = 64) -> dict:
    """16 large bf16/fp32 tensors plus ~320 small ones (biases, norms, moments, 0-d steps)."""
    model: dict = {}
    optim: dict = {}
    for i in range(n_small):
        model[f"blocks.{i}.bias"] = torch.empty(HIDDEN, dtype=torch.bfloat16)
        model[f"blocks.{i}.norm.weight"] = torch.empty(HIDDEN)
        optim[f"blocks.{i}.bias"] = {"exp_avg": torch.empty(HIDDEN),
                                     "exp_avg_sq": torch.empty(HIDDEN), "step": torch.empty(())}
    small = sum(t.nbytes for t in _tensors({"m": model, "o": optim}))
    rows = (total - small) // (n_large // 2 * HIDDEN * 6)  # a bf16 weight + an fp32 moment
    if rows < 1:
        raise SystemExit(f"--size {format_size(total)} is too small for this layout")
    for i in range(n_large // 2):
        model[f"layers.{i}.weight"] = torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
        optim[f"layers.{i}.weight"] = {"exp_avg": torch.empty(rows, HIDDEN)}
    state = {"model": model, "optim": {"state": optim}, "epoch": 7}
    for k, t in enumerate(_tensors(state)):
        if t.dim() == 0:
            t.fill_(k)
        else:
            t.normal_()
    return state


def _items(obj: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _items(v, f"{prefix}{k}.")]
    return [(prefix[:-1], obj)]


def _tensors(obj: object) -> list[torch.Tensor]:
    return [v for _, v in _items(obj) if isinstance(v, torch.Tensor)]


def empty_like_state(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    return torch.empty_like(obj) if isinstance(obj, torch.Tensor) else obj


def poison(state: dict) -> None:
    for t in _tensors(state):
        t.fill_(-3)
    state["epoch"] = -1


def verify(src: dict, dst: dict, what: str) -> None:
    bad = [k for (k, a), (_, b) in zip(_items(src), _items(dst), strict=True)
           if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)]
    if bad:
        raise SystemExit(f"{what}: loaded data differs in {len(bad)} entries, e.g. {bad[:3]}")


# -- system helpers ------------------------------------------------------------------------------
def mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) * 1024


def _views(sd: dict, nbytes: int) -> list[memoryview]:
    """Byte views of ``sd``'s largest tensors, ``nbytes`` in all (for one writev / preadv)."""
    out, left = [], nbytes
    for t in sorted(_tensors(sd), key=lambda t: -t.nbytes):
        if left <= 0:
            break
        b = t.reshape(-1).view(torch.uint8)[:left]
        out.append(memoryview(b.numpy()))
        left -= b.numel()
    return out


def _preadv(path: Path, dst: list[memoryview]) -> float:
    """Seconds for one preadv of ``path`` into ``dst``."""
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    n = os.preadv(fd, dst, 0)
    seconds = time.perf_counter() - start
    os.close(fd)
    if n != sum(v.nbytes for v in dst):
        raise RuntimeError(f"short read in the ceiling test: {n} bytes")
    return seconds


def disk_ceiling(root: Path, dest: dict, nbytes: int) -> dict[str, float]:
    """GiB/s of dd O_DIRECT write (+fsync) and O_DIRECT read, and, for warm loads, one preadv
    of the cached file into the load destination (dd to /dev/null would reuse a hot 4 MiB
    buffer and overstate what a load into fresh tensors can do)."""
    f, count = root / "ddtest", max(1, nbytes // (4 << 20))
    n = count * (4 << 20) / GiB
    out = {"save": n / dd("if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "oflag=direct",
                          "conv=fsync")}
    drop_cache([root])
    out["load cold"] = n / dd(f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct")
    dd(f"if={f}", "of=/dev/null", "bs=4M")  # populate the page cache
    out["load warm"] = n / _preadv(f, _views(dest, count * (4 << 20)))
    f.unlink()
    return out


def mem_ceiling(root: Path, state: dict, dest: dict, nbytes: int) -> dict[str, float]:
    """One writev of ``nbytes`` (the state's large tensors) to a new file, one preadv back."""
    src = _views(state, nbytes)
    n = sum(v.nbytes for v in src) / GiB
    f = root / "memtest"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    start = time.perf_counter()
    wrote = os.writev(fd, src)
    os.fsync(fd)
    seconds = time.perf_counter() - start
    os.close(fd)
    if wrote != n * GiB:
        raise RuntimeError(f"short write in the ceiling test: {wrote} bytes")
    out = {"save": n / seconds, "load": n / _preadv(f, _views(dest, nbytes))}
    f.unlink()
    return out


# -- the benchmark -------------------------------------------------------------------------------
def prewarm(nbytes: int) -> None:
    """Touch and free ``nbytes`` of RAM, so that the VM host backs free guest pages again."""
    if nbytes:
        torch.ones(nbytes, dtype=torch.uint8)


def timed(warm: int, fn, *args: object) -> float:
    """Seconds ``fn(*args)`` takes, after ``prewarm(warm)`` (not timed)."""
    prewarm(warm)
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def save(state: dict, path: Path, writer: DataStatesWriter | None) -> None:
    """``dcp.save``; ``writer`` None means DCP's FileSystemWriter (fsyncs: sync_files=True)."""
    w = writer if writer is not None else FileSystemWriter(path)
    dcp.save(state, checkpoint_id=path, storage_writer=w, no_dist=True)


def load(dest: dict, path: Path, side: str, engine: Engine) -> None:
    reader = FileSystemReader(path) if side == "dcp" else DataStatesReader(engine=engine)
    dcp.load(dest, checkpoint_id=path, storage_reader=reader, no_dist=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4GiB", help="total state bytes (default 4GiB)")
    ap.add_argument("--targets", nargs="+", default=["/tmp/bench_disk", "/dev/shm/bench_shm"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-cache-size", default="1GiB",
                    help="DataStatesWriter host cache; dcp.save (no staging) only uses its bounce "
                    "pool (<= 256 MiB), so more only costs RAM (default 1GiB)")
    ap.add_argument("--ceiling-size", default="1GiB", help="bytes moved by the ceiling tests")
    ap.add_argument("--out", default="benchmarks/out/bench_cpu.png")
    ap.add_argument("--prewarm", action="store_true",
                    help="before each save (and ceiling test) touch and free --size bytes of RAM, "
                    "untimed: on VMs whose host reclaims free guest memory a page's first touch "
                    "costs ~10 us, which otherwise dominates tmpfs and page-cache writes")
    args = ap.parse_args()
    total = parse_size(args.size, name="--size")
    cache = parse_size(args.host_cache_size, name="--host-cache-size")
    ceil_bytes = min(parse_size(args.ceiling_size, name="--ceiling-size"), total)
    targets = [Path(t).resolve() for t in args.targets]
    kinds = {}
    for t in targets:  # room check: the state, its copy to load into, two checkpoints per target
        t.mkdir(parents=True, exist_ok=True)
        kinds[t] = fstype(t)
        st = os.statvfs(t)
        need = int(2.05 * total) + ceil_bytes + (cache if kinds[t] == "tmpfs" else 0) + (64 << 20)
        if st.f_bavail * st.f_frsize < need:
            raise SystemExit(f"{t}: needs {format_size(need)} free (2 checkpoints of "
                             f"{format_size(total)} + ceiling test), has "
                             f"{format_size(st.f_bavail * st.f_frsize)}; lower --size")
    ram = 2 * total + cache + sum(int(2.05 * total) + ceil_bytes
                                  for t in targets if kinds[t] == "tmpfs") + (512 << 20)
    if mem_available() < ram:
        raise SystemExit(f"needs {format_size(ram)} of RAM (state + load destination + host cache"
                         f" + tmpfs checkpoints), {format_size(mem_available())} available; "
                         f"lower --size")

    warm = total if args.prewarm else 0
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    state = make_state(total)
    dest = empty_like_state(state)
    poison(dest)  # fault its pages in once
    nbytes = sum(t.nbytes for t in _tensors(state))
    gib = nbytes / GiB
    print(f"state: {format_size(nbytes)} in {len(_tensors(state))} tensors "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)

    t0 = time.perf_counter()
    engine = Engine(host_cache_size=cache)
    engine.reserve(cache // 2).release()  # maps the host cache, starts the I/O backend
    _ = engine.bounce
    writer = DataStatesWriter(engine=engine, overwrite=True)
    cache_s = time.perf_counter() - t0
    print(f"DataStatesWriter host cache {format_size(cache)} created in {cache_s:.3f} s "
          f"(one-time, excluded)", flush=True)

    times: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # target/op/side
    ceilings: dict = defaultdict(lambda: defaultdict(list))  # target -> op -> [GiB/s]
    ours_stats: list = []
    evict = "n/a"
    for rep in range(args.reps):
        order = SIDES[::-1] if rep % 2 == 0 else SIDES
        for target in targets:
            label = f"{target} ({kinds[target]})"
            tmpfs = kinds[target] == "tmpfs"
            root = target / f"rep{rep}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            prewarm(warm)
            ceil = (mem_ceiling(root, state, dest, ceil_bytes) if tmpfs
                    else disk_ceiling(root, dest, ceil_bytes))
            for op, v in ceil.items():
                ceilings[label][op].append(v)
            rec = times[label]
            ckpt = {side: root / side for side in SIDES}
            for side in order:
                s = timed(warm, save, state, ckpt[side], writer if side == "ours" else None)
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
                op = "load" if tmpfs else "load cold"
                rec[op][side].append(timed(0, load, *how))
                verify(state, dest, f"{label} rep {rep} {side}")
                if not tmpfs:
                    rec["load warm"][side].append(timed(0, load, *how))
            shutil.rmtree(root)
            cur = {op: {k: round(v[-1], 3) for k, v in d.items()} for op, d in rec.items()}
            ceil = {op: round(v, 2) for op, v in ceil.items()}
            print(f"rep {rep} {label}: seconds {cur}; ceiling GiB/s {ceil}", flush=True)
    for t in targets:
        try:
            t.rmdir()
        except OSError:
            pass

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    machine = {"cpu": cpu.group(1).strip() if cpu else platform.processor(),
               "cores": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "kernel": platform.release(),
               "io_backend": writer.last_stats().backend,
               "o_direct_disk": any(s["o_direct"] for s in ours_stats),
               "loadavg_1min_start_end": [load_before, os.getloadavg()[0]]}
    engine.close()
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
          f"python {machine['python']}, kernel {machine['kernel']}, "
          f"io backend {machine['io_backend']}; cold reads via {evict}; 1-min load average "
          f"{load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end (other processes)")
    print(f"state {format_size(nbytes)}, {args.reps} reps, medians; host cache "
          f"{format_size(cache)} created once in {cache_s:.3f} s (excluded); prewarm "
          f"{'on' if warm else 'off'}\n")

    summary = []
    head = (f"{'target':<28} {'operation':<10} {'DCP s':>7} {'ours s':>7} {'DCP GiB/s':>9} "
            f"{'ours GiB/s':>10} {'speedup':>7} {'ceil GiB/s':>10} {'ours %ceil':>10} {'goal':>9}")
    print(head + "\n" + "-" * len(head))
    for label, ops in times.items():
        goal = 3.0 if "(tmpfs)" in label else 1.5
        for op, d in ops.items():
            med = {side: statistics.median(d[side]) for side in SIDES}
            ceil = statistics.median(ceilings[label][op])
            row = {"target": label, "op": op, "dcp_s": med["dcp"], "ours_s": med["ours"],
                   "dcp_gib_s": gib / med["dcp"], "ours_gib_s": gib / med["ours"],
                   "speedup": med["dcp"] / med["ours"], "ceiling_gib_s": ceil,
                   "ours_pct_ceiling": 100 * gib / med["ours"] / ceil, "goal": goal}
            summary.append(row)
            verdict = f"{'met' if row['speedup'] >= goal else 'MISSED'} {goal}x"
            print(f"{label:<28} {op:<10} {row['dcp_s']:7.3f} {row['ours_s']:7.3f} "
                  f"{row['dcp_gib_s']:9.2f} {row['ours_gib_s']:10.2f} {row['speedup']:6.2f}x "
                  f"{ceil:10.2f} {row['ours_pct_ceiling']:9.0f}% {verdict:>9}")

    png = Path(args.out)
    png.parent.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine,
               "size_bytes": nbytes, "size_h": format_size(nbytes), "reps": args.reps,
               "host_cache_bytes": cache, "host_cache_create_s": cache_s, "cold_reads": evict,
               "prewarm": args.prewarm,
               "times_s": times, "ceilings_gib_s": ceilings, "ours_save_stats": ours_stats,
               "summary": summary}
    png.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, png)
    print(f"\nwrote {png} and {png.with_suffix('.json')}")


if __name__ == "__main__":
    main()
