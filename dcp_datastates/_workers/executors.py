"""The engine's threads, each kind in a pool of its own so that no kind of work queues behind
another: one staging thread (snapshots' copies issued in save order), one settle thread (waits
for them to end), I/O threads, checksum threads (one per CPU core the process may run on, shared
among the ranks of the node that run there too) and verification threads (a persist's checks: a
save's checksums never queue behind them)."""

from __future__ import annotations

import os
from concurrent.futures import Executor, ThreadPoolExecutor


class Executors:
    """The pools of one engine; :meth:`shutdown` waits for what they run."""

    def __init__(self, io_workers: int, settle: Executor | None = None) -> None:
        if isinstance(io_workers, bool) or not isinstance(io_workers, int) or io_workers < 1:
            raise ValueError(f"io_workers must be an integer >= 1, got {io_workers!r}")
        self.io_workers = io_workers
        self.hash_workers = max(io_workers, len(os.sched_getaffinity(0)) // _local_ranks())
        self.stage = ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-stage")
        self.settle = settle or ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-settle")
        self.io = ThreadPoolExecutor(io_workers, thread_name_prefix="dcp_datastates-io")
        self.hash = ThreadPoolExecutor(self.hash_workers,
                                       thread_name_prefix="dcp_datastates-hash")
        self.verify = ThreadPoolExecutor(max(1, self.hash_workers // 4),
                                         thread_name_prefix="dcp_datastates-verify")

    def shutdown(self) -> None:
        """Wait for every pool's work; the settle thread after the staging thread (which
        hands it copies to wait for)."""
        for pool in (self.stage, self.settle, self.io, self.hash, self.verify):
            pool.shutdown(wait=True)


def _local_ranks() -> int:
    """Processes of the job on this node, as torchrun or Open MPI tell (1 where neither)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1
