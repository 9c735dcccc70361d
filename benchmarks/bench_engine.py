"""DCP's idiom on CPU: a fresh writer/reader per call, and many tiny tensors, side by side with DCP.

Two scenarios, each run on the same data for DCP's FileSystemWriter/Reader and ours:

* ``fresh``: a 1 GiB fp32 state saved ``--saves`` times into ``--dir`` (default /dev/shm) with
  a new writer per save and default arguments (ours also with one writer kept for the run on an
  engine sized to the state), then loaded as many times with a new reader per load. Medians of
  saves (and loads) 2..N: the first one warms each side up (our engine sizes its cache there).
* ``tiny``: ``--tiny`` tensors of a few bytes each (step counters, norms, biases): ``dcp.save``,
  ``dcp.async_save`` until durable, and ``dcp.load``; medians of ``--reps`` after a warm-up.

    python benchmarks/bench_engine.py --dir /dev/shm/bench_engine
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import machine  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

from dcp_datastates import DataStatesReader, DataStatesWriter, Engine  # noqa: E402
from dcp_datastates.sizes import format_size, parse_size  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


def big_state(nbytes: int) -> dict:
    n = nbytes // 4 // 8
    return {f"layer{i}.weight": torch.randn(n) for i in range(8)}


def tiny_state(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for i in range(n):
        kind = i % 3
        out[f"p{i}"] = (torch.tensor(float(i)) if kind == 0 else  # step counters
                        torch.randn(4, generator=g) if kind == 1 else  # norms
                        torch.randint(0, 9, (3,), generator=g, dtype=torch.int64))  # biases
    return out


def blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def check(got: dict, want: dict, what: str) -> None:
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad:
        raise SystemExit(f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}")


def save_durable(state: dict, path: Path, writer: object) -> None:
    """``dcp.async_save`` until durable (DCP returns a bare Future where it stages in line)."""
    response = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)
    getattr(response, "upload_completion", response).result()


def timed(fn, *args: object, **kwargs: object) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


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


def write_ceiling(root: Path, state: dict, reps: int) -> list[float]:
    """Seconds to write (and fsync) the state's bytes into a new file, one pwritev per tensor:
    what the file system allows, with no checksum and no planning."""
    out = []
    for _ in range(reps):
        path = root / "ceiling.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        offset = 0
        for t in state.values():
            view = memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))
            os.pwritev(fd, [view], offset)
            offset += t.nbytes
        os.fsync(fd)
        out.append(time.perf_counter() - t0)
        os.close(fd)
        path.unlink()
    return out


def fresh(root: Path, nbytes: int, saves: int) -> dict:
    state = big_state(nbytes)
    size = sum(t.nbytes for t in state.values())
    engine = Engine(host_cache_size=size + (256 << 20))
    kept = DataStatesWriter(engine=engine, overwrite=True)
    out: dict = {"state_bytes": size, "ceiling_s": write_ceiling(root, state, saves)}
    out["ceiling_median_s"] = statistics.median(out["ceiling_s"][1:])
    print(f"write ceiling: {[round(s, 3) for s in out['ceiling_s']]}", flush=True)
    try:
        for side in ("dcp", "ours", "ours_kept"):
            make_w, make_r = writer_of(side, kept), reader_of(side, engine)
            path = root / side
            save_s, load_s = [], []
            for _ in range(saves):
                save_s.append(timed(dcp.save, state, checkpoint_id=path,
                                    storage_writer=make_w(path), no_dist=True))
            dest = blank(state)
            for _ in range(saves):
                load_s.append(timed(dcp.load, dest, checkpoint_id=path,
                                    storage_reader=make_r(path), no_dist=True))
            check(dest, state, f"fresh/{side}")
            shutil.rmtree(path, ignore_errors=True)
            out[side] = {"save_s": save_s, "load_s": load_s,
                         "save_median_s": statistics.median(save_s[1:]),
                         "load_median_s": statistics.median(load_s[1:])}
            print(f"fresh {side}: saves {[round(s, 3) for s in save_s]} "
                  f"loads {[round(s, 3) for s in load_s]}", flush=True)
    finally:
        engine.close()
    return out


def tiny(root: Path, n: int, reps: int) -> dict:
    state = tiny_state(n)
    out: dict = {"tensors": n}
    for side in ("dcp", "ours"):
        make_w, make_r = writer_of(side, None), reader_of(side, None)
        rec: dict = {"save_s": [], "async_durable_s": [], "load_s": []}
        for rep in range(reps + 1):
            path = root / f"tiny_{side}"
            rec["save_s"].append(timed(dcp.save, state, checkpoint_id=path,
                                       storage_writer=make_w(path), no_dist=True))
            path2 = root / f"tiny_{side}_async"
            rec["async_durable_s"].append(timed(save_durable, state, path2, make_w(path2)))
            dest = blank(state)
            rec["load_s"].append(timed(dcp.load, dest, checkpoint_id=path,
                                       storage_reader=make_r(path), no_dist=True))
            check(dest, state, f"tiny/{side} rep {rep}")
        shutil.rmtree(root / f"tiny_{side}", ignore_errors=True)
        shutil.rmtree(root / f"tiny_{side}_async", ignore_errors=True)
        out[side] = {k: statistics.median(v[1:]) for k, v in rec.items()} | {"raw": rec}
        print(f"tiny {side}: " + ", ".join(f"{k} {out[side][k]:.3f}" for k in rec), flush=True)
    return out


def report(res: dict) -> str:
    f, t = res["fresh"], res["tiny"]
    d, o, k = f["dcp"], f["ours"], f["ours_kept"]
    lines = [
        f"machine: {res['machine']}",
        f"command: {res['command']}",
        f"fresh writer per save, {format_size(f['state_bytes'])} fp32, {res['dir']}, "
        f"medians of saves/loads 2..{len(d['save_s'])}:",
        "| | FileSystemWriter/Reader | ours, fresh, defaults | ours, one writer kept | "
        "ours vs DCP | fresh vs kept |",
        "|---|---|---|---|---|---|",
    ]
    for m in ("save_median_s", "load_median_s"):
        lines.append(f"| {m.split('_')[0]} | {d[m]:.3f} s | {o[m]:.3f} s | {k[m]:.3f} s | "
                     f"{d[m] / o[m]:.2f}x | {o[m] / k[m]:.2f} |")
    ceil = f["ceiling_median_s"]
    lines.append(f"write ceiling (one pwritev per tensor + fsync, no checksums): {ceil:.3f} s; "
                 f"DCP's save takes {d['save_median_s'] / ceil:.2f}x that, ours "
                 f"{o['save_median_s'] / ceil:.2f}x")
    lines += ["", f"{t['tensors']} tiny tensors, medians of {len(t['ours']['raw']['save_s']) - 1}"
              " after a warm-up:", "| | DCP | ours | ours vs DCP |", "|---|---|---|---|"]
    for m in ("save_s", "async_durable_s", "load_s"):
        lines.append(f"| {m} | {t['dcp'][m]:.3f} s | {t['ours'][m]:.3f} s | "
                     f"{t['dcp'][m] / t['ours'][m]:.2f}x |")
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, t = res["fresh"], res["tiny"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = ["save", "load"]
    for i, (side, label) in enumerate((("dcp", "DCP"), ("ours", "ours fresh"),
                                       ("ours_kept", "ours kept"))):
        axes[0].bar([x + 0.27 * i for x in range(2)],
                    [f[side]["save_median_s"], f[side]["load_median_s"]], 0.27, label=label)
    axes[0].set_xticks([0.27, 1.27], names)
    axes[0].set_ylabel("seconds (median)")
    axes[0].set_title(f"fresh writer per save, {format_size(f['state_bytes'])}")
    axes[0].legend()
    ms = ["save_s", "async_durable_s", "load_s"]
    for i, side in enumerate(("dcp", "ours")):
        axes[1].bar([x + 0.4 * i for x in range(3)], [t[side][m] for m in ms], 0.4, label=side)
    axes[1].set_xticks([0.2, 1.2, 2.2], ["save", "async durable", "load"])
    axes[1].set_title(f"{t['tensors']} tiny tensors")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm/bench_engine")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--tiny", type=int, default=30000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(["python", *sys.argv]), "machine": machine(torch),
           "dir": str(root)}
    try:
        res["fresh"] = fresh(root, parse_size(args.size), args.saves)
        res["tiny"] = tiny(root, args.tiny, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (out / "bench_engine.json").write_text(json.dumps(res, indent=1, default=str))
    plot(res, out / "bench_engine.png")
    print(report(res))


if __name__ == "__main__":
    main()
