"""``benchmarks/bench_training.py --cpu-smoke`` under torchrun with two ranks (gloo, FSDP2 on
CPU): every mode trains its steps, the DCP modes' last checkpoints load back bit for bit, and
the restarts (the lost rank from its peer's replica, then from the durable tier) resume the
saved state bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_training.py"
MODES = ["none", "dcp_pinned", "ours", "tiers", "tiers_replicate", "tiers_budget",
         "tiers_every_step", "none#2"]
SMOKE_STEPS = 8


def test_torchrun_cpu_smoke_two_ranks(tmp_path: Path) -> None:
    memory = Path(tempfile.mkdtemp(prefix="bench_training_", dir="/dev/shm"))
    out = tmp_path / "bench.json"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(BENCH), "--cpu-smoke", "--json", str(out), "--dir", str(tmp_path / "ckpt"),
             "--memory-dir", str(memory / "tiers")],
            capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    assert res["world"] == 2
    assert {m: len(res["runs"].get(m, {}).get("step_s", [])) for m in MODES} == {
        m: SMOKE_STEPS for m in MODES}
    assert res["ckpt_bytes"] == sum(res["ckpt_bytes_per_rank"])
    assert {m: r["bit_exact"] for m, r in res["loads"].items()} == {"ours": True,
                                                                    "dcp_pinned": True}
    restart = res["restart"]
    assert restart["mode"] == "tiers_replicate"
    assert restart["replica"]["lost"] == "rank 1's memory tier"
    assert (restart["replica"]["bit_exact"], restart["durable"]["bit_exact"]) == (True, True)
    assert restart["replica"]["step"] == restart["durable"]["step"] == SMOKE_STEPS
