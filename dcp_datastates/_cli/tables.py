"""Plain-text tables for the commands' listings."""

from __future__ import annotations


def table(rows: list[list[str]], right: set[int]) -> str:
    """``rows`` (the first one a heading) in aligned columns; columns ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
