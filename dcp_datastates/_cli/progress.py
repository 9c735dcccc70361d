"""A byte-count progress bar on stderr, for the commands that read a whole checkpoint."""

from __future__ import annotations

import sys

from .._sizes import format_size


class Progress:
    """A byte-count progress bar on stderr: tqdm when installed, else a percentage line
    rewritten in place. Shown only where stderr is a terminal: in a log or a pipe it would be
    a line per step."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1
        self.bar = None
        self.enabled = enabled and sys.stderr.isatty()
        if self.enabled:
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                                unit_divisor=1024, file=sys.stderr)
            except ImportError:
                self._show()

    def update(self, n: int) -> None:
        """Count ``n`` more bytes done."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            self._show()

    def _show(self) -> None:
        pct = 100 * self.done // self.total if self.total else 100
        if pct != self.shown:
            self.shown = pct
            print(f"\r{self.desc}: {pct:3d}% ({format_size(self.done)} of "
                  f"{format_size(self.total)})", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar's line."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)
