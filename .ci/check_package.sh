#!/usr/bin/env bash
# Packaging check (make test-package; CI runs it after make test). From this working tree: build the
# sdist and, from it, the wheel; check what they hold; install `pip install .`, the sdist and the
# wheel into fresh venvs (PyTorch first: the pinned CPU wheel); and with each, from outside the
# checkout, import every module and save and load a state through io_uring. The project's editable
# .venv gets the same save/load. PYTHON makes the venvs, BUILD_PYTHON runs `python -m build`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
BUILD_PYTHON=${BUILD_PYTHON:-$root/.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0}
tmp=$(mktemp -d)
venv_b=
trap '[ -z "$venv_b" ] || wait "$venv_b" || true; rm -rf "$tmp"' EXIT
mkdir "$tmp/work"  # the smoke test's working directory: nothing of the checkout is importable
unset PYTHONPATH
export PIP_NO_COMPILE=1  # these venvs are short-lived: no .pyc files (PyTorch installs in half the time)

step() { echo "check_package: $* (${SECONDS}s)"; }
# run a command, showing its output only if it fails
quiet() { "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log"; echo "check_package: FAILED: $*"; exit 1; }; }

cat >"$tmp/smoke.py" <<'EOF'
"""Import every module of the installed dcp_datastates (declared dependencies only), then save and
load through io_uring and compare. argv[1]: the directory the package must be imported from."""
import importlib
import pkgutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter, default_engine
from dcp_datastates._format import checksums
from dcp_datastates._io import UringBackend
from dcp_datastates._io.uring import shim_path

pkg = Path(dcp_datastates.__file__).resolve().parent
assert pkg == Path(sys.argv[1]).resolve(), f"dcp_datastates imported from {pkg}, not {sys.argv[1]}"
assert shim_path().is_file(), f"no shim at {shim_path()}"
assert checksums.native() is not None, f"no checksum library at {checksums.NATIVE_PATH}"
for mod in pkgutil.walk_packages(dcp_datastates.__path__, "dcp_datastates."):
    if mod.name != "dcp_datastates.__main__":
        importlib.import_module(mod.name)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
want = {"w": torch.randn(300, 257), "i": torch.arange(1000, dtype=torch.int64), "step": 7}
got = {"w": torch.zeros(300, 257), "i": torch.zeros(1000, dtype=torch.int64), "step": 0}
with tempfile.TemporaryDirectory() as d:
    dcp.save(want, checkpoint_id=d, storage_writer=DataStatesWriter())
    dcp.load(got, checkpoint_id=d, storage_reader=DataStatesReader())
dist.destroy_process_group()
assert isinstance(default_engine().io, UringBackend), default_engine().io
assert torch.equal(got["w"], want["w"]) and torch.equal(got["i"], want["i"]) and got["step"] == 7
print(f"  OK: {pkg}, shim {shim_path().name}, saved and loaded through io_uring")
EOF

smoke() {  # smoke VENV_PYTHON EXPECTED_PACKAGE_DIR
    (cd "$tmp/work" && DCP_DATASTATES_IO=uring "$1" "$tmp/smoke.py" "$2")
}
new_venv() {  # new_venv DIR: a fresh venv with PyTorch
    "$PYTHON" -m venv "$1" && "$1/bin/python" -m pip install "$TORCH"
}
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])'; }

step "editable install in $(dirname "$(dirname "$BUILD_PYTHON")")"
smoke "$BUILD_PYTHON" "$root/dcp_datastates"

new_venv "$tmp/b" >"$tmp/venv-b.log" 2>&1 &  # made meanwhile, for the wheel
venv_b=$!

step "building the sdist and, from it, the wheel"
quiet "$BUILD_PYTHON" -m build --outdir "$tmp/dist" "$root"
sdist=$(echo "$tmp"/dist/*.tar.gz)
wheel=$(echo "$tmp"/dist/*.whl)
"$BUILD_PYTHON" - "$sdist" "$wheel" <<'EOF'
import re
import sys
import tarfile
import zipfile

sdist, wheel = sys.argv[1:]
names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
for need in ("CMakeLists.txt", "pyproject.toml", "native/dcp_uring.c", "native/dcp_uring.h",
             "native/dcp_hash.c",
             "dcp_datastates/__init__.py", "dcp_datastates/_io/uring.py"):
    assert need in names, f"sdist lacks {need}"
bad = [n for n in names if re.match(r"(build|dist|\.venv|benchmarks/out|dcp_datastates/_lib)/", n)]
assert not bad, f"sdist holds build outputs: {bad[:5]}"
with zipfile.ZipFile(wheel) as z:
    assert "dcp_datastates/_lib/libdcp_uring.so" in z.namelist(), "wheel lacks the shim"
    assert "dcp_datastates/_lib/libdcp_hash.so" in z.namelist(), "wheel lacks libdcp_hash.so"
    # every module of every sub-package (the sdist holds the source tree's)
    missing = sorted(n for n in names if n.startswith("dcp_datastates/") and n.endswith(".py")
                     and n not in z.namelist())
    assert not missing, f"wheel lacks {missing[:5]}"
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
deps = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)[^;\n]*$", meta, re.M)
assert {"torch", "safetensors", "xxhash", "numpy"} <= set(deps), deps
print(f"  sdist {len(names)} files; wheel has the shim; requires {', '.join(deps)}")
EOF

step "venv A: pip install . (from the checkout)"
quiet new_venv "$tmp/a"
(cd "$root" && quiet "$tmp/a/bin/python" -m pip install .)
smoke "$tmp/a/bin/python" "$(site "$tmp/a")/dcp_datastates"
ldd "$(site "$tmp/a")/dcp_datastates/_lib/libdcp_uring.so" | grep -q liburing \
    && { echo "check_package: the shim links liburing dynamically"; exit 1; }

step "venv A: pip install the sdist"
quiet "$tmp/a/bin/python" -m pip install --force-reinstall --no-deps "$sdist"
smoke "$tmp/a/bin/python" "$(site "$tmp/a")/dcp_datastates"

step "venv B: pip install the wheel"
wait "$venv_b" || { cat "$tmp/venv-b.log"; echo "check_package: FAILED: venv B"; exit 1; }
venv_b=
quiet "$tmp/b/bin/python" -m pip install "$wheel"
smoke "$tmp/b/bin/python" "$(site "$tmp/b")/dcp_datastates"

step "passed"
