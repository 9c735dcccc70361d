"""The overhead budget of ``CheckpointManager`` (``max_overhead``): saves that do not fit are
skipped at once, their handles and ``history`` say so, one log line per burst of skips, and
restarts see only the steps taken.

Time is a fake clock the tests move (``clock=``); what a save costs the training thread is put
in its ``save()`` call (a ``Stateful`` whose ``state_dict()`` moves the clock) or in the guard's
wait for its snapshot (an engine whose wait moves it). Nothing is timed against the wall clock.
With ``max_overhead=1/16``, steps of 0.5 s earn 1/32 s of cost each and a save costs 1/8 s
(exact in binary): after the first save (paid from an empty account) a save every 4 steps.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import MARKS, Tiers, assert_state_equal, blank_like, rand_tensor
from helpers.fakes import Costly, FakeClock, SlowGuardEngine
from helpers.tiers import HoldWrites

from dcp_datastates import CheckpointManager, guard
from dcp_datastates._io import ThreadPoolBackend
from dcp_datastates.tiers._budget import QUIET_MIN, Account, Budget
from dcp_datastates.tiers._handles import SaveHandle
from dcp_datastates.tiers._ranks import Ranks

pytestmark = MARKS

BUDGET, STEP_S, COST_S = 1 / 16, 0.5, 1 / 8
TIMEOUT = 60
#: The steps of 0..24 taken under that budget at that cost (every 4 steps after the first gap).
TAKEN = [0, 8, 12, 16, 20, 24]


def make_state(step: int) -> dict:
    return {"model": {"w": rand_tensor((32, 16), torch.float32, step),
                      "b": rand_tensor((16,), torch.bfloat16, step + 1)},
            "extra": {"step": step, "tag": f"at {step}"}}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(clock: FakeClock) -> Iterator[SlowGuardEngine]:
    made = SlowGuardEngine(clock, host_cache_size="8MiB", io_backend="threads", io_workers=2)
    yield made
    leases = made.live_leases()
    made.close()
    assert leases == 0, f"{leases} lease(s) still held after the test"


def skip_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "dcp_datastates" and "skipped" in r.getMessage()]


def train(manager: CheckpointManager, clock: FakeClock, engine: SlowGuardEngine,
          steps: range, cost_in: str, state_at: Callable[[int], dict] = make_state
          ) -> list[SaveHandle]:
    """A loop that saves every step: STEP_S of training, the optimizer step (guarded), then
    ``save``; each save taken costs COST_S in its call or in the next guard wait
    (``cost_in``). Every commit is waited for (the tier keeps up)."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = guard(optimizer, source=manager)
    handles = []
    try:
        for step in steps:
            clock.now += STEP_S
            optimizer.step()
            state = state_at(step)
            if cost_in == "call":
                state = {"app": Costly(state, clock, COST_S)}
            handle = manager.save(step, state)
            handles.append(handle)
            if not handle.skipped:
                engine.next_wait_s = COST_S if cost_in == "guard" else 0.0
                manager.wait()
    finally:
        hook.remove()
    return handles


@pytest.mark.parametrize("cost_in", ["call", "guard"])
def test_saves_over_the_budget_are_skipped_and_say_why(tiers: Tiers, clock: FakeClock,
                                                       engine: SlowGuardEngine, logs,
                                                       cost_in: str) -> None:
    with CheckpointManager(memory_dir=tiers.memory, engine=engine, max_overhead=BUDGET,
                           clock=clock) as manager:
        handles = train(manager, clock, engine, range(25), cost_in)
        assert [h.step for h in handles if not h.skipped] == TAKEN
        skipped = [h for h in handles if h.skipped]
        for h in skipped:
            assert h.reason.startswith("budget: ") and "max_overhead=0.0625" in h.reason, h.reason
            assert h.result() is None  # a skip is no failure
            assert h.staged.done() and h.persisted is None
        # the first gap repays the first save too: 7 more steps of training needed at step 1
        assert "; 3.50 s more are needed" in skipped[0].reason, skipped[0].reason
        assert sorted(f.step for f in manager.history if f.skipped) == [h.step for h in skipped]
        taken = [f for f in manager.history if not f.skipped]
        assert [f.step for f in taken] == TAKEN
        assert all(f.cost_s == COST_S for f in taken[:-1])  # the last one's wait never came
        assert manager.latest_step() == TAKEN[-1]
    lines = skip_lines(logs)
    assert len(lines) == len(TAKEN) - 1, lines  # one per burst: 1-7, 9-11, 13-15, ...
    assert [int(re.search(r"step (\d+)", line).group(1)) for line in lines] == [1, 9, 13, 17, 21]
    assert sorted(int(p.name[5:]) for p in tiers.memory.glob("step_*")) == TAKEN[-2:]


def test_a_long_pause_lets_one_save_through_not_a_burst(tiers: Tiers, clock: FakeClock,
                                                        engine: SlowGuardEngine) -> None:
    with CheckpointManager(memory_dir=tiers.memory, engine=engine, max_overhead=BUDGET,
                           clock=clock) as manager:
        train(manager, clock, engine, range(13), "call")
        clock.now += 3600.0  # evaluation, a stall: an hour without saves
        after = train(manager, clock, engine, range(13, 20), "call")
    # one save through, then the steady pace (one every 4; the account's margin of one
    # interval's earnings lets the next come one interval early)
    assert [h.step for h in after if not h.skipped] == [13, 16]


def test_a_restart_after_skipped_saves_loads_the_newest_step_taken(tiers: Tiers,
                                                                   clock: FakeClock,
                                                                   engine: SlowGuardEngine
                                                                   ) -> None:
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine,
                           max_overhead=BUDGET, clock=clock, persist="idle") as manager:
        handles = train(manager, clock, engine, range(23), "guard")
    assert [h.step for h in handles if not h.skipped] == TAKEN[:-1]
    with CheckpointManager(tiers.durable, memory_dir=tiers.memory, engine=engine) as again:
        assert again.latest_step() == 20
        state = blank_like(make_state(20))
        assert again.load(state) == 20
        assert_state_equal(state, make_state(20))
    for root in (tiers.memory, tiers.durable):
        held = {int(p.name[5:]) for p in root.glob("step_*")}
        assert held and held <= set(TAKEN), (root, held)


def test_no_budget_takes_every_save(tiers: Tiers, clock: FakeClock,
                                    engine: SlowGuardEngine, logs) -> None:
    with CheckpointManager(memory_dir=tiers.memory, engine=engine, clock=clock) as manager:
        handles = train(manager, clock, engine, range(10), "call")
        assert not any(h.skipped for h in handles)
        assert [f.step for f in manager.history] == list(range(10))
        assert all(not f.skipped and f.cost_s is None for f in manager.history)
    assert skip_lines(logs) == []


@pytest.mark.parametrize("bad", [-0.05, 0, 1.5, float("nan"), float("inf"), "0.05", True])
def test_bad_max_overhead_is_refused(tiers: Tiers, bad: object) -> None:
    with pytest.raises(ValueError, match="max_overhead"):
        CheckpointManager(memory_dir=tiers.memory, max_overhead=bad)
    assert not tiers.memory.exists()


def test_a_save_while_the_previous_snapshot_copies_is_skipped(clock: FakeClock) -> None:
    history: list = []
    budget = Budget(0.5, clock, Ranks(0, 1, None), history)
    first = SaveHandle(0, Future(), Future())
    assert budget.decide(0, None, None) is None  # the first save: nothing known, taken
    budget.taken(first)
    clock.now += 10.0
    copying = budget.decide(1, None, None)
    assert copying is not None and copying.reason == "the snapshot of step 0 is still copying"
    first.staged.set_result(None)
    clock.now += 10.0
    assert budget.decide(2, None, None) is None
    assert [f.step for f in history] == [1] and history[0].skipped


def test_a_save_after_the_previous_snapshot_is_issued_on_the_gpu_is_taken(
        clock: FakeClock) -> None:
    """Copies issued on the GPU hold the training's next work there, not the training thread:
    the next save does not wait for them to end."""
    history: list = []
    budget = Budget(0.5, clock, Ranks(0, 1, None), history)
    issued = [False]
    first = SaveHandle(0, Future(), Future(), staging_ordered=lambda: issued[0])
    assert budget.decide(0, None, None) is None
    budget.taken(first)
    clock.now += 10.0
    copying = budget.decide(1, None, None)
    assert copying is not None and copying.reason == "the snapshot of step 0 is still copying"
    issued[0] = True
    clock.now += 10.0
    assert budget.decide(2, None, None) is None  # taken, its copies still running
    assert not first.staged.done()
    assert [f.step for f in history] == [1]


def test_a_save_with_no_slot_free_is_skipped(tiers: Tiers, clock: FakeClock, logs) -> None:
    """Commits held back keep the slots (keep_memory=1: 4 of them): the fifth save finds none
    free and is skipped (it would be copied into the tier), not copied; saves cost nothing."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    made = SlowGuardEngine(clock, io_backend=hold, host_cache_size="8MiB", io_workers=2)
    try:
        with CheckpointManager(memory_dir=tiers.memory, engine=made, keep_memory=1,
                               max_overhead=BUDGET, clock=clock) as manager:
            handles = []
            try:
                for step in range(6):
                    clock.now += STEP_S
                    manager.order_after_staging()  # what the guard calls
                    handles.append(manager.save(step, make_state(step)))
            finally:  # a failed assertion must not leave close() waiting for held writes
                hold.gate.set()
            assert [h.skipped for h in handles] == [False] * 4 + [True] * 2, [
                h.reason for h in handles]
            assert handles[4].reason.startswith("no memory-tier slot free")
            manager.wait()
            clock.now += STEP_S
            manager.order_after_staging()
            assert not manager.save(6, make_state(6)).skipped
    finally:
        hold.gate.set()
        leases = made.live_leases()
        made.close()
        hold.close()
    assert leases == 0
    assert len(skip_lines(logs)) == 1
    assert not any("copied into the tier" in r.getMessage() for r in logs.records)


def test_the_slowdown_of_saves_in_flight_is_charged_and_kept_within_the_budget(
        clock: FakeClock) -> None:
    """CheckFreq's measure: a save every step of 0.2 s is asked for; each save taken costs
    5 ms in its call and slows the 3 steps its commit runs in by 7% (the commit ends in the
    third), nowhere a wait. The slowdown is charged: over 2000 steps, what saves cost stays
    within 5% of the quiet training time (plus one save), and saves are taken at the rate
    that allows (one per (5 ms + 3 x 14 ms) / (5% of 0.2 s) = 4.7 steps). Charged only its
call, a save would be taken every step."""
    step_s, call_s, slow_s, fraction, steps = 0.2, 0.005, 0.014, 0.05, 2000
    budget = Budget(fraction, clock, Ranks(0, 1, None), [])
    flying: list[tuple[SaveHandle, int]] = []  # taken, intervals left
    taken, cost = [], 0.0
    for step in range(steps):
        slow = slow_s if flying else 0.0
        clock.now += (step_s + slow) / 2
        for handle, left in flying:
            handle.staged.done() or handle.staged.set_result(None)
            if left == 1:
                handle.committed.set_result(None)  # mid-interval
        flying = [(h, left - 1) for h, left in flying if left > 1]
        clock.now += (step_s + slow) / 2
        cost += slow
        budget.wait(lambda: None)  # the guard: the snapshot is copied already
        if budget.decide(step, None, None) is None:
            handle = SaveHandle(step, Future(), Future())
            clock.now += call_s
            budget.taken(handle)
            taken.append(handle)
            flying.append((handle, 3))
            cost += call_s
    whole = call_s + 3 * slow_s
    assert cost <= fraction * steps * step_s + whole
    # at least one save every 5 steps (4.7 rounded up), the rate of saves that never overlap;
    # saves whose flights overlap share one slowdown and cost less, so a few more are taken
    assert len(taken) >= steps // 5 - 1, len(taken)
    charged = [h.figures.cost_s for h in taken]
    assert sum(charged) == pytest.approx(cost)  # what the saves cost, exactly
    assert max(charged[:-1]) == pytest.approx(whole)


def test_a_pause_while_a_commit_runs_is_charged_only_the_time_it_ran(clock: FakeClock) -> None:
    """An evaluation of an hour while a commit runs is no slowdown of an hour: an interval
    is charged at most the time the saves in flight ran in it."""
    budget = Budget(0.5, clock, Ranks(0, 1, None), [])
    first = SaveHandle(0, Future(), Future())
    second = SaveHandle(QUIET_MIN + 1, Future(), Future())
    first.staged.set_result(None)
    first.committed.set_result(None)
    assert budget.decide(0, None, None) is None
    budget.taken(first)
    for step in range(1, QUIET_MIN + 1):  # quiet seconds: the baseline
        clock.now += 1.0
        if budget.decide(step, None, None) is None:  # taken: a save over at once
            done: Future = Future()
            done.set_result(None)
            budget.taken(SaveHandle(step, done, done))
    clock.now += 1.0
    assert budget.decide(QUIET_MIN + 1, None, None) is None
    budget.taken(second)
    second.staged.set_result(None)
    clock.now += 0.3
    second.committed.set_result(None)  # the commit ran 0.3 s into the hour
    clock.now += 3600.0
    budget.decide(3, None, None)
    assert second.figures.cost_s == pytest.approx(0.3)


def test_a_loop_catching_up_after_a_save_is_no_slowdown(clock: FakeClock) -> None:
    """A save delays where in the step the next save() calls come (the training thread issued
    its work later) but no step is slower: the intervals between calls go 0.26 and 0.2 s while
    it runs, then 0.14 s as the loop catches up, then 0.2 s again. The save is charged its
    call only, not the intervals' ups against the short one that follows them."""
    budget = Budget(0.05, clock, Ranks(0, 1, None), [])
    save = SaveHandle(0, Future(), Future())
    assert budget.decide(0, None, None) is None
    clock.now += 0.01
    budget.taken(save)
    save.staged.set_result(None)
    for step, interval in enumerate([0.26, 0.2, 0.14, 0.2, 0.2, 0.2], start=1):
        clock.now += interval
        if step == 2:
            save.committed.set_result(None)  # the commit ends; the loop catches up next
        budget.decide(step, None, None)
    assert save.figures.cost_s == pytest.approx(0.01)


def test_a_skip_for_an_account_in_debt_says_so() -> None:
    """Slowdowns charged after a cheap save leave the account owing: the reason says so
    (not only that a save costs ~0 s, which alone reads as a contradiction)."""
    account = Account(0.05)
    account.settle(0.002)
    account.spend(0.1)  # a slowdown charged to a save that was taken
    assert not account.affords()
    why = account.why_not()
    assert "about 0.002 s" in why and "the account owes 0.100 s" in why, why
    assert why.endswith("; 2.04 s more are needed"), why


def test_noisy_steps_do_not_starve_cheap_saves(clock: FakeClock) -> None:
    """Steps of 0.22 s that vary by a few ms (as on an H100), saves that cost 4 ms in their
    call and slow the 2 steps their commit runs in by 2 ms: 2.7% of training at a save every
    step, within a budget of 5%. The slower steps charged to the saves in flight must not
    leave the account just short of the next save: nearly every save is taken (capped at one
    save's cost, the account took 69%), and what they cost stays within the budget."""
    step_s, call_s, slow_s, fraction, steps = 0.22, 0.004, 0.002, 0.05, 300
    noise = random.Random(0)
    budget = Budget(fraction, clock, Ranks(0, 1, None), [])
    flying: list[tuple[SaveHandle, int]] = []
    taken, cost, trained = 0, 0.0, 0.0
    for step in range(steps):
        interval = step_s + (slow_s if flying else 0.0) + noise.gauss(0.0, 0.005)
        clock.now += interval / 2
        for handle, left in flying:
            handle.staged.done() or handle.staged.set_result(None)
            if left == 1:
                handle.committed.set_result(None)
        flying = [(h, left - 1) for h, left in flying if left > 1]
        clock.now += interval / 2
        cost += slow_s if flying else 0.0
        trained += step_s
        if budget.decide(step, None, None) is None:
            handle = SaveHandle(step, Future(), Future())
            clock.now += call_s
            cost += call_s
            budget.taken(handle)
            taken += 1
            flying.append((handle, 2))
    assert taken >= 0.85 * steps, taken
    assert cost <= fraction * trained + call_s + 2 * slow_s


class SettingUp:
    """What the budget reads of a memory tier's slot pool: whether it is still being set up
    (its slots sized and pinned); every slot taken is given back at once."""

    def __init__(self, flagged: bool) -> None:
        self.flagged, self.on = flagged, True

    def readying(self) -> bool:
        return self.flagged and self.on

    def give_back(self, slot: object) -> None:
        pass


def _taken_with_a_slow_start(clock: FakeClock, slow: bool, flagged: bool, set_up: int = 20,
                             factor: float = 4, stall: tuple[int, float] | None = None,
                             waited: bool = False) -> list[SaveHandle]:
    """A save asked for at every step of 60, each costing COST_S in its call; while the tier
    is set up (the first ``set_up`` steps, ``slow``) every step takes ``factor`` x STEP_S and
    the first save's commit waits for its slot (until step 20). ``flagged``: the pool says it
    is being set up. ``stall``: (step, seconds) the training thread stalls at that step,
    ``waited``: waiting on the saves (``handle.result()``: through ``Budget.wait``)."""
    budget = Budget(BUDGET, clock, Ranks(0, 1, None), [])
    pool = SettingUp(flagged)
    first: Future = Future()
    taken = []
    for step in range(60):
        setting_up = slow and step < set_up
        clock.now += STEP_S * (factor if setting_up else 1)
        if stall is not None and step == stall[0]:
            def stalled(seconds: float = stall[1]) -> None:
                clock.now += seconds
            budget.wait(stalled) if waited else stalled()
        pool.on = setting_up
        if step == 20 and not first.done():
            first.set_result(None)
        if budget.decide(step, pool, slot=SimpleNamespace()) is not None:
            continue
        clock.now += COST_S
        staged: Future = Future()
        staged.set_result(None)
        committed = first if not taken else staged
        handle = SaveHandle(step, staged, committed)
        budget.taken(handle)
        taken.append(handle)
    return taken


def test_a_slow_start_while_the_tier_is_set_up_does_not_starve_the_budget(
        clock: FakeClock) -> None:
    """The set-up slows every step, a save in flight or not: not the first save's cost. The
    share of saves taken over 60 steps stays within 20% of a steady loop's."""
    steady = _taken_with_a_slow_start(FakeClock(), slow=False, flagged=True)
    start = _taken_with_a_slow_start(clock, slow=True, flagged=True)
    unflagged = _taken_with_a_slow_start(FakeClock(), slow=True, flagged=False)
    assert start[0].figures.cost_s == COST_S
    assert abs(len(start) / len(steady) - 1) <= 0.2, (len(start), len(steady))
    assert unflagged[0].figures.cost_s > COST_S  # charged the set-up's slowdown
    assert len(unflagged) < 0.8 * len(steady), (len(unflagged), len(steady))


def test_a_set_up_that_outlasts_the_first_saves_does_not_starve_the_budget(
        clock: FakeClock) -> None:
    """Slots are made one after the other in the background, so the tier may be set up for
    all of the first 60 steps: the intervals no save overlaps still give the loop's pace, and
    the share of saves taken stays within 20% of a steady loop's (it was the first save
    alone)."""
    steady = _taken_with_a_slow_start(FakeClock(), slow=False, flagged=True)
    start = _taken_with_a_slow_start(clock, slow=True, flagged=True, set_up=60, factor=1.05)
    assert abs(len(start) / len(steady) - 1) <= 0.2, (len(start), len(steady))


def test_a_wait_on_the_saves_while_the_tier_is_set_up_is_charged_not_its_slowdown(
        clock: FakeClock) -> None:
    """The set-up's slowdown is charged to no save, however slow; a wait of the training
    thread on the saves (a caller waiting for a commit through ``handle.result()``) is timed,
    not guessed from an interval's length: charged, and the account then skips the saves it
    cannot pay for."""
    wait_s = 40 * STEP_S
    waited = _taken_with_a_slow_start(clock, slow=True, flagged=True, stall=(5, wait_s),
                                      waited=True)
    assert waited[0].figures.cost_s == COST_S
    assert [h.step for h in waited] == [0]
    stalled = _taken_with_a_slow_start(FakeClock(), slow=True, flagged=True, stall=(5, wait_s))
    assert stalled[0].figures.cost_s == COST_S and len(stalled) > 10, len(stalled)


def test_a_wait_on_another_thread_costs_the_training_nothing(clock: FakeClock) -> None:
    budget = Budget(BUDGET, clock, Ranks(0, 1, None), [])
    assert budget.decide(0, None, None) is None
    budget.taken(SaveHandle(0, Future(), Future()))
    credit = budget.account.credit
    waiter = threading.Thread(target=budget.wait, args=(lambda: setattr(clock, "now", 100.0),))
    waiter.start()
    waiter.join()
    assert budget.account.credit == credit
    budget.wait(lambda: setattr(clock, "now", 130.0))  # the thread that calls save()
    assert budget.account.credit == credit - 30.0


def test_a_wait_that_ends_in_an_error_is_charged_too(clock: FakeClock) -> None:
    """A wait on the saves that raises (``handle.result(timeout=...)`` timing out, or the
    save's own error) cost the training thread its time as any other wait."""
    budget = Budget(BUDGET, clock, Ranks(0, 1, None), [])
    assert budget.decide(0, None, None) is None
    budget.taken(SaveHandle(0, Future(), Future()))
    credit = budget.account.credit

    def times_out() -> None:
        clock.now += 30.0
        raise TimeoutError
    with pytest.raises(TimeoutError):
        budget.wait(times_out)
    assert budget.account.credit == credit - 30.0


def test_a_wait_for_a_commit_through_the_handle_is_a_cost_of_the_saves(
        tiers: Tiers, clock: FakeClock) -> None:
    """The training thread waits 100 s (of its clock) in ``handle.result()`` for a commit
    held back: the budget charges the wait, so the account owes it and the next saves are
    skipped saying so."""
    hold = HoldWrites(ThreadPoolBackend(), tiers.memory)
    made = SlowGuardEngine(clock, io_backend=hold, host_cache_size="8MiB", io_workers=2)

    def commit_after_100_s() -> None:
        hold.held.wait(TIMEOUT)
        clock.now += 100.0
        hold.gate.set()
    try:
        with CheckpointManager(memory_dir=tiers.memory, engine=made, max_overhead=BUDGET,
                               clock=clock) as manager:
            first = manager.save(0, make_state(0))
            releaser = threading.Thread(target=commit_after_100_s)
            releaser.start()
            first.result()
            releaser.join()
            later = []
            for step in range(1, 5):
                clock.now += STEP_S
                manager.order_after_staging()
                later.append(manager.save(step, make_state(step)))
    finally:
        hold.gate.set()
        made.close()
        hold.close()
    assert [h.skipped for h in later] == [True] * 4
    assert "owes" in later[0].reason, later[0].reason


def test_skipped_saves_make_no_slots(tiers: Tiers, clock: FakeClock,
                                     engine: SlowGuardEngine) -> None:
    """A save the budget skips gives its slot back and leaves no spare behind: the tier holds
    the kept steps, the one written last and the spare, as without skips (not one slot more
    per skip, up to the limit: seconds of populating and pinning each)."""
    with CheckpointManager(memory_dir=tiers.memory, engine=engine, max_overhead=BUDGET,
                           clock=clock, keep_memory=2) as manager:
        manager.prepare(make_state(0), wait=True)
        handles = train(manager, clock, engine, range(25), "call")
        manager.wait()
        slots = [*tiers.memory.glob(".slots.*/slot_*"), *tiers.memory.glob("step_*/*.safetensors")]
        taken = [h.step for h in handles if not h.skipped]
        assert len(taken) >= 4 and len(taken) < 25, taken
        assert len(slots) <= manager.keep_memory + 2, sorted(map(str, slots))
