"""The timed training loop of one mode, and one mode's figures over the ranks."""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

from harness.baselines import futures
from harness.states import host_copy, state_bytes
from harness.timing import DoneAt, step_sync, sync

from .modes import Context, Mode

log = logging.getLogger("dcp_datastates.bench")


def run_mode(mode: Mode, cx: Context, path: Path, rec: dict, keep: bool = False) -> dict | None:
    """Warm up (untimed, before the mode's saver is made: what it sets up on first use is on
    the clock), then time ``--steps`` steps, starting a checkpoint every ``mode.interval``
    steps. Each step is timed between synchronizations of the training's stream (as
    ``loss.item()`` does; a device-wide synchronize would also wait for checkpoint copies on
    side streams, which no training loop does). With ``keep``, returns a host copy of the
    state the last checkpoint holds (the last step starts one: nothing changes it after)."""
    tr, a = cx.tr, cx.tr.args
    rec.update(step_s=[], ckpt_steps=[], block_s=[], state_dict_s=[], upload_wait_s=[],
               wait_s=[], staged_s=[], durable_s=[])
    every = mode.interval(a)
    pending = None  # (response, call time, staged stamp, durable stamp)
    earlier: list[tuple] = []  # checkpoints not waited for (mode.wait_previous False)
    staging = None  # snapshot_before_step: the staging future to wait for
    state = None
    host = None

    def wait_staging() -> None:
        nonlocal staging
        t = time.perf_counter()
        if staging is not None:
            staging.result()
            staging = None
        rec["wait_s"].append(time.perf_counter() - t)

    def finish(p: tuple) -> None:
        resp, t_call, staged, durable = p
        futures(resp)[1].result()
        rec["durable_s"].append(durable.wait() - t_call)
        rec["staged_s"].append(staged.wait() - t_call if staged is not None else None)

    for _ in range(a.warmup):
        tr.step()
    sync()
    with mode.saver(cx, path, rec) if mode.saver else nullcontext() as start:
        ok = False
        try:
            for s in range(1, a.steps + 1):
                step_sync()
                t0 = time.perf_counter()
                tr.step(wait_staging if mode.snapshot_before_step else None)
                if start is not None and s % every == 0:
                    if pending is not None and not mode.wait_previous:
                        earlier.append(pending)
                    elif pending is not None:
                        t = time.perf_counter()
                        finish(pending)
                        rec["upload_wait_s"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    if mode.reuse_state and state is not None:
                        state["step"] = s
                    else:
                        state = tr.state(s)
                    t_call = time.perf_counter()
                    rec["state_dict_s"].append(t_call - t)
                    resp = start(state, s)
                    rec["block_s"].append(time.perf_counter() - t_call)
                    rec.setdefault("ckpt_bytes", state_bytes(state))
                    staged, durable = futures(resp)
                    if mode.snapshot_before_step:
                        staging = staged
                    pending = (resp, t_call, staged and DoneAt(staged), DoneAt(durable))
                    rec["ckpt_steps"].append(s)
                step_sync()
                rec["step_s"].append(time.perf_counter() - t0)
                _note_slow(rec["step_s"], s, mode.label)
            if staging is not None:
                staging.result()
            if keep and state is not None:
                host = host_copy(state)
            ok = True
        finally:
            try:
                for p in [*earlier, pending] if pending is not None else earlier:
                    finish(p)  # the last checkpoint(s): durable time only, no step waits
            except Exception:
                if ok:
                    raise
    return host


def _note_slow(steps: list[float], step: int, mode: str) -> None:
    """Put a step over 1.5x the mode's median so far in the library's log (``--library-log``),
    among the library's own lines of that moment."""
    if len(steps) > 5 and steps[-1] > 1.5 * statistics.median(steps):
        log.info("bench: step %d of %s took %.0f ms", step, mode, 1e3 * steps[-1])


def slowest(recs: list[dict]) -> dict:
    """One mode's figures over the ranks (``recs``: each rank's): a time is the slowest
    rank's (lists of them element by element), a byte count (a key naming bytes) the sum over
    the ranks, anything else rank 0's."""
    out = {}
    for key, first in recs[0].items():
        values = [r.get(key) for r in recs]
        if isinstance(first, dict):
            out[key] = slowest([v or {} for v in values])
        elif "bytes" in key and isinstance(first, int):
            out[key] = sum(values)
        elif isinstance(first, float):
            out[key] = _max(values)
        elif isinstance(first, list) and _numbers(values, len(first)):
            out[key] = [_max(column) for column in zip(*values, strict=True)]
        else:
            out[key] = first
    return out


def _numbers(lists: list, n: int) -> bool:
    return all(isinstance(v, list) and len(v) == n and all(
        x is None or isinstance(x, float) for x in v) for v in lists)


def _max(values: list) -> float | None:
    return max((v for v in values if v is not None), default=None)
