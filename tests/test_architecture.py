"""docs/ARCHITECTURE.md names every module of the package, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dcp_datastates"


def test_every_module_has_its_row_and_every_row_its_module() -> None:
    rows = set(re.findall(r"^\| `([\w/]+\.py)` \|", (ROOT / "docs" / "ARCHITECTURE.md").read_text(),
                          re.M))
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert modules - rows == set(), "modules missing from docs/ARCHITECTURE.md"
    assert rows - modules == set(), "rows of docs/ARCHITECTURE.md naming no module"
