"""``bench_training.py``'s report: each mode's summary, the tables and the plot.

Times are the slowest rank's; sizes the total over the ranks, and per rank (the total over the
ranks: FSDP2 shards evenly).
"""

from __future__ import annotations

from dcp_datastates._sizes import format_size
from harness.ceilings import GiB
from harness.plots import bars, figure, save
from harness.tables import Table, ratio_table
from harness.timing import median

from .modes import MODES

EARLY = 60  # steps: the budget's share of saves taken up to here, against after


def params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def pct(x: float | None, of: float | None) -> float | None:
    return 100 * x / of if x and of else None


def at(xs: list, i: int) -> object:
    """``xs[i]``, or None past its end (a mode that failed midway)."""
    return xs[i] if i < len(xs) else None


def summarize(rec: dict, base: float | None) -> dict:
    """One mode's figures against ``base``, the median step without checkpoints."""
    steps = rec.get("step_s", [])
    ck = rec.get("ckpt_steps", [])
    med = median(steps)
    mean = sum(steps) / len(steps) if steps else None
    tier = rec.get("tiers") or {}
    taken = set(tier.get("taken_steps", ck))

    def share(early: bool) -> float | None:
        asked = [s for s in tier.get("asked_steps", ck) if (s <= EARLY) == early]
        return 100 * sum(s in taken for s in asked) / len(asked) if asked else None

    return {"median_s": med, "mean_s": mean, "max_s": max(steps, default=None),
            "ckpt_step_median_s": median([t for i, t in enumerate(steps, 1) if i in ck]),
            "slowdown_pct": 100 * (med / base - 1) if med and base else None,
            "mean_slowdown_pct": 100 * (mean / base - 1) if mean and base else None,
            "max_over_base": max(steps) / base if steps and base else None,
            "over_1_5x": sum(t > 1.5 * med for t in steps) if med else None,
            "saves": len(taken) if ck else None, "skipped": tier.get("skipped", 0) if ck else None,
            "taken_early_pct": share(True), "taken_later_pct": share(False),
            "block_median_s": median(rec.get("block_s", [])),
            "state_dict_median_s": median(rec.get("state_dict_s", [])),
            "wait_total_s": sum(rec.get("wait_s", [])) if ck else None,
            "upload_wait_total_s": sum(rec.get("upload_wait_s", [])) if ck else None,
            "durable_median_s": median(rec.get("durable_s", [])),
            "ckpt_bytes": rec.get("ckpt_bytes"), "n_steps": len(steps)}


def tables(res: dict) -> list[Table]:
    out = [step_table(res), *dcp_tables(res), *snapshot_tables(res), *tier_tables(res),
           *restart_tables(res)]
    s = res["summary"]
    if "ours" not in s:
        return out
    metrics = {"mean_s": "mean step", "ckpt_step_median_s": "ckpt step", "max_s": "max step",
               "wait_total_s": "snapshot waits", "upload_wait_total_s": "durable waits",
               "durable_median_s": "durable"}
    pairs = {f"{m} / ours": (r, s["ours"]) for m, r in s.items() if m not in ("none", "ours")}
    return [*out, ratio_table("ratios of times (> 1: ours is faster)", pairs, metrics)]


def sizes(res: dict) -> str:
    world = res["world"]
    return format_size(res["ckpt_bytes"]) + (
        f" in total, {format_size(res['ckpt_bytes'] // world)} per rank" if world > 1 else "")


def step_table(res: dict) -> Table:
    world = res["world"]
    where = (f"{world} ranks, FSDP2 (fully_shard per block and on the model)" if world > 1
             else "one process")
    t = Table(f"training steps: GPT {params(res['n_params'])} params ({res['layers']} layers, "
              f"dim {res['dim']}), {'fp32 (bf16 autocast)' if res.get('fp32') else 'bf16'} + "
              f"AdamW, batch {res['batch']} x seq {res['seq']} per rank on {res['device']}, "
              f"{where}, {res['steps']} steps per mode; checkpoint of {sizes(res)} (model + "
              f"optimizer state) every {res['dcp_every']} steps (DCP modes), every "
              f"{res['every']} (tiers) or every step, to {res['dir']}; managers' slots: "
              + ("prepare(state) in the background, timed from the first step"
                 if res["prepare"] == "background" else
                 "prepare(state, wait=True) off the clock (steady state)"),
              [("mode", ""), ("median ms", ".1f"), ("median +", "+.2f%"), ("mean +", "+.1f%"),
               ("max ms", ".1f"), ("max/none", ".2fx"), (">1.5x med", "d"), ("saves", "d"),
               ("skipped", "d"), (f"taken <={EARLY}", ".0f%"), (f"taken >{EARLY}", ".0f%"),
               ("call ms", ".1f"), ("sd ms", ".1f"), ("wait s", ".3f"), ("durable-w s", ".2f")])
    for mode, r in res["summary"].items():
        t.add(mode, ms(r["median_s"]), r["slowdown_pct"], r["mean_slowdown_pct"],
              ms(r["max_s"]), r["max_over_base"], r["over_1_5x"], r["saves"], r["skipped"],
              r["taken_early_pct"], r["taken_later_pct"], ms(r["block_median_s"]),
              ms(r["state_dict_median_s"]), r["wait_total_s"], r["upload_wait_total_s"])
    t.notes = [
        "times: the slowest rank's; median +: median step vs no checkpoint; mean +: mean step "
        "vs the no-checkpoint median; max/none: the slowest step over that median",
        ">1.5x med: steps over 1.5 x the mode's own median; saves: taken; skipped: refused "
        f"under max_overhead; taken <={EARLY} / >{EARLY}: share of the saves asked for in "
        f"steps 1-{EARLY} / after that were taken",
        "call: the save call; sd: get_state_dict; wait: total wait on the training thread "
        "right before optimizer.step (DCP: staging_completion.result(); ours and tiers order "
        "the step after their copies by themselves, in the step time); durable-w: total wait "
        "for the previous checkpoint to be durable before the "
        "next starts (DCP's idiom keeps one in flight)",
        "CheckpointManager modes: a fresh manager each (keep_memory=2, keep_durable=1, "
        "persist='idle', the default engine); background: "
        "prepare(state) right before the first timed step, as the README says (slots pinned "
        "while training runs); wait: prepare(state, wait=True) off the clock",
        "one-time, before the first timed step: " + (", ".join(
            f"{k} {v:.2f} s" for k, v in res["setup"].items()) or "nothing")]
    if res.get("baseline_drift_pct") is not None:
        t.notes.append(f"baseline drift: the second no-checkpoint run "
                       f"{res['baseline_drift_pct']:+.2f}% vs the first")
    s = res["summary"]
    every = f"every {res['every']} steps"
    goals = [("tiers", "mean_slowdown_pct", 2, f"{every}: mean"),
             ("tiers_replicate", "mean_slowdown_pct", 2, f"{every} with replicas: mean"),
             ("tiers_budget", "mean_slowdown_pct", 5, "every step, max_overhead=0.05: mean")]
    for mode, key, limit, what in goals:
        v = s.get(mode, {}).get(key)
        if v is not None:
            t.notes.append(f"goal: {what} <= +{limit}%: {v:+.2f}% -> "
                           f"{'met' if v <= limit else 'MISSED'}")
    b = s.get("tiers_budget")
    if b and b["over_1_5x"] is not None:
        t.notes.append(f"goal: every step, max_overhead=0.05: no step over 1.5x the median: "
                       f"{b['over_1_5x']} -> {'met' if b['over_1_5x'] == 0 else 'MISSED'}")
    if b and b["taken_early_pct"] is not None and b["taken_later_pct"]:
        off = b["taken_early_pct"] / b["taken_later_pct"] - 1
        t.notes.append(f"goal: the budget's share of saves taken in the first {EARLY} steps "
                       f"within 20% of the later share: {off:+.0%} -> "
                       f"{'met' if abs(off) <= 0.2 else 'MISSED'}")
    return t


def dcp_tables(res: dict) -> list[Table]:
    """Each save of DCP's idiom with either writer: the training's stall, the snapshot against
    the idle D2H ceiling, durable against the disk's write ceiling; the cold loads."""
    runs = {m: res["runs"][m] for m in ("dcp_pinned", "ours") if res["runs"].get(m)}
    if not runs:
        return []
    world, total = res["world"], res["ckpt_bytes"]
    d2h = res.get("copy", {}).get("d2h_gib_s")
    disk = res.get("disk", {})
    base = res["summary"].get("none", {}).get("median_s") or 0.0
    t = Table(f"DCP's idiom: dcp.async_save with a fresh writer every {res['dcp_every']} steps, "
              f"{sizes(res)}; ceilings in this run: idle pinned D2H {d2h or 0:.1f} GiB/s per "
              f"rank (all ranks at once), disk write {disk.get('write_gib_s', 0):.2f} GiB/s "
              f"(every rank its own file at once, O_DIRECT {disk.get('o_direct')})",
              [("mode", ""), ("save", "d"), ("step", "d"), ("stall ms", ".1f"),
               ("steps +ms", ".0f"), ("snapshot s", ".3f"), ("copy s", ".3f"),
               ("GiB/s/rank", ".1f"), ("of D2H", ".0f%"), ("durable s", ".2f"),
               ("agg GiB/s", ".2f"), ("of disk", ".0f%")])
    for mode, r in runs.items():
        steps, waits = r["step_s"], r["wait_s"]
        copies = (r.get("snapshots") or {}).get("copy_s", [])
        for i, s in enumerate(r["ckpt_steps"]):
            staged, durable = at(r["staged_s"], i), at(r["durable_s"], i)
            rate = total / world / GiB / staged if staged else None
            agg = total / GiB / durable if durable else None
            t.add(mode, i + 1, s, ms(r["block_s"][i] + (at(waits, s) or 0)),
                  ms(sum(steps[j] - base for j in (s - 1, s) if j < len(steps))), staged,
                  at(copies, i), rate, pct(rate, d2h), durable, agg,
                  pct(agg, disk.get("write_gib_s")))
    t.notes = [
        "stall: the dcp.async_save call (a fresh writer made in it) + the wait right before "
        "the next optimizer.step (DCP: staging_completion.result(); ours: none, the engine's "
        "step hook queues the step behind the copies on a GPU instead: see steps +ms)",
        "steps +ms: the step that saves and the next one, over two no-checkpoint medians",
        "snapshot: from the call to staging_completion; copy: the GPU time of our snapshot's "
        "copies (writer.last_stats().copy_s); GiB/s/rank: a rank's bytes over the snapshot",
        "durable: from the call to upload_completion (committed); agg GiB/s: every rank's "
        "bytes over it",
        "goals (ours): stall <= 10 ms, snapshot >= 90% of idle D2H, durable >= 90% of the "
        "disk's write ceiling"]
    out = [t]
    loads = res.get("loads") or {}
    if loads:
        lt = Table(f"cold loads of each mode's last checkpoint ({sizes(res)}), page cache "
                   f"dropped; disk cold read ceiling {disk.get('read_gib_s', 0):.2f} GiB/s "
                   f"(every rank its own file at once)",
                   [("mode", ""), ("reader", ""), ("load s", ".2f"), ("agg GiB/s", ".2f"),
                    ("of disk", ".0f%"), ("bit-exact", "")])
        for mode, r in loads.items():
            agg = total / GiB / r["load_s"] if r.get("load_s") else None
            lt.add(mode, r["reader"], r["load_s"], agg, pct(agg, disk.get("read_gib_s")),
                   "yes" if r["bit_exact"] else "NO")
        lt.notes = ["dcp.load into a blank state of the trainer's structure (on its device) "
                    "with a fresh reader; bit-exact: every rank's local shards equal a host "
                    "copy of the state taken at that save"]
        out.append(lt)
    return out


def snapshot_tables(res: dict) -> list[Table]:
    """The snapshots' D2H copies during training against the idle pinned D2H ceiling, the
    memory commits, and the longest step against the median."""
    ceiling = res.get("copy", {}).get("d2h_gib_s")
    runs = {m: r for m, r in res["runs"].items() if r.get("snapshots")}
    if not runs:
        return []
    t = Table(f"snapshots during training: GPU time of a rank's D2H copies against the idle "
              f"pinned D2H ceiling ({ceiling or 0:.1f} GiB/s per rank, all ranks at once, "
              f"measured in this run)",
              [("mode", ""), ("saves", "d"), ("copy s", ".3f"), ("GiB/s", ".1f"),
               ("of idle", ".0f%"), ("worst", ".0f%"), ("snapshot s", ".3f"),
               ("commit s", ".3f"), ("max/median step", ".2f")])
    for mode, r in runs.items():
        snap = r["snapshots"]
        copies = [c for c in snap["copy_s"] if c]
        per_rank = snap["bytes"] / res["world"] / GiB
        rate = per_rank / median(copies) if copies else None
        worst = per_rank / max(copies) if copies else None
        tier = r.get("tiers") or {}
        commits = [m - s for m, s in zip(tier.get("memory_s", []), tier.get("snapshot_s", []),
                                         strict=True) if m is not None and s is not None]
        steps = r.get("step_s", [])
        t.add(mode, len(snap["copy_s"]), median(copies), rate, pct(rate, ceiling),
              pct(worst, ceiling), median([x for x in snap["snapshot_s"] if x is not None]),
              median(commits), max(steps) / median(steps) if steps else None)
    t.notes = ["copy s: median GPU time of a snapshot's device-to-host copies (CUDA events on "
               "the side stream, from the first byte); GiB/s and of idle: a rank's bytes over "
               "it, against the ceiling; worst: the slowest snapshot",
               "snapshot s: median from the save call to the staged snapshot (it includes the "
               "wait for the GPU work queued before the call, whose results it copies)",
               "commit s: median memory-tier commit after the snapshot (memory s - snapshot s)"]
    return [t]


def tier_tables(res: dict) -> list[Table]:
    """Memory commits and persists per minute against the disk's write bandwidth."""
    runs = {m: r["tiers"] for m, r in res["runs"].items() if r.get("tiers")}
    if not runs:
        return []
    disk = res.get("disk", {})
    t = Table(f"checkpoint tiers: memory tier in node memory, persisted to {res['dir']} "
              f"whenever the previous persist is over; disk write ceiling "
              f"{disk.get('write_gib_s', 0):.2f} GiB/s (all ranks at once, O_DIRECT "
              f"{disk.get('o_direct')})",
              [("mode", ""), ("saves", "d"), ("skipped", "d"), ("committed/min", ".1f"),
               ("persisted", "d"), ("per min", ".1f"), ("persist GiB/s", ".2f"),
               ("of disk", ".0f%"), ("memory s", ".2f"), ("first memory s", ".2f")])
    for mode, r in runs.items():
        gib_s = r["persisted"] * r["bytes"] / GiB / r["span_s"] if r["span_s"] else None
        firsts = [m for m in r["memory_s"] if m is not None]
        t.add(mode, r["saves"], r.get("skipped", 0), 60 * r["saves"] / r["span_s"],
              r["persisted"], 60 * r["persisted"] / r["span_s"], gib_s,
              pct(gib_s, disk.get("write_gib_s")), median(r["memory_s"]),
              firsts[0] if firsts else None)
    t.notes = ["saves: taken (committed in memory); skipped: refused under max_overhead; "
               "committed/min: memory-tier checkpoints per minute of training",
               "per min: checkpoints persisted per minute of training; persist GiB/s: their "
               "bytes (every rank's) over the mode's span; of disk: that against the ceiling",
               "memory s: median time from save() to the memory-tier commit (first: the first "
               "save's)"]
    return [t]


def restart_tables(res: dict) -> list[Table]:
    """Time to the first training step of a restart: from memory (a peer's replica for the
    rank whose node was lost) against the durable tier, and a new process (one rank)."""
    rs = res.get("restart")
    if not rs:
        return []
    t = Table(f"restart after {rs['mode']}: new managers on every rank load the newest step "
              f"({sizes(res)}), set_state_dict, one training step",
              [("from", ""), ("lost", ""), ("step", "d"), ("manager s", ".2f"),
               ("load s", ".2f"), ("to first step s", ".2f"), ("bit-exact", "")])
    for key, label in (("replica", "memory" + (" + peer replica" if res["world"] > 1 else "")),
                       ("durable", "durable tier (cold)")):
        r = rs.get(key)
        if r:
            t.add(label, r["lost"] or "-", r["step"], r["manager_s"], r["load_s"],
                  r["to_first_step_s"], "yes" if r["bit_exact"] else "NO")
    rz = rs.get("resume")
    if rz:
        t.add("memory, a new process", "the process", rz["step"],
              rz["marks"]["made"] - rz["marks"]["manager"], rz["load_s"],
              rz["to_first_step_s"], "-")
    t.notes = ["manager: making the new managers; load: that + manager.load (a lost rank's "
               "step sent back by its peer first); to first step: that + set_state_dict + one "
               "step (the bit-for-bit check against a host copy of the saved state is left "
               "out of the clock)"]
    mem, dur = rs.get("replica", {}), rs.get("durable", {})
    h2d = res.get("copy", {}).get("h2d_pageable_gib_s")
    if mem.get("load_s") and h2d:
        rate = res["ckpt_bytes"] / res["world"] / GiB / mem["load_s"]
        t.notes.append(f"memory load: {rate:.1f} GiB/s per rank against pageable H2D "
                       f"{h2d:.1f} GiB/s (measured in this run): {rate / h2d:.0%} (goal >= "
                       f"90%: {'met' if rate >= 0.9 * h2d else 'MISSED'}); to first step over "
                       f"the load: {mem['to_first_step_s'] / mem['load_s']:.2f} (goal <= 2: "
                       f"{'met' if mem['to_first_step_s'] <= 2 * mem['load_s'] else 'MISSED'})")
    if mem.get("to_first_step_s") and dur.get("to_first_step_s"):
        x = dur["to_first_step_s"] / mem["to_first_step_s"]
        t.notes.append(f"durable / memory, time to first step: {x:.1f}x (goal >= 5x: "
                       f"{'met' if x >= 5 else 'MISSED'})")
    if rz:
        t.notes.append(f"new process: manager + load + prepare + first step over the load: "
                       f"{rz['over_load']:.2f} (goal <= 2); its marks and first save (taken "
                       f"while pinning) are in the JSON")
    return [t]


def plot(res: dict, png: object) -> None:
    fig, (ax1, ax2) = figure(2, size=(13, 4.6), width_ratios=(2.2, 1))
    for name, rec in res["runs"].items():
        if rec.get("step_s"):
            mode = MODES[name.split("#")[0]]
            ax1.plot(range(1, len(rec["step_s"]) + 1), [t * 1e3 for t in rec["step_s"]],
                     marker=".", lw=1, label=mode.label + (" (again)" if "#" in name else ""))
    for s in range(res["every"], res["steps"] + 1, res["every"]):
        ax1.axvline(s, color="grey", ls=":", lw=0.8)
    ax1.set_xlabel(f"step (dotted: every {res['every']} steps)")
    ax1.set_ylabel("step time, ms (slowest rank)")
    ax1.legend(fontsize=7)
    rows = {m: r for m, r in res["summary"].items() if r.get("median_s")}
    bars(ax2, list(rows), {label: [ms(r[key]) for r in rows.values()] for key, label in (
        ("median_s", "median"), ("ckpt_step_median_s", "ckpt steps"), ("max_s", "max"))},
         spec=".0f", ylabel="ms")
    m = res["machine"]
    save(fig, png, f"GPT {params(res['n_params'])} params, AdamW, {res['world']} rank(s), batch "
                   f"{res['batch']} x seq {res['seq']}, checkpoint of {sizes(res)}; "
                   f"{m.get('gpu', 'CPU')}")
