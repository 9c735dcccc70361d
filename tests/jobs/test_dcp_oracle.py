"""DCP as the oracle, on one rank: states made from seeds (every dtype, views, conjugate and
negative bits, containers, plain values, DTensors), saved through every path users have and
loaded with DataStatesReader, give what DCP's FileSystemWriter and FileSystemReader give.

``DCP_ORACLE_SEEDS`` ("7" or "0-99") or ``DCP_ORACLE_TRIALS`` widen the seeds CI runs;
``make fuzz`` runs a long campaign. A failure names its seed, save path and item.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import MARKS
from helpers.oracle import (
    SAVE_PATHS,
    Meshes,
    Saved,
    child_env,
    differences,
    load_reference,
    load_with,
    make_state,
    report,
    save_reference,
    save_with,
    seeds,
)

from dcp_datastates import Engine

pytestmark = [*MARKS, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

SEEDS = seeds()
#: ``bits``: conjugate and negative views (apart, so that a path failing them fails alone).
PARTS = ("main", "bits")


def _cases() -> list:
    return [pytest.param(path, part, id=f"{path}-{part}") for path in SAVE_PATHS for part in PARTS]


@pytest.fixture(scope="module")
def meshes() -> Iterator[Meshes]:
    """A one-rank gloo group (DTensors, DCP's collectives, PROCESS mode) for the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Meshes.of(1)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def oracle_engine() -> Iterator[Engine]:
    with Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2) as engine:
        yield engine
        assert engine.live_leases() == 0


@pytest.fixture(scope="module")
def process_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every seed's states saved through AsyncCheckpointerType.PROCESS, by a child (torch keeps
    its checkpoint process for the interpreter's life)."""
    root = tmp_path_factory.mktemp("process")
    done = subprocess.run([sys.executable, "-m", "helpers.oracle", "process", str(root),
                           *map(str, SEEDS)], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ORACLE-CHILD-OK" in done.stdout, done.stderr[-4000:]
    return root


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("path", "part"), _cases())
def test_loads_what_dcp_loads(seed: int, path: str, part: str, meshes: Meshes,
                              oracle_engine: Engine, tmp_path: Path,
                              request: pytest.FixtureRequest) -> None:
    bits = part == "bits"
    state = make_state(seed, meshes, bits=bits)
    reference = save_reference(state, tmp_path / "dcp", path)
    if path == "process":
        saved = Saved(path, request.getfixturevalue("process_saves") / f"{seed}-{part}" / "ckpt")
    else:
        saved = save_with(path, state, tmp_path / "ours", oracle_engine)
    problems: list[str] = []
    for mirror in (False, True):
        for full in (False, True):  # full: one process, no_dist, into full tensors
            make = {"meshes": None if full else meshes, "blank": True, "mirror": mirror,
                    "bits": bits}
            ours = load_with(saved, make_state(seed, **make), oracle_engine, no_dist=full)
            theirs = load_reference(reference, make_state(seed, **make), no_dist=full)
            where = f"{path}, {'no_dist' if full else '1 rank'}{', mirror' if mirror else ''}"
            problems += differences(ours, theirs, f"[{where}] state")
    assert not problems, report(problems, seed)


def test_the_oracle_names_each_difference() -> None:
    """The comparison is not blind: a flipped byte, a lost bit, a changed value, a missing key
    are each named by item."""
    theirs, ours = make_state(5, None), make_state(5, None)
    ours["plain"]["mixed"][2]["t"].view(torch.uint8)[0, 1] ^= 1
    ours["plain"]["step"] = "other"
    theirs["bits"] = torch.ones(2, dtype=torch.complex64).conj()
    ours["bits"] = theirs["bits"].resolve_conj()
    del ours["plain"]["deep"]["a"]["b"]["n"]
    assert differences(ours, theirs, "s") == [
        "s.plain.step: 'other', DCP gives " + repr(theirs["plain"]["step"]),
        "s.plain.mixed[2].t: bytes differ from byte 1 of 8 (1 differ)",
        "s.plain.deep.a.b: {'c': " + repr(ours["plain"]["deep"]["a"]["b"]["c"])
        + "}, DCP gives keys ['c', 'n']",
        "s.bits: is_conj() False, DCP gives True",
    ]
