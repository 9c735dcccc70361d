"""Public names that were renamed: the old name stays, for a release, as an alias that warns.

Listed in docs/usage.md ("Deprecated names"); ``tests/test_public_api.py`` calls each one.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["Renamed"]


class Renamed:
    """A class attribute kept under its old name: ``old = Renamed("new", removed_in="0.2.0")``
    in the class body. Reading it (``obj.old``) emits a ``DeprecationWarning`` naming the new
    name, then gives what ``obj.new`` gives."""

    def __init__(self, new: str, *, removed_in: str) -> None:
        self.new, self.removed_in = new, removed_in
        self.old = self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.old = owner.__name__, name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        warnings.warn(f"{self.owner}.{self.old} is deprecated: it was renamed "
                      f"{self.owner}.{self.new}, and the old name goes in {self.removed_in}",
                      DeprecationWarning, stacklevel=2)
        return getattr(objtype if obj is None else obj, self.new)
