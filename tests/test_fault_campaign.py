"""The fault campaign (``benchmarks/fault_campaign.py``, ``make faults`` runs 50 trials of each
kind): a few trials of each kind stay green, their kills land before the operations end, and
its checks fail a checkpoint that does not load as saved."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MARKS, ROOT, save
from helpers.tiers import flip_payload_byte, make_state

from dcp_datastates import DataStatesWriter, Engine

sys.path.insert(0, str(ROOT / "benchmarks"))
import fault_campaign  # noqa: E402

pytestmark = MARKS
CAMPAIGN = ROOT / "benchmarks" / "fault_campaign.py"


def test_a_few_trials_of_each_kind_stay_green() -> None:
    """Two trials of each kind, the children forked (``--exec ''``: no torch import each);
    ENOSPC only as root (it mounts a tmpfs)."""
    kinds = [k for k in fault_campaign.KINDS if k != "enospc" or os.geteuid() == 0]
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    done = subprocess.run([sys.executable, str(CAMPAIGN), "--trials", "2", "--seed", "3",
                           "--exec", "", "--kinds", ",".join(kinds)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = dict(re.findall(r"^\| (\w+) \| (2 \| \d+ \| 2 \| none) \|$", done.stdout, re.M))
    assert sorted(rows) == sorted(kinds), done.stdout
    killed = sum(int(rows[k].split(" | ")[1]) for k in kinds if k != "enospc")
    assert killed >= 4, f"too few kills landed before the operations ended:\n{done.stdout}"


@pytest.fixture
def campaign(tmp_path: Path, make_engine) -> fault_campaign.Campaign:
    args = fault_campaign.parse(["--trials", "1"])
    engine: Engine = make_engine(host_cache_size="8MiB", io_backend="threads")
    return fault_campaign.Campaign(args, engine, tmp_path)


def test_its_checks_fail_what_does_not_load_as_saved(campaign: fault_campaign.Campaign,
                                                     tmp_path: Path) -> None:
    """A checkpoint with one byte flipped, and a directory without ``.metadata`` where a
    checkpoint must be, fail the trial; an old state or none, where either may be, passes."""
    old, new = make_state(1, big=4096), make_state(2, big=4096)
    directory = tmp_path / "ckpt"
    save(old, directory, DataStatesWriter(engine=campaign.engine))
    campaign.check_loads(directory, [new, old], "the target")
    flip_payload_byte(directory, "big")
    with pytest.raises(fault_campaign.TrialFailed, match="has a .metadata but does not load "
                                                        "as saved"):
        campaign.check_loads(directory, [new, old], "the target")
    campaign.check_loads(tmp_path / "none", [new, None], "the target")
    with pytest.raises(fault_campaign.TrialFailed, match="the target .*none has no .metadata"):
        campaign.check_loads(tmp_path / "none", [new], "the target")
