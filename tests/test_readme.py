"""The Python snippets of the README and of ``docs/`` run as written.

A snippet to run is a ```python block right after a ``<!-- snippet: NAME -->`` line. Each runs
in a fresh interpreter on the CPU, in a directory of its own, after a harness that defines
what the snippet leaves to the reader (``model``, ``optimizer``, ``state``, ...) as small
objects; the snippet's text is not changed, except where :data:`EDITS` says.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import MARKS

pytestmark = MARKS
ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_RE = re.compile(r"^<!-- snippet: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)

_TRAINING = """\
import types
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, batch):
        return types.SimpleNamespace(loss=self.layer(batch).square().mean())

torch.manual_seed(0)
model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = torch.randn(4, 8)
"""
#: The model of the README's example, made afresh (the resume snippet's "as before").
_EXAMPLE_MODEL = """\
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
torch.manual_seed(1)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""
_PLAIN = "plain = getattr(model, 'module', model)\n"

#: What each snippet leaves to the reader, defined before it runs.
HARNESS = {
    "example": "",
    "resume": _EXAMPLE_MODEL,
    "tiers": "",
    "errors": textwrap.dedent("""\
        import torch
        import torch.distributed.checkpoint as dcp
        from dcp_datastates import DataStatesReader, DataStatesWriter
        path = "ckpt"
        dcp.save({"w": torch.ones(3)}, checkpoint_id=path, storage_writer=DataStatesWriter())
        state = {"w": torch.ones(4)}  # another model's
        """),
    "tiers-options": _TRAINING + textwrap.dedent("""\
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        class App:  # a Stateful: what DCP's tutorials checkpoint
            def state_dict(self):
                model_sd, optim_sd = get_state_dict(model, optimizer)
                return {"model": model_sd, "optim": optim_sd}

            def load_state_dict(self, sd):
                set_state_dict(model, optimizer, model_state_dict=sd["model"],
                               optim_state_dict=sd["optim"])

        def train_step():
            model(batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        state, steps = {"app": App()}, 25
        """),
    "process-group": "",
}
#: What the test checks (or keeps) after each snippet ran.
AFTER = {
    "example": _PLAIN + textwrap.dedent("""\
        import os
        from torch.distributed.tensor import DTensor
        assert os.path.isfile("ckpt/step_100/.metadata")
        weights = plain.state_dict()
        if int(os.environ.get("RANK", "0")) == 0 and not any(
                isinstance(v, DTensor) for v in weights.values()):  # FSDP2: shards only
            torch.save({k: v.clone() for k, v in weights.items()}, "expected.pt")
        """),
    "resume": _PLAIN + textwrap.dedent("""\
        if Path("expected.pt").exists():
            expected = torch.load("expected.pt")
            assert all(torch.equal(v, expected[k]) for k, v in plain.state_dict().items())
        assert optimizer.state_dict()["state"], "the optimizer's state was not restored"
        """),
    "tiers": "torch.save(model.state_dict(), 'final.pt')\nprint('start', start)\n",
    "errors": "assert [type(e).__name__ for e in errors] == ['StateDictMismatchError'], errors\n",
    "tiers-options": textwrap.dedent("""\
        from dcp_datastates.tiers._steps import committed_steps
        assert committed_steps(Path("durable"))[-1] == 20, committed_steps(Path("durable"))
        import shutil; shutil.rmtree(manager.memory.parent)
        """),
    "process-group": "assert dist.get_world_size() == 1; dist.destroy_process_group()\n",
}
#: Text of a snippet replaced for the test: the reader's paths by the test directory's.
EDITS = {"tiers-options": {'"/shared/ckpt/run1"': 'str(Path("durable").absolute())'}}


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for document in DOCUMENTS:
        for name, code in SNIPPET_RE.findall(document.read_text()):
            assert name not in found, f"snippet {name!r} twice (again in {document.name})"
            found[name] = code
    assert sorted(found) == sorted(HARNESS), "the documents' snippets and the harness disagree"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str, directory: Path, edits: dict[str, str] | None = None) -> Path:
    """The snippet ``name`` with its harness and checks, written into ``directory``."""
    code = snippets()[name]
    for old, new in {**EDITS.get(name, {}), **(edits or {})}.items():
        assert old in code, (name, old)
        code = code.replace(old, new)
    path = directory / f"{name}.py"
    path.write_text("from pathlib import Path\n" + HARNESS[name] + code + AFTER[name])
    return path


def run(command: list[str], directory: Path, **env: str) -> str:
    """Run ``command`` in ``directory`` on the CPU (no torch.distributed variables unless
    given); its output, once it succeeded."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DCP_DATASTATES_IO", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    clean.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), clean.get("PYTHONPATH"))
                                            if p), CUDA_VISIBLE_DEVICES="", **env)
    proc = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=300,
                          env=clean)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture
def memory_tiers() -> object:
    """Removes the memory tiers (in /dev/shm) that the test's managers leave, as designed."""
    root = Path(f"/dev/shm/dcp_datastates-{os.getuid()}")
    before = set(root.glob("*"))
    yield
    for made in set(root.glob("*")) - before:
        shutil.rmtree(made, ignore_errors=True)


def test_the_example_runs_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    run([sys.executable, str(script("example", tmp_path))], tmp_path)
    run([sys.executable, str(script("resume", tmp_path))], tmp_path)


@pytest.mark.parametrize("wrap", ["DDP", "FSDP2"])
def test_the_example_runs_under_torchrun(tmp_path: Path, wrap: str) -> None:
    """Two ranks on the CPU (gloo for the training too), DDP as written or FSDP2 as the text
    says (``fully_shard`` instead): no hang, and the checkpoint resumes in one process (bit
    for bit where the ranks hold whole tensors: DDP)."""
    edits = {} if wrap == "DDP" else {
        "model = torch.nn.parallel.DistributedDataParallel(model)":
            "torch.distributed.fsdp.fully_shard(model)"}
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script("example", tmp_path, edits))], tmp_path, OMP_NUM_THREADS="1")
    assert Path(tmp_path / "expected.pt").exists() == (wrap == "DDP")
    run([sys.executable, str(script("resume", tmp_path))], tmp_path)


def test_the_tiers_loop_resumes_bit_for_bit_after_a_crash(tmp_path: Path,
                                                          memory_tiers: object) -> None:
    """The loop run whole, and run again after it stopped at step 44: both end with the same
    weights (optimizer, scheduler and data position restored from step 40, in memory)."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    assert "start 0" in run([sys.executable, str(script("tiers", whole))], whole)
    assert "start 0" in run([sys.executable, str(
        script("tiers", stopped, {"range(start, 50)": "range(start, 45)"}))], stopped)
    assert "start 41" in run([sys.executable, str(script("tiers", stopped))], stopped)
    expected, got = torch.load(whole / "final.pt"), torch.load(stopped / "final.pt")
    assert all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.mark.parametrize("name", ["errors", "tiers-options", "process-group"])
def test_the_other_snippets_run(name: str, tmp_path: Path, memory_tiers: object) -> None:
    run([sys.executable, str(script(name, tmp_path))], tmp_path, MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")


def test_one_line_waits_for_an_async_save_of_either_writer(tmp_path: Path) -> None:
    """The README's line for DCP's two return types: our writer's AsyncSaveResponse and
    FileSystemWriter's Future."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter

    line = re.search(r'`(getattr\(r, "upload_completion", r\)\.result\(\))`',
                     (ROOT / "README.md").read_text()).group(1)
    state = {"w": torch.arange(8.0)}
    for name, writer in (("ours", DataStatesWriter()),
                         ("dcp", dcp.FileSystemWriter(tmp_path / "dcp"))):
        r = dcp.async_save(state, checkpoint_id=tmp_path / name, storage_writer=writer)
        eval(line, {"r": r})  # noqa: S307 - the README's own line
        out = {"w": torch.zeros(8)}
        dcp.load(out, checkpoint_id=tmp_path / name, storage_reader=DataStatesReader())
        assert torch.equal(out["w"], state["w"]), name
