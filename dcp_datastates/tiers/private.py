"""Tier directories belong to the user: owned by this process's user, writable by no one else.

A tier is trusted: a manager loads its steps (DCP unpickles their bytes items), persists them
and prunes by their step numbers. A directory another local user made or may write (a
predictable path in world-writable ``/dev/shm``, a group-writable directory) lets that user
plant a step, or delete the real ones, so every directory a manager or the ``persist`` command
adopts is checked here first (the ones they make are made 0700 or 0755). The default memory
root is per user (:func:`user_root`).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from ..errors import CheckpointError
from .replica import REPLICAS

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
    me = os.geteuid()
    if st.st_uid != me:
        raise CheckpointError(
            f"{what} {directory} is owned by {_user(st.st_uid)}, not by this user "
            f"({_user(me)}): another user could have put checkpoints there, which would be "
            f"loaded, persisted and pruned as this job's. Use a directory of your own "
            f"(memory_dir=, durable_dir=), or have its owner remove it")
    open_to = [who for who, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
               if st.st_mode & bit]
    if open_to:
        raise CheckpointError(
            f"{what} {directory} is writable by {' and '.join(open_to)} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): another user could add or delete checkpoints "
            f"there. Make it private (chmod go-w {directory}), or use another directory")


def check_tier(directory: Path, what: str) -> None:
    """:func:`check_private` for a tier and the replica directories it holds."""
    check_private(directory, what)
    replicas = directory / REPLICAS
    if replicas.exists() or replicas.is_symlink():
        check_private(replicas, f"replica directory of {what}", follow=False)
        for entry in sorted(replicas.iterdir()):
            if entry.is_dir() or entry.is_symlink():
                check_private(entry, f"replica directory of {what}", follow=False)


def writable(directory: Path) -> bool:
    """Whether this process may make and remove files in ``directory``."""
    return os.access(directory, os.W_OK | os.X_OK)
