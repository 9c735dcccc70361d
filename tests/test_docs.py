"""What the docs and the package's docstrings say agrees with the code and with each other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_speed_figures_for_pinning_in_the_package() -> None:
    """Pinning speed depends on the host and on what is timed with it: measured figures
    belong in benchmarks/RESULTS.md, not in docstrings and comments."""
    figure = re.compile(r"\d\s*s(econds?)? (per|a|each) GiB")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "dcp_datastates").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if figure.search(line)]
    assert found == []


def test_multinode_page_makes_one_engine_per_rank() -> None:
    """docs/multinode.md is a page of its own (a title, no draft note), and its code makes an
    engine once and gives it to every writer, never an engine inside a writer's call (one per
    save, mapped and pinned each time)."""
    text = (ROOT / "docs" / "multinode.md").read_text()
    assert text.startswith("# Several ranks and several nodes\n")
    assert "draft" not in text.lower()
    assert re.search(r"DataStates(Writer|Reader)\([^)]*Engine\(", text) is None
    assert 'engine = Engine(host_cache_size="2GiB")' in text
    assert "DataStatesWriter(engine=engine)" in text


def test_torchtitan_page_says_what_a_full_memory_tier_does() -> None:
    """A save the memory tier has no room for fails with TierFullError, logged, and training
    goes on (tests/integrations/test_torchtitan_integration.py); it is not one of the budget's
    skips."""
    text = (ROOT / "docs" / "torchtitan.md").read_text()
    (limit,) = [line for line in text.splitlines() if "memory_limit=" in line]
    assert "skipped" not in limit
    paragraph = next(p for p in text.split("\n\n") if "TierFullError" in p)
    assert "memory_limit" in paragraph and "logged" in paragraph
    assert "training goes on" in paragraph
