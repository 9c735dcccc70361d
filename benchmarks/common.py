"""Helpers shared by bench_gpu.py and bench_training.py: page cache, dd, machine, error capture."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

# Run from a checkout without installing: the repository root goes first on the path.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2**30


def log(msg: str) -> None:
    print(msg, flush=True)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def guarded(what: str, fn, errors: dict, *args: object, **kwargs: object) -> object:
    """Run ``fn``; on failure log the traceback tail, record it in ``errors`` and return None."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - report and keep the other variants going
        tail = "".join(traceback.format_exception(exc)).strip().splitlines()[-12:]
        log(f"!! {what} FAILED: {type(exc).__name__}: {exc}\n   " + "\n   ".join(tail))
        errors.setdefault(what, []).append(f"{type(exc).__name__}: {exc}")
        return None


class DoneAt:
    """When ``fut`` completed (``time.perf_counter()``), stamped by a done-callback.

    ``wait()`` is needed even after ``fut.result()`` returned: callbacks run after waiters wake.
    """

    def __init__(self, fut: Future) -> None:
        self.t: float | None = None
        self._event = threading.Event()
        fut.add_done_callback(self._stamp)

    def _stamp(self, _: Future) -> None:
        self.t = time.perf_counter()
        self._event.set()

    def wait(self) -> float:
        self._event.wait()
        return self.t


def drop_cache(paths: list[Path]) -> str:
    """Evict files from the page cache: drop_caches if allowed, else fadvise(DONTNEED) each."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def dd(*args: str) -> float:
    """Run dd; return its own elapsed seconds."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "LC_ALL": "C"}).stderr
    return float(re.search(r"copied, ([\d.e+-]+) s", out).group(1))


def disk_ceiling(directory: Path, nbytes: int) -> dict:
    """dd write (O_DIRECT + fsync) and cold read (O_DIRECT) of ``nbytes`` in GiB/s."""
    f, bs = directory / "ddtest", 4 << 20
    count = max(1, nbytes // bs)
    n = count * bs / GiB
    try:
        w = dd("if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "oflag=direct", "conv=fsync")
        direct = True
    except subprocess.CalledProcessError:  # no O_DIRECT here (tmpfs): buffered + fsync
        w = dd("if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "conv=fsync")
        direct = False
    how = drop_cache([f])
    r = dd(f"if={f}", "of=/dev/null", "bs=4M", *(["iflag=direct"] if direct else []))
    f.unlink()
    return {"write_gib_s": n / w, "read_gib_s": n / r, "o_direct": direct, "evict": how}


def fstype(path: Path) -> str:
    best, typ = Path("/"), "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fs = line.split()[:3]
        m = Path(mnt)
        if (m == path or m in path.parents) and len(m.parts) >= len(best.parts):
            best, typ = m, fs
    return typ


def free_bytes(path: str | Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def machine(torch_mod) -> dict:
    """CPU, GPU, versions: enough to tell runs on different leases apart."""
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    info = {"cpu": cpu.group(1).strip() if cpu else platform.processor(),
            "cores": os.cpu_count(), "torch": torch_mod.__version__,
            "python": platform.python_version(), "kernel": platform.release()}
    if torch_mod.cuda.is_available():
        info["gpu"] = torch_mod.cuda.get_device_name()
        try:
            from cuda import bindings
            info["cuda_bindings"] = bindings.__version__
        except (ImportError, AttributeError):
            info["cuda_bindings"] = None
    return info


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or a dash as wide as ``spec`` asks when ``x`` is None."""
    if x is not None:
        return format(x, spec)
    width = re.match(r"\d*", spec).group()
    return "-".rjust(int(width) if width else 1)
