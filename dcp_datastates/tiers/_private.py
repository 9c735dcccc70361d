"""Tier directories belong to the user: owned by this process's user, writable by no one else,
and so is every directory above them.

A tier is trusted: a manager loads its steps (DCP unpickles their bytes items), persists them
and prunes by their step numbers. A directory another local user made or may write (a
predictable path in world-writable ``/dev/shm``, a group-writable directory) lets that user
plant a step, or delete the real ones, so every directory a manager or the ``persist`` command
adopts is checked here first (the ones they make are made 0700 or 0755). So is every directory
above it (:class:`TierDirectory`): one that another user owns, or that others may write and is
not sticky, lets them rename the tier away and put theirs in its place. The tier is opened
once, walking the path with ``O_NOFOLLOW`` (each directory checked as it is opened, a symbolic
link read and its target walked the same way), and held open by its holder, which checks before
each use that the path still names the directory held (:meth:`TierDirectory.verify`). The
default memory root is per user (:func:`user_root`).
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import stat
from pathlib import Path

from ..errors import CheckpointError
from ._replica import REPLICAS

log = logging.getLogger("dcp_datastates")

#: Where the default memory tiers of this user live: one directory per user, made 0700 in
#: ``/dev/shm`` (sticky: no other user can rename or remove it once it is ours).
SHM_ROOT = Path("/dev/shm")


def user_root() -> Path:
    """This user's root of default memory tiers: ``/dev/shm/dcp_datastates-<uid>``."""
    return SHM_ROOT / f"dcp_datastates-{os.geteuid()}"


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_private(directory: Path, what: str, *, follow: bool = True) -> None:
    """Raise CheckpointError, saying why and what to do, unless ``directory`` is a directory
    owned by this user (the effective uid) that neither its group nor others may write.
    ``follow``: a symbolic link is followed (a path the user gave); else it is refused."""
    try:
        st = os.stat(directory) if follow else os.lstat(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {directory} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(
            f"{what} {directory} is a symbolic link ({os.readlink(directory)}), not a "
            f"directory of yours: remove it, or give another directory")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{what} {directory} is not a directory")
    _check_mine(st, directory, what)


def _check_mine(st: os.stat_result, directory: Path, what: str) -> None:
    """Raise CheckpointError unless ``st`` (``directory``'s) is this user's and writable by no
    one else."""
    me = os.geteuid()
    if st.st_uid != me:
        raise CheckpointError(
            f"{what} {directory} is owned by {_user(st.st_uid)}, not by this user "
            f"({_user(me)}): another user could have put checkpoints there, which would be "
            f"loaded, persisted and pruned as this job's. Use a directory of your own "
            f"(memory_dir=, durable_dir=), or have its owner remove it")
    open_to = _open_to(st)
    if open_to:
        raise CheckpointError(
            f"{what} {directory} is writable by {open_to} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another user could add or delete checkpoints "
            f"there. Make it private (chmod go-w {directory}), or use another directory")


def _open_to(st: os.stat_result) -> str:
    """Who else may write a file of status ``st`` ("" if no one)."""
    return " and ".join(who for who, bit in (("its group", stat.S_IWGRP),
                                              ("others", stat.S_IWOTH)) if st.st_mode & bit)


#: How a tier path's directories are opened: never through a symbolic link; ``O_PATH``, so a
#: directory the user may search but not list (0711) is passed through.
_WALK = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Symbolic links one walk follows at most (as the kernel's limit).
_MAX_LINKS = 40


def _check_above(st: os.stat_result, above: Path, directory: Path, what: str) -> None:
    """Raise CheckpointError where ``above`` (of status ``st``), a directory the walk to the
    tier ``directory`` passes through, lets another user rename what it holds: another
    user's (neither root nor this user), or writable by others and not sticky."""
    mode = stat.S_IMODE(st.st_mode)
    why = ""
    if st.st_uid not in (0, os.geteuid()):
        why = f"is owned by {_user(st.st_uid)} (mode {mode:04o}), who"
    elif (open_to := _open_to(st)) and not mode & stat.S_ISVTX:
        why = f"is writable by {open_to} (mode {mode:04o}) and not sticky: any of them"
    if why:
        raise CheckpointError(
            f"{what} {directory}: the directory {above} above it {why} could rename the tier "
            f"away and put another in its place, whose checkpoints would be loaded (running "
            f"their pickles) and written to as this job's. Use a directory under directories "
            f"only you or root may change")


def _entry_in_sticky(st_above: os.stat_result, fd: int, name: str, above: Path,
                     directory: Path, what: str) -> None:
    """In a sticky directory others may write (``/tmp``), only an entry of this user's or
    root's is safe from them: raise CheckpointError for another's."""
    if not _open_to(st_above):
        return
    owner = os.stat(name, dir_fd=fd, follow_symlinks=False).st_uid
    if owner not in (0, os.geteuid()):
        raise CheckpointError(
            f"{what} {directory}: {above / name} is owned by {_user(owner)}, in {above} that "
            f"others may write: its owner could replace it. Use a directory of your own")


def _walk(directory: Path, what: str) -> int:
    """Open the directory ``directory`` component by component with ``O_NOFOLLOW``, checking
    every directory passed through (:func:`_check_above`) and the tier itself
    (:func:`_check_mine`); a symbolic link is read and its target walked the same way.
    Return its descriptor."""
    fds, at, links = [os.open("/", _WALK)], [Path("/")], 0
    todo = list(reversed(directory.absolute().parts[1:]))
    try:
        while todo:
            name = todo.pop()
            if name == ".." and len(fds) > 1:
                os.close(fds.pop())
                at.pop()
            if name in ("", ".", ".."):
                continue
            st_above = os.fstat(fds[-1])
            _check_above(st_above, at[-1], directory, what)
            _entry_in_sticky(st_above, fds[-1], name, at[-1], directory, what)
            opened = _open_in(fds[-1], name, at[-1], directory, what)
            if isinstance(opened, int):
                fds.append(opened)
                at.append(at[-1] / name)
                continue
            links += 1
            if links > _MAX_LINKS:
                raise CheckpointError(f"{what} {directory}: too many symbolic links")
            todo.extend(reversed(opened.parts[1:] if opened.is_absolute() else opened.parts))
            if opened.is_absolute():  # walk from the root again
                for fd in fds[1:]:
                    os.close(fd)
                del fds[1:], at[1:]
        _check_mine(os.fstat(fds[-1]), directory, what)
        return fds.pop()
    finally:
        for fd in fds:
            os.close(fd)


def _open_in(fd: int, name: str, above: Path, directory: Path, what: str) -> int | Path:
    """The directory ``name`` in ``fd`` (``above``) open, or the target of the symbolic link
    ``name``; raise, naming it, where it is neither or cannot be opened."""
    try:
        return os.open(name, _WALK, dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(f"{what} {directory} does not exist") from None
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(exc.errno, f"{what} {directory}: cannot open {above / name}: "
                                     f"{exc.strerror}") from None
    if not stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
        raise NotADirectoryError(f"{what} {directory}: {above / name} is not a directory")
    return Path(os.readlink(name, dir_fd=fd))


class TierDirectory:
    """The tier ``path`` opened by :func:`_walk` (every directory on the way checked), held
    open until :meth:`close`; a tier that does not exist yet (a durable tier only loaded
    from) is opened when it comes (:meth:`verify`)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None
        self._id: tuple[int, int] | None = None
        if path.exists() or path.is_symlink():
            self._open()

    def _open(self) -> None:
        self.fd = _walk(self.path, self.what)
        st = os.fstat(self.fd)
        self._id = (st.st_dev, st.st_ino)

    def narrow(self, mode: int) -> None:
        """Take the permission bits ``mode`` lacks from the tier (a ``memory_dir`` made 0755
        becomes 0700: nothing written there is within other users' reach); logged."""
        if self.fd is None:
            return
        now = stat.S_IMODE(os.fstat(self.fd).st_mode)
        if now & 0o777 & ~mode:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
            try:  # (an O_PATH descriptor cannot change the mode)
                os.fchmod(fd, now & ~(0o777 & ~mode))
            finally:
                os.close(fd)
            log.info("dcp_datastates: %s %s was mode %04o: made %04o", self.what, self.path,
                     now, now & ~(0o777 & ~mode))

    def verify(self) -> None:
        """Raise CheckpointError, saying what to do, unless ``path`` still names the directory
        held (a tier renamed away, another put in its place, is never read or written)."""
        if self.fd is None:
            if self.path.exists() or self.path.is_symlink():
                self._open()
            return
        try:
            fd = _walk(self.path, self.what)
        except FileNotFoundError:
            now = None
        else:
            st = os.fstat(fd)
            os.close(fd)
            now = (st.st_dev, st.st_ino)
        if now != self._id:
            raise CheckpointError(
                f"{self.what} {self.path} is no longer the directory this manager checked "
                f"and claimed when it was made ({'nothing' if now is None else 'another'} is "
                f"there now: it was renamed or replaced): nothing is read from it or written "
                f"to it. Close this manager and make a new one, which checks what is there")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def open_tier(directory: Path, what: str) -> TierDirectory:
    """The tier ``directory`` open (:class:`TierDirectory`: it, and every directory above it,
    checked), and the replica directories it holds checked (:func:`check_private`)."""
    tier = TierDirectory(directory, what)
    try:
        replicas = directory / REPLICAS
        if replicas.exists() or replicas.is_symlink():
            check_private(replicas, f"replica directory of {what}", follow=False)
            for entry in sorted(replicas.iterdir()):
                if entry.is_dir() or entry.is_symlink():
                    check_private(entry, f"replica directory of {what}", follow=False)
    except BaseException:
        tier.close()
        raise
    return tier


def writable(directory: Path) -> bool:
    """Whether this process may make and remove files in ``directory``."""
    return os.access(directory, os.W_OK | os.X_OK)
