"""One benchmark run: command line, tree, date, machine, errors, tables, and its JSON and PNG."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from harness import REPO
from harness.machine import describe, summary
from harness.tables import Table

OUT = REPO / "benchmarks" / "out"


def log(msg: str) -> None:
    print(msg, flush=True)


def parser(doc: str, smoke: str | None = None) -> argparse.ArgumentParser:
    """The script's arguments, with ``doc`` as their help: ``--json`` and ``--library-log``,
    which every one has, and ``--cpu-smoke`` (a small run on CPU that checks the code paths:
    ``smoke`` says how)."""
    head, _, rest = doc.strip().partition("\n\n")
    ap = argparse.ArgumentParser(description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None,
                    help="the results' JSON, the PNG goes beside it (default: "
                    "benchmarks/out/<script>.json, <script>_cpu_smoke.json in a CPU smoke run)")
    ap.add_argument("--library-log", dest="log", type=Path, default=None,
                    help="write dcp_datastates' log at INFO level (each save's and load's "
                    "figures) to this file")
    if smoke:
        ap.add_argument("--cpu-smoke", action="store_true", help=f"{smoke} (checks the code paths)")
    return ap


def command_line(launcher: str) -> str:
    """The command that runs this again from the repository root."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO):
        script = script.relative_to(REPO)
    return shlex.join([*shlex.split(launcher), str(script), *sys.argv[1:]])


def tree() -> str | None:
    """The commit the checkout is at, with ``+`` after it where tracked files differ from it;
    None outside a git checkout (``report.py`` then asks for the JSON's ``tree`` by hand).
    ``BENCH_TREE`` in the environment says it instead: a copy of the checkout whose ``.git``
    is not the one it was copied from (the GPU machine's) records that one's HEAD."""
    if given := os.environ.get("BENCH_TREE"):
        return given

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


class Run:
    """What one run records: its command, tree, date, machine, figures, tables and errors.

    ``res`` is the JSON: benchmarks add their figures to it; ``show`` adds a table.
    ``fail_fast``: ``guard`` raises what failed once it is recorded (a rank of several that
    went on alone would wait for the others forever).
    """

    def __init__(self, name: str, args: argparse.Namespace, dirs: list[Path] = (), *,
                 launcher: str = "python", fail_fast: bool = False) -> None:
        smoke = getattr(args, "cpu_smoke", False)
        if getattr(args, "log", None) is not None:
            handler = logging.FileHandler(args.log, mode="w")
            handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms %(threadName)s "
                                                   "%(message)s"))
            logger = logging.getLogger("dcp_datastates")
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        self.t0 = time.perf_counter()
        self.fail_fast = fail_fast
        self.json = args.json or OUT / f"{name}{'_cpu_smoke' if smoke else ''}.json"
        self.res: dict = {
            "benchmark": name, "command": command_line(launcher), "tree": tree(),
            "argv": sys.argv,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": describe(dirs), "args": vars(args), "cpu_smoke": smoke,
            "loadavg_1min": [os.getloadavg()[0]], "errors": {}, "tables": []}

    def header(self) -> None:
        log(f"{self.res['command']}\nmachine: {summary(self.res['machine'])}")

    def guard(self, what: str, fn, *args: object, **kwargs: object) -> object:
        """Run ``fn``; on failure log the traceback's tail, record it, and return None (or
        raise it again, with ``fail_fast``)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - report and keep the other variants going
            tail = "".join(traceback.format_exception(exc)).strip().splitlines()[-12:]
            log(f"!! {what} FAILED: {type(exc).__name__}: {exc}\n   " + "\n   ".join(tail))
            self.res["errors"].setdefault(what, []).append(f"{type(exc).__name__}: {exc}")
            if self.fail_fast:
                raise
            return None

    def show(self, table: Table) -> None:
        """Print ``table`` and keep it for the JSON (``report.py`` renders it)."""
        self.res["tables"].append(table.to_json())
        log("\n" + table.text())

    def write(self) -> None:
        self.json.parent.mkdir(parents=True, exist_ok=True)
        self.json.write_text(json.dumps(self.res, indent=1, default=str))

    def finish(self, tables, plot) -> None:
        """Show ``tables(res)``, draw ``plot(res, png)`` beside the JSON (``plot`` None: no
        plot), write the JSON."""
        self.res["loadavg_1min"].append(os.getloadavg()[0])
        self.res["total_s"] = time.perf_counter() - self.t0
        for table in self.guard("tables", tables, self.res) or []:
            self.show(table)
        png = self.json.with_suffix(".png") if plot is not None else None
        if png is not None and self.guard("plot", lambda: plot(self.res, png) or True) is None:
            png = None
        if self.res["errors"]:
            log("errors: " + "; ".join(f"{k}: {v[0]}" + (f" (x{len(v)})" if len(v) > 1 else "")
                                       for k, v in self.res["errors"].items()))
        self.write()
        log(f"\nwrote {self.json}" + (f" and {png}" if png else ""))
