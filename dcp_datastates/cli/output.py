"""The directory an export writes, made durable: each file under a temporary name, fsynced,
then renamed into place; the directory fsynced once its names are final."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from ..directory import new_token, write_new


class OutputDir:
    """Files written into ``path``, durably. ``fsync`` syncs an open descriptor (a file's,
    then each directory's whose entries changed); tests pass one that records."""

    def __init__(self, path: Path, fsync: Callable[[int], None] = os.fsync) -> None:
        self.path = path
        self.written: list[str] = []
        self._fsync = fsync
        self._made: list[Path] = []  # directories this export made, the outermost last

    def create(self) -> None:
        """Make the directory (and missing parents)."""
        self._made = [d for d in (self.path, *self.path.parents) if not d.exists()]
        self.path.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, parts: Iterable[bytes | memoryview]) -> None:
        """Write file ``name`` from ``parts``: under a temporary name, fsynced, then renamed
        into place, so whatever sat at the name (a link, a FIFO) is replaced, never written
        through, and no half-written file ever has the name."""
        dest = self.path / name
        tmp = dest.with_name(f".{name}.{new_token()}.tmp")
        write_new(tmp, dest, parts, self._fsync)
        self.written.append(name)

    def remove_stale(self, names: re.Pattern[str]) -> list[str]:
        """Delete files matching ``names`` that this export did not write (an earlier
        export's); return their names."""
        stale = sorted(p.name for p in self.path.iterdir()
                       if names.match(p.name) and p.name not in self.written)
        for name in stale:
            (self.path / name).unlink(missing_ok=True)
        return stale

    def sync(self) -> None:
        """Make the directory's entries durable, and those of the parents it was made in."""
        for d in (self.path, *(made.parent for made in self._made)):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._fsync(fd)
            finally:
                os.close(fd)


def inside(out: Path, path: Path) -> bool:
    """Whether ``out`` is the directory ``path`` or lies inside it: by name with links
    resolved, and by identity (device, inode) of each existing directory on ``out``'s way up,
    which also sees the checkpoint under another name (a bind mount)."""
    out, path = out.resolve(), path.resolve()
    if out == path or path in out.parents:
        return True
    try:
        st = path.stat()
    except OSError:
        return False
    for d in (out, *out.parents):
        try:
            o = d.stat()
        except OSError:
            continue  # not made yet
        if (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False
