"""Plot per-save phase times from ``DataStatesWriter.last_stats()`` records.

Input: a JSON file holding a list of records (``dataclasses.asdict(writer.last_stats())``), or
a ``bench_cpu.py`` result (its ``ours_save_stats``). Each record becomes one group of bars:
blocking, snapshot, flush and durable seconds, where present.

    python benchmarks/plot_stats.py benchmarks/results/bench_cpu.json -o stats.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.plots import bars, figure, save
from harness.run import OUT, log

PHASES = ("blocking_s", "snapshot_s", "flush_s", "durable_s")


def load_records(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["ours_save_stats"] if isinstance(data, dict) else data


def plot_stats(records: list[dict], out: Path) -> None:
    """One bar group per save, one bar per phase present in the records."""
    phases = [p for p in PHASES if any(r.get(p) is not None for r in records)]
    fig, (ax,) = figure(size=(max(6, len(records) * 0.9), 4))
    bars(ax, [str(r.get("target", n)).split(" ")[0] + f"#{r.get('rep', n)}"
              for n, r in enumerate(records)],
         {p[:-2]: [r.get(p) for r in records] for p in phases}, spec=".2f", ylabel="seconds")
    save(fig, out, "dcp_datastates: per-save phases (writer.last_stats())")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="records, or a bench_cpu.py result")
    ap.add_argument("-o", "--out", type=Path, default=OUT / "save_stats.png")
    args = ap.parse_args()
    plot_stats(load_records(args.src), args.out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
