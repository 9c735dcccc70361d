"""Plot per-save phase times from ``DataStatesWriter.last_stats()`` records.

Input: a JSON file holding a list of records (``dataclasses.asdict(writer.last_stats())``, or
the ``ours_save_stats`` list inside a ``bench_cpu.py`` result). Each record becomes one group of
bars: blocking, snapshot, flush and durable seconds, where present.

    python benchmarks/plot_stats.py benchmarks/results/bench_cpu.json -o stats.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ("blocking_s", "snapshot_s", "flush_s", "durable_s")


def load_records(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["ours_save_stats"] if isinstance(data, dict) else data


def plot_stats(records: list[dict], out: Path) -> None:
    """One bar group per save, one bar per phase present in the records."""
    phases = [p for p in PHASES if any(r.get(p) is not None for r in records)]
    width = 0.8 / max(len(phases), 1)
    fig, ax = plt.subplots(figsize=(max(6, len(records) * 0.9), 4))
    for i, phase in enumerate(phases):
        xs = [n + i * width for n in range(len(records))]
        ax.bar(xs, [r.get(phase) or 0.0 for r in records], width, label=phase[:-2])
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(records))])
    ax.set_xticklabels([str(r.get("target", n)).split(" ")[0] + f"#{r.get('rep', n)}"
                        for n, r in enumerate(records)], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("dcp_datastates: per-save phases (writer.last_stats())")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=Path("benchmarks/out/save_stats.png"))
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_stats(load_records(args.json), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
