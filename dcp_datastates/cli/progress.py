"""A byte-count progress bar on stderr, for the commands that read a whole checkpoint."""

from __future__ import annotations

import sys

from ..sizes import format_size


class Progress:
    """A byte-count progress bar on stderr: tqdm when installed, else a percentage line."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1
        self.bar = None
        self.enabled = enabled
        if enabled:
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
        tty = sys.stderr.isatty()
        pct = 100 * self.done // self.total if self.total else 100
        if pct != self.shown and (tty or pct // 10 != self.shown // 10):
            self.shown = pct
            end = "\r" if tty else "\n"
            print(f"{self.desc}: {pct:3d}% ({format_size(self.done)} of "
                  f"{format_size(self.total)})", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar's line."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            print(file=sys.stderr)
