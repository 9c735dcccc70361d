"""Regenerate benchmarks/RESULTS.md from the runs kept in benchmarks/results/*.json.

RESULTS.intro.md holds the hand-written prose; its line ``<!-- generated sections -->`` becomes
one compact section per kept run (benchmark and machine), in ORDER: a heading naming the run's
JSON, the exact command, then one line with the date, the tree (the commit it ran on: the JSON's
``tree``), the machine and the files (a third line lists errors, if any), then the run's tables.

Which tables: TABLES names, per JSON file (its stem), the title prefixes of the tables to show,
in the JSON's order (an unknown prefix is an error, so the list follows the benchmarks); a run
it does not name shows its first DEFAULT_TABLES table(s). The tables' notes (column legends,
per-repetition figures, goal verdicts) are left out: they are in the JSON and in the run's
printed log. RESULTS.md holds the newest figures only: over LIMIT lines, this fails.

To keep a new run, copy its JSON (and PNG) from benchmarks/out/ into benchmarks/results/
(replacing the older run of that benchmark and machine: git keeps it), then run this. The
harness records the tree where the run had a git checkout; else add ``"tree": "<commit>"``.

    python benchmarks/report.py            # writes benchmarks/RESULTS.md
    python benchmarks/report.py --check    # fails if RESULTS.md is not what the JSON gives
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from harness.machine import summary
from harness.tables import Table

HERE = Path(__file__).resolve().parent
ORDER = ("bench_cpu", "bench_engine", "bench_gpu", "bench_training", "bench_multi_gpu",
         "bench_torchtitan")
MARK = "<!-- generated sections -->"
LIMIT = 250
DEFAULT_TABLES = 1
TABLES = {
    "bench_engine_cpu": ("fresh writer per save", "30000 tiny tensors"),
    "bench_training_2xh100": ("training steps",),
    "bench_training_h100_8g": ("training steps",),
    "bench_training_h200_8g_idiom": ("training steps",),
    "bench_torchtitan_2xh100": ("torchtitan llama3",),
    "bench_torchtitan_2xh100_resume": ("Resume after SIGKILL",),
    "bench_torchtitan_h100_resume": ("Resume after SIGKILL",),
    "bench_training_h100": ("GPT",),
}


def load(path: Path) -> dict:
    res = json.loads(path.read_text())
    if not isinstance(res, dict) or not {"benchmark", "command", "tables"} <= res.keys():
        raise SystemExit(f"{path}: not a run of the benchmark harness (no benchmark, command or "
                         "tables); keep only the harness's runs in results/")
    if not re.fullmatch(r"[0-9a-f]{7,40}", res.get("tree") or ""):
        raise SystemExit(f'{path}: "tree" is {res.get("tree")!r}, not a commit: give the commit '
                         'the run ran on ("tree": "<commit>"; a run on uncommitted changes has '
                         'none: commit them and run again)')
    return res


def chosen(path: Path, tables: list[dict]) -> list[dict]:
    """The tables TABLES names for this run, else its first DEFAULT_TABLES."""
    prefixes = TABLES.get(path.stem)
    if prefixes is None:
        return tables[:DEFAULT_TABLES]
    for p in prefixes:
        if not any(t["title"].startswith(p) for t in tables):
            raise SystemExit(f"report.py TABLES: {path.name} has no table titled {p!r}...")
    return [t for t in tables if t["title"].startswith(prefixes)]


def section(path: Path, res: dict) -> str:
    m = res["machine"]
    where = m.get("gpu") and f"{m.get('gpus', 1)} x {m['gpu']}" or f"{m['cpu']}, {m['cores']} cores"
    smoke = " (CPU smoke run: checks code paths, not speed)" if res.get("cpu_smoke") else ""
    png = path.with_suffix(".png")
    files = f"`results/{path.name}`" + (f", `{png.name}`" if png.exists() else "")
    load_avg = " -> ".join(f"{x:.2f}" for x in res["loadavg_1min"])
    noisy = (" (**noisy**: other processes ran alongside)"
             if max(res["loadavg_1min"]) >= m["cores"] / 2 else "")
    out = [f"## {path.stem}: `{res['benchmark']}.py` on {where}{smoke}",
           f"**Command:** `{res['command']}`  ",
           f"**Run:** {res['date']}, tree `{res['tree']}`, on {summary(m)}; 1-min load average "
           f"{load_avg}{noisy}; files: {files}"]
    if res["errors"]:
        out[-1] += "  "
        out += ["**Errors:** " + "; ".join(f"{k}: {v[0]}" for k, v in res["errors"].items())]
    tables = chosen(path, res["tables"])
    for t in tables:
        out += ["", Table.from_json({**t, "notes": []}).markdown()]
    if not res["tables"]:
        out += ["", "(No tables: the run stopped before its end, where they are made; its "
                "figures so far are in the JSON.)"]
    return "\n".join(out)


def render(results: Path, intro: Path) -> str:
    runs = [(p, load(p)) for p in sorted(results.glob("*.json"))]
    runs.sort(key=lambda pr: (ORDER.index(pr[1]["benchmark"]) if pr[1]["benchmark"] in ORDER
                              else len(ORDER), pr[1]["benchmark"], pr[0].name))
    text = intro.read_text()
    if MARK not in text:
        raise SystemExit(f"{intro}: no line {MARK} to put the sections at")
    body = "\n\n".join(section(p, r) for p, r in runs) or "(no runs kept yet)"
    head = (f"<!-- Generated by benchmarks/report.py from {intro.name} and results/*.json: edit "
            "those, not this file. -->\n")
    out = head + text.replace(MARK, body)
    lines = len(out.splitlines())
    if lines > LIMIT:
        raise SystemExit(f"RESULTS.md would be {lines} lines, over its limit of {LIMIT} (the "
                         f"newest figures only): keep one run per thing measured in {results} "
                         f"(git keeps the others), show fewer of its tables (TABLES) or "
                         f"shorten {intro}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "results", help="the kept runs' JSON")
    ap.add_argument("--intro", type=Path, default=HERE / "RESULTS.intro.md")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    text = render(args.results, args.intro)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            sys.exit(f"{args.out} is out of date: run python benchmarks/report.py")
        print(f"{args.out} is up to date")
        return
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
