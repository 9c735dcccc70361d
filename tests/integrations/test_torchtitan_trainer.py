"""torchtitan's own trainer through the examples, killed with SIGKILL and restarted (on CPU).

``examples/torchtitan_resume.py``'s check runs ``examples/torchtitan_train.py --cpu`` (llama3's
debug model on synthetic tokens, sdpa attention, gloo): killed mid-run, then the same command
again; the restart must begin right after the newest committed step and give the losses of an
uninterrupted run digit for digit (one run without checkpoints is the reference of every mode:
checkpoints change no loss). torchtitan 0.2.x only: 0.3's trainer cannot train on the CPU (its
flex attention has no backward there and it refuses sdpa), so with 0.3 installed (or none)
this module is skipped. ``make test`` runs it with torchtitan 0.2.2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from torchtitan_train import legacy_release, parse, stand_ins_for_missing_packages  # noqa: E402

stand_ins_for_missing_packages()
pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is not installed")
if not legacy_release():
    pytest.skip("torchtitan 0.3 trains on CUDA only", allow_module_level=True)

from torchtitan_resume import Outcome, Spec, resume_check, run  # noqa: E402

pytestmark = pytest.mark.mpi_skip
#: Every run: 6 steps of the debug model on the CPU, a checkpoint every 2.
RUN = {"attention": "sdpa", "steps": 6, "interval": 2,
       "extra": ["--cpu", "--training.seq_len", "128"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    """A run to the end without checkpoints (the runs of the module find the repository's
    package through ``PYTHONPATH`` meanwhile)."""
    root = tmp_path_factory.mktemp("reference")
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [path])])
    try:
        out = run(Spec("none", **RUN).command(root / "run", root / "memory"), root / "log")
        assert out.rc == 0 and len(out.losses) == RUN["steps"], "\n".join(out.tail)
        yield out
    finally:
        if path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = path


@pytest.mark.parametrize("mode", ["enable", "tiers"])
def test_trainer_resumes_after_sigkill_with_the_same_losses(reference: Outcome, tmp_path: Path,
                                                            mode: str) -> None:
    result = resume_check(Spec(mode, **RUN), tmp_path, reference)
    tail = (tmp_path / "resumed.log").read_text()[-3000:]
    assert result["ok"], f"{result['problems']}\n{tail}"
    assert result["resumed_at_step"] == result["newest_committed"] + 1
    assert result["steps_compared"] >= 1
    if mode == "tiers":
        assert tuple(result["restored_from"]) == (result["newest_committed"], "memory"), result


def test_cpu_runs_default_to_the_attention_that_trains_there() -> None:
    """flex attention has no backward on the CPU: ``--cpu`` without ``--attention`` takes sdpa
    (the trainer failed at its first step otherwise)."""
    assert parse(["--mode", "none", "--cpu"])[0].attention == "sdpa"
    assert parse(["--mode", "none"])[0].attention == "flex"
    assert parse(["--mode", "none", "--cpu", "--attention", "flex"])[0].attention == "flex"


def test_summary_counts_a_save_the_tier_had_no_room_for_as_not_taken(
        reference: Outcome, tmp_path: Path) -> None:
    """With a memory tier too small for any checkpoint, the interval saves fail (logged,
    training goes on) and the summary names only the last step's, written straight to the
    folder, as taken."""
    spec = Spec("tiers", **{**RUN, "extra": [*RUN["extra"], "--checkpoint.memory_limit", "1MiB"]})
    out = run(spec.command(tmp_path / "run", tmp_path / "memory"), tmp_path / "log")
    assert out.rc == 0 and out.summary is not None, "\n".join(out.tail)
    assert out.summary["checkpoints_taken"] == [RUN["steps"]], out.summary
    assert out.summary["checkpoints_skipped"] == [], out.summary
    assert out.losses == reference.losses
