"""``benchmarks/RESULTS.md``, made by ``benchmarks/report.py`` from ``RESULTS.intro.md`` and the
kept runs: what they give, the newest figures only (within 250 lines), each run with its
command and the tree it ran on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MARKS, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402
from harness.run import tree  # noqa: E402

pytestmark = MARKS
RESULTS = ROOT / "benchmarks" / "results"
INTRO = ROOT / "benchmarks" / "RESULTS.intro.md"


def sections(text: str) -> list[str]:
    """The ``## `` sections of a RESULTS.md, heading first."""
    return re.split(r"^(?=## )", text, flags=re.M)[1:]


def test_results_md_is_generated_within_250_lines_each_section_with_command_and_tree() -> None:
    text = report.render(RESULTS, INTRO)
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == text, (
        "RESULTS.md is out of date: run python benchmarks/report.py")
    assert len(text.splitlines()) <= 250
    found = sections(text)
    assert {s.split(":")[0].removeprefix("## ") for s in found} >= {
        p.stem for p in RESULTS.glob("*.json")}
    for s in found:
        assert "**Command:** `" in s, s.splitlines()[0]
        assert re.search(r"\btree `[0-9a-f]{7,40}`", s), s.splitlines()[0]


def test_a_results_md_over_its_limit_is_refused_naming_the_count(tmp_path: Path) -> None:
    intro = tmp_path / "RESULTS.intro.md"
    intro.write_text("# Benchmark results\n" + "text\n" * report.LIMIT + report.MARK + "\n")
    with pytest.raises(SystemExit, match=rf"RESULTS\.md would be \d+ lines, over its limit of "
                                         rf"{report.LIMIT}.*RESULTS\.intro\.md"):
        report.render(RESULTS, intro)


@pytest.mark.parametrize("tree", [None, "3571cd9+"], ids=["none", "uncommitted"])
def test_a_kept_run_without_its_commit_is_refused_naming_the_file(tmp_path: Path,
                                                                  tree: str | None) -> None:
    run = {**json.loads((RESULTS / "bench_cpu.json").read_text()), "tree": tree}
    (tmp_path / "bench_cpu.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit, match=rf"bench_cpu\.json: \"tree\" is {re.escape(repr(tree))}, "
                                         "not a commit"):
        report.render(tmp_path, INTRO)


def test_the_harness_records_the_tree_a_run_ran_on() -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = "+" if git("status", "--porcelain", "-uno") else ""
    assert tree() == git("rev-parse", "--short", "HEAD") + dirty
