"""Tables: printed aligned in the run's log, kept as text in its JSON, rendered as Markdown.

A column's format is a ``format()`` spec, optionally ending in ``x`` or ``%`` (appended to the
figure): ``".3f"``, ``".2fx"``, ``"+.1f%"``; ``""`` for text. Missing figures show as ``-``.
"""

from __future__ import annotations


def fmt(x: object, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, str) or not spec:
        return str(x)
    if spec[-1] in "x%":
        return format(x, spec[:-1]) + spec[-1]
    return format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None where either is missing or zero."""
    return a / b if a and b else None


class Table:
    """A titled table of formatted cells, with notes (goals, ceilings) printed under it."""

    def __init__(self, title: str, columns: list[tuple[str, str]], notes: list[str] = ()) -> None:
        self.title = title
        self.headers = [h for h, _ in columns]
        self.specs = [s for _, s in columns]
        self.rows: list[list[str]] = []
        self.notes = list(notes)

    def add(self, *cells: object) -> None:
        self.rows.append([fmt(c, s) for c, s in zip(cells, self.specs, strict=True)])

    def text(self) -> str:
        grid = [self.headers, *self.rows]
        widths = [max(len(r[i]) for r in grid) for i in range(len(self.headers))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if s else c.ljust(w)
                             for c, w, s in zip(cells, widths, self.specs, strict=True)).rstrip()

        head = line(self.headers)
        return "\n".join([self.title, head, "-" * len(head), *map(line, self.rows), *self.notes])

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join("--:" if s else ":--" for s in self.specs) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out + ([""] + [f"- {n}" for n in self.notes] if self.notes else []))

    def to_json(self) -> dict:
        return {"title": self.title, "columns": self.headers, "specs": self.specs,
                "rows": self.rows, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict) -> Table:
        t = cls(d["title"], list(zip(d["columns"], d["specs"], strict=True)), d["notes"])
        t.rows = d["rows"]
        return t


def ratio_table(title: str, pairs: dict[str, tuple[dict, dict]],
                metrics: dict[str, str]) -> Table:
    """A row per ``label: (a, b)`` pair of figure rows: ``a[m] / b[m]`` for each metric ``m``
    (times: how many times faster ``b`` is)."""
    t = Table(title, [("", ""), *((label, ".2fx") for label in metrics.values())])
    for label, (a, b) in pairs.items():
        t.add(label, *(ratio(a.get(m), b.get(m)) for m in metrics))
    return t
