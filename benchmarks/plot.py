"""Bar chart of a bench_cpu.py result: GiB/s per target/operation, DCP vs ours, ceiling as a line.

Usage: python benchmarks/plot.py benchmarks/out/bench_cpu.json [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]
    xs = range(len(rows))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 1.7 * len(rows)), 4.8))
    dcp = ax.bar([x - width / 2 for x in xs], [r["dcp_gib_s"] for r in rows], width,
                 label="DCP FileSystemWriter/Reader")
    ours = ax.bar([x + width / 2 for x in xs], [r["ours_gib_s"] for r in rows], width,
                  label="DataStatesWriter/Reader")
    ax.bar_label(dcp, fmt="%.2f", fontsize=8)
    ax.bar_label(ours, fmt="%.2f", fontsize=8)
    for x, r in zip(xs, rows, strict=True):
        if r.get("ceiling_gib_s"):
            ax.hlines(r["ceiling_gib_s"], x - 0.45, x + 0.45, colors="k", linestyles="--",
                      label="ceiling (dd O_DIRECT; one writev / preadv)" if x == 0 else None)
    names = [r["target"].replace(" (", "\n(") + "\n" + r["op"] for r in rows]
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("GiB/s (state bytes / median time)")
    m = results["machine"]
    ax.set_title(f"{results['size_h']} state, {results['reps']} reps; {m['cpu']}, {m['cores']} "
                 f"cores, torch {m['torch']}, io={m.get('io_backend')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    src = Path(sys.argv[1])
    plot(json.loads(src.read_text()), Path(sys.argv[2]) if len(sys.argv) > 2 else
         src.with_suffix(".png"))
