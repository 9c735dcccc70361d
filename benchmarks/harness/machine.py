"""What the machine is (CPU, GPU, kernel, versions, file systems) and has (disk room, RAM)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

from dcp_datastates._sizes import format_size


def fstype(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it)."""
    path = Path(path).resolve()
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


def meminfo(key: str) -> int:
    """Bytes of ``key`` in /proc/meminfo (MemTotal, MemAvailable)."""
    text = Path("/proc/meminfo").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024


def require(what: str, need: int, has: int, hint: str) -> None:
    """Stop before the run when ``need`` bytes of ``what`` are more than the ``has``."""
    if has < need:
        raise SystemExit(f"{what}: needs {format_size(need)} ({hint}), has {format_size(has)}")


def describe(dirs: list[Path] = ()) -> dict:
    """CPU, memory, GPU, kernel, versions and the target directories' file systems: enough to
    tell runs on different machines (or leases) apart."""
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    info = {"cpu": cpu.group(1).strip() if cpu else platform.processor(),
            "cores": os.cpu_count(), "memory": format_size(meminfo("MemTotal")),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "file_systems": {str(d): fstype(d) for d in dirs}}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        try:
            from cuda import bindings
            info["cuda_bindings"] = bindings.__version__
        except (ImportError, AttributeError):
            info["cuda_bindings"] = None
    return info


def summary(m: dict) -> str:
    """One line of ``describe()``'s figures."""
    gpu = f"{m['gpus']} x {m['gpu']}, " if m.get("gpu") else ""
    fs = ", ".join(f"{d} ({t})" for d, t in m.get("file_systems", {}).items())
    cuda = f" (CUDA {m['cuda']}, cuda-bindings {m.get('cuda_bindings')})" if m.get("gpu") else ""
    return (f"{gpu}{m['cpu']} x {m['cores']} cores, {m.get('memory', '?')} RAM; kernel "
            f"{m['kernel']}; Python {m['python']}; torch {m['torch']}{cuda}"
            + (f"; {fs}" if fs else ""))
