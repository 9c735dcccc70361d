"""The README's Python snippets run as written.

A snippet to run is a ```python block right after a ``<!-- snippet: NAME -->`` line. Each runs
in a fresh interpreter on the CPU, in a directory of its own, after a harness that defines
what the snippet leaves to the reader (``model``, ``optimizer``, ``state``, ...) as small
objects; the snippet's text is not changed, except a path named in :data:`PATHS`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import MARKS

pytestmark = MARKS
ROOT = Path(__file__).resolve().parents[1]
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

#: What each snippet leaves to the reader, defined before it runs.
HARNESS = {
    "use": _TRAINING + "steps = 1001\n",
    "tiers": _TRAINING + textwrap.dedent("""\
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
#: What the test checks after each snippet ran.
AFTER = {
    "use": "import os; assert os.path.isfile('ckpt/step_1000/.metadata')\n",
    "tiers": textwrap.dedent("""\
        from dcp_datastates.tiers.steps import committed_steps
        assert committed_steps(Path("durable"))[-1] == 20, committed_steps(Path("durable"))
        import shutil; shutil.rmtree(manager.memory.parent)
        """),
    "process-group": "assert dist.get_world_size() == 1; dist.destroy_process_group()\n",
}
#: Paths of a snippet that stand for the reader's: replaced by ones in the test's directory.
PATHS = {"tiers": {'"/shared/ckpt/run1"': 'str(Path("durable").absolute())'}}


def snippets() -> dict[str, str]:
    found = dict(SNIPPET_RE.findall((ROOT / "README.md").read_text()))
    assert sorted(found) == sorted(HARNESS), "README snippets and the harness disagree"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(HARNESS))
def test_readme_snippet_runs(name: str, tmp_path: Path) -> None:
    code = snippets()[name]
    for path, here in PATHS.get(name, {}).items():
        assert path in code
        code = code.replace(path, here)
    script = tmp_path / f"{name}.py"
    script.write_text("from pathlib import Path\n" + HARNESS[name] + code + AFTER[name])
    env = {k: v for k, v in os.environ.items() if k != "DCP_DATASTATES_IO"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
