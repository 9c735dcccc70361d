"""The one harness every benchmark runs through; each module does one job.

* ``states``: states to checkpoint (model + optimizer look-alikes of a given size, many tiny
  tensors) and blank / poison / verify of the state a load fills.
* ``ceilings``: the machine's ceilings, measured in the run (pinned GPU copies, O_DIRECT disk
  write and read as dd does them, tmpfs / page-cache write and read), page-cache dropping.
* ``baselines``: DCP's side as the benchmarks run it (the pinned stager, response futures).
* ``timing``: timed calls, medians past the warm-up, completion stamps, rotating the order.
* ``tables``: tables printed side by side (ours vs DCP), stored in the JSON, rendered by
  ``report.py``.
* ``machine``: what the machine is (CPU, GPU, kernel, versions, file systems) and has (room).
* ``run``: one run's command line, date, errors, tables, JSON and PNG.
* ``plots``: the matplotlib pieces of the PNGs.
* ``ranks``: one process, or the ranks torchrun started (process groups, gathers, barriers).
* ``training``: ``bench_training.py``'s model, modes, timed loop, loads and report.
"""

import sys
from pathlib import Path

# Run from a checkout without installing: the repository root goes first on the path.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
