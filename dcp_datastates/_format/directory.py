"""The checkpoint directory: one save at a time holds it, and what a commit may delete.

A save's coordinator claims the directory with an ``fcntl`` lock on a file in it before any
rank writes there, and holds it until ``.metadata`` is committed (or the save failed): a save
from another process (or another engine) fails at once with an error naming the directory.
Data file names carry a token unique to the save, and only the claim holder deletes files once
its new ``.metadata`` is committed (data files it does not name, DCP FileSystemWriter's data
files and ``.metadata`` temporaries of saves that died), so no save removes a file another's
metadata names.
Checkpoint files are read through :func:`open_regular` (a regular file, never through a link).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError

#: The most a checkpoint's files and directories allow others, whatever the umask: read and
#: search, never write (a file another user could replace holds pickles that run at load).
FILE_MODE, DIR_MODE = 0o644, 0o755
LOCK_NAME = ".dcp_datastates.lock"
#: Data files: ``__<rank>_<token>.safetensors``.
DATA_FILE_RE = re.compile(r"^__\d+_[0-9a-f]+\.safetensors$")
#: What a committed ``.metadata`` replaces where it does not name it: data files (ours, and
#: DCP FileSystemWriter's ``__<rank>_<n>.distcp``), and ``.metadata.tmp.<token>`` files of
#: commits that died before their rename.
_REPLACED_RE = re.compile(
    r"^__\d+_[0-9a-f]+\.safetensors$|^__\d+_\d+\.distcp$|^\.metadata\.tmp\.[0-9a-f]+$")

#: A URL's scheme: ``s3://``, ``gs://``, ``file://``, ...
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

_FS_NAMES = {
    0x01021994: "tmpfs", 0x858458F6: "ramfs", 0xEF53: "ext4", 0x58465342: "xfs",
    0x9123683E: "btrfs", 0x6969: "nfs", 0x794C7630: "overlayfs", 0x0BD00BD0: "lustre",
    0x65735546: "fuse", 0x47504653: "gpfs",
}
_MEMORY_FS = {0x01021994, 0x858458F6}
_libc = ctypes.CDLL(None, use_errno=True)


def is_url(value: str | os.PathLike) -> bool:
    """Whether a checkpoint directory given as ``value`` is a URL (``s3://bucket/ckpt``)."""
    return isinstance(value, str) and _URL_RE.match(value) is not None


def checkpoint_path(value: str | os.PathLike) -> Path:
    """The checkpoint directory ``value`` names, ``~`` expanded. A URL is refused
    (``ValueError``): as a path it would name a local directory such as ``s3:``."""
    if is_url(value):
        raise ValueError(
            f"checkpoint directory {value!r} is a URL: dcp_datastates saves to and loads from "
            f"a file system path (local or mounted); give a path, e.g. where the object store "
            f"is mounted")
    return Path(os.path.expanduser(value))


def _fs_magic(directory: Path) -> int | None:
    """The file system type (statfs ``f_type``) of ``directory``, None where unknown."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field (a long)
    if _libc.statfs(os.fsencode(directory), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value


def _fs_name(directory: Path) -> str:
    magic = _fs_magic(directory)
    if magic is None:
        return "unknown"
    return _FS_NAMES.get(magic, f"0x{magic:x}")


def memory_backed(directory: Path) -> bool:
    """Whether ``directory`` lives on a memory file system (tmpfs, ramfs)."""
    return _fs_magic(directory) in _MEMORY_FS


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_direct_io(directory: Path) -> None:
    """Raise ValueError, naming the path and file system, where O_DIRECT files cannot be made."""
    where = _existing_ancestor(directory)
    if memory_backed(where):
        raise ValueError(
            f"direct_io=True but {where} is on {_fs_name(where)}, a memory file system where "
            f"O_DIRECT bypasses nothing; pass direct_io=None (use it where it helps) or False")
    probe = where / f".dcp_datastates_probe_{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ValueError(
                f"direct_io=True but {where} is on {_fs_name(where)}, which refuses O_DIRECT; "
                f"pass direct_io=None (use it where possible) or False"
            ) from None
        return  # not writable etc.: the save itself reports that, with its own path
    os.close(fd)
    probe.unlink(missing_ok=True)


class DirectoryClaim:
    """An exclusive, non-blocking ``fcntl`` lock on ``directory``'s lock file (``lock``:
    elsewhere). The lock dies with its process (SIGKILL too): no claim is left behind."""

    def __init__(self, directory: Path, lock: Path | None = None) -> None:
        self.path = lock if lock is not None else directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self.refused(directory) from None
        self._fd = fd

    def refused(self, directory: Path) -> CheckpointError:
        """The error of a claim that another holds."""
        return CheckpointError(
            f"{directory} is being written by another save (it holds {LOCK_NAME}); "
            f"wait for that save to finish or save elsewhere"
        )

    def release(self) -> None:
        """Drop the lock (idempotent); the lock file stays. Unlocked first: a process forked
        meanwhile (a DataLoader worker) shares the descriptor, and would hold it on."""
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def new_token() -> str:
    """A token unique to one save, for its file names."""
    return uuid.uuid4().hex[:16]


def remove_unreferenced(directory: Path, keep: set[str]) -> bool:
    """Delete the files of ``directory`` that its committed ``.metadata`` replaced and does not
    name (``keep``): earlier saves' data files and temporaries (claim held); return whether any
    went."""
    stale = [p for p in directory.iterdir() if _REPLACED_RE.match(p.name) and p.name not in keep]
    for p in stale:
        p.unlink(missing_ok=True)
    return bool(stale)


def fsync_dir(directory: Path, fsync: Callable[[int], None] = os.fsync) -> None:
    """Make a directory's entries (new, renamed or removed files) durable (``fsync`` syncs
    the descriptor)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: Path) -> int:
    """Open a checkpoint file read-only: a regular file only, never through a symbolic link,
    and without waiting (a FIFO under the name fails here instead of hanging the open).

    Raises ``OSError`` (``FileNotFoundError`` when missing) whose ``strerror`` completes
    "<file> ...": "is missing", "is a symbolic link ...", "is not a regular file", ...
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        whys: dict[int | None, str] = {
            errno.ENOENT: "is missing",
            errno.ELOOP: "is a symbolic link (checkpoint files are never opened through one)",
        }
        why = whys.get(exc.errno, f"cannot be opened ({exc.strerror})")
        raise OSError(exc.errno, why, str(path)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device")  # a socket cannot be opened at all
            raise OSError(errno.EINVAL, f"is not a regular file ({kind})", str(path))
        os.set_blocking(fd, True)  # io_uring would answer EAGAIN on an O_NONBLOCK file
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new(tmp: Path, dest: Path, parts: Iterable[bytes | memoryview],
              fsync: Callable[[int], None] = os.fsync) -> None:
    """Write ``parts`` into the new file ``tmp`` (never through a link), fsync it, then rename
    it to ``dest``: no half-written file ever has that name. The caller fsyncs the directory."""

    def fill(f: BinaryIO) -> None:
        for part in parts:
            f.write(part)

    write_new_with(tmp, dest, fill, fsync)


def write_new_with(tmp: Path, dest: Path, fill: Callable[[BinaryIO], object],
                   fsync: Callable[[int], None] = os.fsync) -> None:
    """:func:`write_new`, the file's bytes written by ``fill`` (given the open file). A write
    that fails (a full file system) raises an ``OSError`` naming ``tmp``."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)
    op = "write"
    try:
        with open(fd, "wb") as f:
            fill(f)
            f.flush()
            op = "fsync"
            fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, f"{op} failed: {exc.strerror}", str(tmp)) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
