"""``bench_training.py``'s parts, one job each.

* ``model``: the GPT and its training step (FSDP2 over every rank under torchrun).
* ``modes``: the ways to checkpoint that a run compares (DCP's idiom with each writer, the
  ``CheckpointManager`` modes), as users write them.
* ``loop``: the timed training loop of one mode, and one mode's figures over the ranks.
* ``restore``: loads of what the modes saved, checked bit for bit, and the restart figures.
* ``report``: each mode's summary, the tables and the plot.
"""
