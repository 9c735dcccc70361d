"""The directory an export writes, replaced whole or not at all.

The new files are written into a staging directory inside it (each under a temporary name,
fsynced, then renamed), then moved into place: first the previous export's files go, its
entry files (``model.safetensors``, the index) before its shards; then the new shards come,
the new entry file last, with the directory synced between the steps. So at every moment,
through any crash, the directory holds the previous export whole, the new one whole, or no
entry file (no model a loader takes): never new shards under an old index. One export writes
into a directory at a time (an ``flock`` on the directory itself); the next one removes what a
killed one left in its staging directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from .._format.directory import fsync_dir, new_token, write_new

#: Staging directories of exports: ``.export-<token>``.
_STAGING_RE = re.compile(r"^\.export-[0-9a-f]+$")


class OutputDir:
    """Files written into ``path``, put in place together, durably. ``fsync`` syncs an open
    descriptor (a file's, then each directory's whose entries changed); tests pass one that
    records. A context manager: :meth:`create` on entry, :meth:`close` on exit."""

    def __init__(self, path: Path, fsync: Callable[[int], None] = os.fsync) -> None:
        self.path = path
        self.written: list[str] = []
        self._fsync = fsync
        self._made: list[Path] = []  # directories this export made, the outermost last
        self._fd = -1  # the directory, locked
        self._staging: Path | None = None

    def __enter__(self) -> OutputDir:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the directory (and missing parents), claim it, remove what killed exports
        left in it, and make this export's staging directory."""
        if (blocker := _in_the_way(self.path)) is not None:
            d, what, fix = blocker
            at = ("output directory " if d == self.path else
                  f"cannot make the output directory {self.path}: ")
            raise NotADirectoryError(f"{at}{d} {what}: {fix}give another output directory "
                                     f"(a missing one is made)")
        self._made = [d for d in (self.path, *self.path.parents) if not d.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:  # the same class, saying what was being made
            raise type(exc)(f"cannot make the output directory {self.path}: "
                            f"{exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise OSError(f"output directory {self.path} is being written by another export: "
                          f"wait for it to finish or export elsewhere") from None
        for p in self.path.iterdir():
            if _STAGING_RE.match(p.name) and not p.is_symlink():
                shutil.rmtree(p)
        self._staging = self.path / f".export-{new_token()}"
        self._staging.mkdir()

    def write(self, name: str, parts: Iterable[bytes | memoryview]) -> None:
        """Write file ``name`` from ``parts`` into the staging directory: under a temporary
        name, fsynced, then renamed."""
        assert self._staging is not None, "create() first"
        write_new(self._staging / f".{name}.tmp", self._staging / name, parts, self._fsync)
        self.written.append(name)

    def publish(self, replaced: re.Pattern[str], entries: Collection[str]) -> list[str]:
        """Put the written files in place of the files matching ``replaced`` (the previous
        export's): those go first, the ones named in ``entries`` before the rest; then the
        written files come, those in ``entries`` last. Returns the names that went and were
        not written again."""
        assert self._staging is not None, "create() first"
        fsync_dir(self._staging, self._fsync)
        old = sorted((p.name for p in self.path.iterdir() if replaced.match(p.name)),
                     key=lambda n: n not in entries)
        for name in old:
            (self.path / name).unlink()
        fsync_dir(self.path, self._fsync)
        new = sorted(self.written, key=lambda n: n in entries)
        for name in new:
            if name in entries:
                fsync_dir(self.path, self._fsync)  # the shards are in place before it
            os.rename(self._staging / name, self.path / name)
        for d in (self.path, *(made.parent for made in self._made)):
            fsync_dir(d, self._fsync)
        self._staging.rmdir()
        self._staging = None
        return [n for n in old if n not in self.written]

    def close(self) -> None:
        """Remove the staging directory, if the files were not published, and give the
        directory up (idempotent)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with it
            self._fd = -1


def _in_the_way(path: Path) -> tuple[Path, str, str] | None:
    """The first of ``path``'s parents, or ``path``, that exists and is not a directory: the
    path, what it is and what to do about it (besides giving another path); None if none
    is."""
    for d in (*reversed(path.parents), path):
        if not os.path.lexists(d) or d.is_dir():
            continue
        what = "a file" if d.is_file() else "not a directory"
        if not d.is_symlink():
            return d, f"is {what}", ("remove it, or " if d.is_file() else "")
        if not d.exists():
            return (d, f"is a link to {os.readlink(d)}, which does not exist",
                    "make that directory or remove the link, or ")
        return d, f"is a link to {os.readlink(d)}, {what}", "remove the link, or "
    return None


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
