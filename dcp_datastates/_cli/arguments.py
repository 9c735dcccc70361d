"""What the commands share about their arguments: paths, the subcommand scaffold, the engine."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._engine import Engine


def cli_path(arg: str) -> Path:
    """A path argument, ``~`` expanded (quoted, a shell leaves it to us)."""
    return Path(os.path.expanduser(arg))


def add_command(sub: argparse._SubParsersAction, name: str, summary: str,
                description: str) -> argparse.ArgumentParser:
    """A subcommand that takes a checkpoint directory (``PATH``)."""
    p = sub.add_parser(name, help=summary, description=description)
    p.add_argument("path", metavar="PATH", help="checkpoint directory (holds .metadata)")
    return p


def add_quiet(p: argparse.ArgumentParser, *, progress: bool = True) -> None:
    """``-q``/``--quiet``: no notes (see :func:`note`), and no progress bar where the command
    has one."""
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no notes" if progress else "no notes")


def note(args: argparse.Namespace, text: str) -> None:
    """Print ``note: text`` on stderr, unless ``-q`` was given."""
    if not args.quiet:
        print(f"note: {text}", file=sys.stderr)


@contextmanager
def command_engine(args: argparse.Namespace) -> Iterator[Engine]:
    """The engine ``main`` was given (``args.engine``), else one of the command's own, closed
    when the command ends."""
    if args.engine is not None:
        yield args.engine
        return
    with Engine() as engine:
        yield engine
