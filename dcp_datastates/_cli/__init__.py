"""``python -m dcp_datastates``: inspect, verify and export DataStates checkpoints; persist
what a job left in its memory tiers. One module per command; ``verify`` and ``export`` read
through the load job (:mod:`.reads`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import CheckpointError
from . import export, inspect, persist, verify


def _build_parser() -> argparse.ArgumentParser:
    """The ``python -m dcp_datastates`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m dcp_datastates",
        description="Tools for checkpoints written by dcp_datastates.DataStatesWriter.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (inspect, verify, export, persist):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, engine: Any = None) -> int:
    """Run the command line; return the exit code. ``engine``: the Engine that ``verify``,
    ``export`` and ``persist`` read and copy with (default: one of the command's own)."""
    args = _build_parser().parse_args(argv)
    args.engine = engine
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone shows here, not at exit
        return code
    except BrokenPipeError:
        # stdout's reader went away (``| head``): stop quietly, as a command killed by SIGPIPE
        # would; what is still buffered for stdout goes to /dev/null at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (OSError, ValueError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
