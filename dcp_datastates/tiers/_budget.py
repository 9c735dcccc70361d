"""The overhead budget (``max_overhead``): which saves the training thread can afford.

A save costs the training thread its ``save()`` call, the guard's waits for its snapshot
(:meth:`CheckpointManager.wait_for_staging`), and the slowdown of the loop while it is in
flight (CheckFreq's measure): its snapshot copies and its memory commit run on other threads,
yet slow the training steps (GIL, memory bandwidth) without waiting anywhere. :class:`Drag`
measures that slowdown on the intervals between ``save()`` calls (a step, or N steps): against
a baseline, the median of the recent *quiet* intervals (no save in flight), an interval that a
save in flight overlaps is charged ``interval - baseline``, at most the time the save ran in
it, less where it is shorter (a loop catching up). Until QUIET_MIN quiet intervals give a
baseline (the first save's), those intervals are kept,
earning nothing (conservative: no save but the first is paid for before the loop's pace is
known), and are charged and earned on once it exists. The training time is the time between
saves less all those costs.

Each rank keeps an :class:`Account`: training time earns ``max_overhead`` seconds of cost per
second, each cost is spent as it is measured, and a save is taken when the account
holds what a save costs (an average of the recent saves' costs, the newest weighted most). The
account holds at most one save's cost plus what a typical interval earns (the baseline's): a
long pause lets one save through, not a burst, and an interval a few ms slower than the baseline
(noise, charged to the saves in flight) does not leave the account just short of a save whose
cost the intervals earn with room to spare (capped at one save's cost, the account took
saves more rarely than their cost allowed).

While the memory tier is being set up (its slots sized and pinned in the background, after
``prepare()`` or the first save), the loop may run slower, a save in flight or not: that is the
tier's one-time cost, not a save's. An interval of the set-up that a save in flight overlaps is
charged to no save and earns what a typical interval does (the baseline's, once known), so the
set-up neither starves the account nor pays for a burst of saves. A wait in it is no set-up's
slowdown, and is told apart by being measured, not guessed from the interval's length: every
wait of the training thread on a save through the manager (the guard's for its snapshot,
``handle.result()`` and ``manager.wait()`` for its commit) is timed and charged
(:meth:`Budget.wait`). One interval that no save overlaps is a quiet interval like any other
(the set-up runs on other threads, and a set-up that lasts longer than the first intervals must
not leave the loop without a baseline: no save but the first would be paid for). A save's call
is charged as always.

A save is skipped at once (nothing staged, nothing written) when the account cannot pay for it,
when the previous save's snapshot is still copying (taking it would make the guard wait on the
CPU; copies issued on the GPU do not count: the training's next work queues behind them), or
when no memory-tier slot is free (it would be copied into the tier, seconds of work). While the
tier's slots are being made, a save that finds none ready is taken all the same where its GPU
has room to keep a snapshot of the state's size aside, one save at a time: it waits there for
the slot on its way (a new or restarted job need not wait for a slot to be made for its first
checkpoint). Without a GPU, or where it has no room, none is (a copy aside into pageable
memory would hold the CUDA driver). Under
``torch.distributed`` the ranks take the same decision for every step (a step saved on some
ranks only could never be restored): one all-reduce (MAX) per save on the manager's gloo group.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable

from ._handles import SaveFigures, SaveHandle, skipped_handle
from ._ranks import Ranks
from ._slots import NextSlot, Slot, SlotPool

log = logging.getLogger("dcp_datastates")

#: Weight of the newest save's cost in the expected cost of a save.
NEWEST_WEIGHT = 0.5
#: Quiet intervals whose median is the baseline of the loop's pace.
QUIET_KEPT = 32
#: Quiet intervals needed before the baseline is used: the first one after a save is often
#: short (the loop catching up on work a save delayed), and alone it made every interval
#: before it look slow (a first save was charged several times its real cost).
QUIET_MIN = 3
#: Why a save is skipped, by precedence (an all-reduce keeps the highest of the ranks').
OVER_BUDGET, NO_SLOT, COPYING = 1, 2, 3
#: What a rank says of another rank's reason.
OTHERS = {OVER_BUDGET: "over its budget", NO_SLOT: "no memory-tier slot free",
          COPYING: "its previous snapshot is still copying"}


def check_max_overhead(value: object) -> None:
    """Raise ValueError unless ``value`` is None or a fraction in (0, 1]."""
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 < value <= 1):
        raise ValueError(f"max_overhead must be None or a number in (0, 1] (a fraction of "
                         f"training time, e.g. 0.05), got {value!r}")


class Account:
    """One rank's account of what its saves cost the training thread, at ``fraction`` of the
    training time (seconds throughout)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.credit = 0.0  # cost the training time allows now, less what was spent
        self.expected: float | None = None  # what a save costs (None: no save measured yet)
        self._guessed = False  # expected is the first save's cost before its commit ended

    def earn(self, training_s: float, typical_s: float) -> None:
        """``training_s`` of training went by: credit, up to one save's cost plus what a
        typical interval (``typical_s``) earns."""
        if self.expected is not None:
            self.credit = min(self.credit + self.fraction * max(0.0, training_s),
                              self.expected + self.fraction * typical_s)

    def spend(self, cost_s: float) -> None:
        """Spend ``cost_s`` (negative: a slowdown charged before is paid back)."""
        self.credit -= cost_s

    def guess(self, cost_s: float) -> None:
        """The first save's snapshot is over, its commit not yet: expect ``cost_s`` till then."""
        if self.expected is None:
            self.expected, self._guessed = cost_s, True

    def settle(self, cost_s: float) -> None:
        """A save is over (its commit too) and cost ``cost_s`` in all: the expected cost
        follows (it replaces a guess)."""
        old = self.expected
        self.expected = (cost_s if old is None or self._guessed
                         else old + NEWEST_WEIGHT * (cost_s - old))
        self._guessed = False

    def affords(self) -> bool:
        """Whether a save fits (the first one always does: nothing is known of its cost)."""
        return self.expected is None or self.credit >= self.expected

    def why_not(self) -> str:
        expected = self.expected
        assert expected is not None  # asked only where affords() is False
        short = (expected - self.credit) / self.fraction
        owed = (f" (the account owes {-self.credit:.3f} s: slowdowns charged to earlier saves)"
                if self.credit < 0 else "")
        return (f"budget: a save costs the training thread about {expected:.3f} s, which "
                f"max_overhead={self.fraction:g} earns in {expected / self.fraction:.2f} s "
                f"of training{owed}; {short:.2f} s more are needed")


class _Flight:
    """A save taken, in flight until its memory commit is done (``done_at``, on the clock)."""

    def __init__(self, handle: SaveHandle, clock: Callable[[], float]) -> None:
        self.handle, self.done_at = handle, None
        handle.committed.add_done_callback(lambda _: setattr(self, "done_at", clock()))


class Drag:
    """How much the saves in flight slow the loop: each interval between ``save()`` calls
    that a save in flight overlaps is charged its excess over the baseline (the median of
    the last QUIET_KEPT quiet intervals), at most the time the saves ran in it (less the
    guard's waits, charged apart), shared among the saves it overlaps. An interval shorter
    than the baseline counts against them, as does the one right after their commits (the
    loop catching up on work they delayed; not a quiet interval)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._quiet: deque[float] = deque(maxlen=QUIET_KEPT)
        self._flying: list[_Flight] = []
        self._pending: list[tuple[float, float, list[SaveHandle]]] = []  # before a baseline
        self._landed: list[SaveHandle] = []  # commits done in the last interval
        # training seconds of intervals of the tier's set-up with saves in flight, before a
        # baseline (they earn once there is one)
        self._setting_up: list[float] = []

    def track(self, handle: SaveHandle) -> None:
        """``handle`` was taken: it is in flight until its memory commit is done."""
        self._flying.append(_Flight(handle, self.clock))

    def interval(self, start: float, end: float, training_s: float,
                 waited_s: float, setting_up: bool = False) -> tuple[float, float]:
        """The loop ran from ``start`` to ``end`` (``training_s`` of it outside the guard's
        waits): the slowdown to charge now and the training time it leaves to earn on (an
        interval kept for want of a baseline earns nothing until one exists). An interval
        ``setting_up`` the tier while saves are in flight is charged to no save and earns at
        most the baseline; one with none in flight is a quiet interval as any other."""
        flights = [f for f in self._flying if f.done_at is None or f.done_at > start]
        landed, self._landed = self._landed, [f.handle for f in flights
                                              if f.done_at is not None and f.done_at <= end]
        if not flights and landed:
            return self._overlap((training_s, 0.0, landed))  # only shorter counts: ran 0
        if not flights:
            self._quiet.append(training_s)
            if len(self._quiet) < QUIET_MIN:
                return 0.0, training_s
            pending, self._pending = self._pending + [(training_s, 0.0, [])], []
            charged = [(self._charge(*p), p[0]) for p in pending]
            set_up, self._setting_up = self._setting_up, []
            return (sum(c for c, _ in charged),
                    sum(t - c for c, t in charged) + sum(self._set_up(t) for t in set_up))
        ran = max(end if f.done_at is None else min(f.done_at, end) for f in flights) - start
        overlap = (training_s, max(0.0, ran - waited_s), [f.handle for f in flights])
        if setting_up:  # slowed by the set-up, not by the saves: charged to none
            if len(self._quiet) >= QUIET_MIN:
                return 0.0, self._set_up(training_s)
            self._setting_up.append(training_s)
            return 0.0, 0.0
        return self._overlap(overlap)

    def baseline(self) -> float:
        """The median of the recent quiet intervals (0.0 until QUIET_MIN were seen)."""
        return statistics.median(self._quiet) if len(self._quiet) >= QUIET_MIN else 0.0

    def over(self, now: float) -> list[SaveHandle]:
        """The saves whose commit was done by ``now`` and whose slowdown is all charged."""
        owed = {id(h) for p in self._pending for h in p[2]} | {id(h) for h in self._landed}
        over = [f for f in self._flying if f.done_at is not None and f.done_at <= now
                and id(f.handle) not in owed]
        self._flying = [f for f in self._flying if f not in over]
        return [f.handle for f in over]

    def _overlap(self, overlap: tuple[float, float, list[SaveHandle]]) -> tuple[float, float]:
        """Charge an interval of saves (kept until there is a baseline)."""
        if len(self._quiet) < QUIET_MIN:
            self._pending.append(overlap)
            return 0.0, 0.0
        slowdown = self._charge(*overlap)
        return slowdown, overlap[0] - slowdown

    def _set_up(self, training_s: float) -> float:
        """The training time an interval of the tier's set-up earns on: at most a baseline's
        (a one-time slowdown pays for no burst of saves)."""
        return min(training_s, self.baseline())

    def _charge(self, training_s: float, ran_s: float, handles: list[SaveHandle]) -> float:
        """Charge an interval's excess over the baseline (at most ``ran_s``; negative where it
        is shorter, so a save's charge is its net slowdown) to ``handles``."""
        if not handles:
            return 0.0
        extra = min(training_s - self.baseline(), ran_s)
        _share(extra, handles)
        return extra


class Budget:
    """Takes or skips this rank's saves under ``max_overhead``, with the other ranks; times
    the training thread by ``clock``; puts the figures of skipped saves in ``history``.
    ``save()`` calls :meth:`decide` then, for a save taken, :meth:`taken`; the guard's waits go
    through :meth:`wait`."""

    def __init__(self, max_overhead: float, clock: Callable[[], float], ranks: Ranks,
                 history: deque[SaveFigures]) -> None:
        self.account = Account(float(max_overhead))
        self.drag = Drag(clock)
        self.clock, self.ranks, self.history = clock, ranks, history
        self._open: SaveHandle | None = None  # the last save taken, until its snapshot is over
        self._mark: float | None = None  # when the last save() returned
        self._waited = 0.0  # the guard's waits since then
        self._call = 0.0  # when this save() began
        self._skipping = False  # in a burst of skipped saves (logged once)
        self._trainer: threading.Thread | None = None  # the thread calling save()

    def decide(self, step: int, slots: SlotPool | None,
               slot: Slot | NextSlot | None) -> SaveHandle | None:
        """At the start of ``save(step)``: None to take it, else its skipped handle (logged at
        the first skip of a burst). ``slot``: the slot of the memory tier's ``slots`` taken
        for it, or the next to come (given back if it is skipped; None with ``slots``: none
        was free). Collective under ``torch.distributed``."""
        now = self._call = self.clock()
        self._trainer = threading.current_thread()
        if self._mark is not None:
            slowdown, training = self.drag.interval(
                self._mark, now, now - self._mark - self._waited, self._waited,
                setting_up=slots is not None and slots.readying())
            self.account.spend(slowdown)
        self._close_open(now)
        if self._mark is not None:
            self.account.earn(training, self.drag.baseline())
        code, reason = self._local_reason(slots is not None and slot is None)
        agreed = self.ranks.most(code * self.ranks.world + self.ranks.rank if code else -1)
        if agreed < 0:
            self._skipping = False
            return None
        if not code:
            code, rank = divmod(agreed, self.ranks.world)
            reason = f"rank {rank}: {OTHERS[code]}"
        if not self._skipping:
            log.info("dcp_datastates: save of step %d skipped (%s); further saves skipped in a "
                     "row are not logged", step, reason)
            self._skipping = True
        if slot is not None:
            assert slots is not None  # a slot comes from slots
            slots.give_back(slot)
        handle = skipped_handle(step, reason)
        self.history.append(handle.figures)
        self._end_call(open_figures=False)
        return handle

    def taken(self, handle: SaveHandle) -> None:
        """The save ``handle`` was started: its call's cost is spent; its snapshot's waits
        are charged to it until the snapshot is over, the loop's slowdown until its commit
        is."""
        self._open = handle
        self.drag.track(handle)
        handle.figures.cost_s = 0.0
        self._end_call(open_figures=True)

    def wait(self, wait: Callable[[], None]) -> None:
        """Run ``wait``, the training thread's wait on the saves (the guard's for their
        snapshots, ``handle.result()`` or ``manager.wait()`` for their commits); spend the time
        it took (where the step's GPU work queues behind the copies instead, a delay shows in
        the intervals). A wait on another thread than the one calling ``save()`` costs the
        training nothing here. A wait that raises (a timeout, the save's error) is spent too."""
        if threading.current_thread() is not self._trainer:
            return wait()
        start = self.clock()
        try:
            wait()
        finally:
            waited = self.clock() - start
            self._charge(waited, open_figures=True)
            self._waited += waited

    def _local_reason(self, no_slot: bool) -> tuple[int, str]:
        """This rank's reason to skip the save (0: none)."""
        if self._open is not None:
            return COPYING, f"the snapshot of step {self._open.step} is still copying"
        if no_slot:
            return NO_SLOT, ("no memory-tier slot free (earlier saves are still being "
                             "committed, or the next slot is still being made)")
        if not self.account.affords():
            return OVER_BUDGET, self.account.why_not()
        return 0, ""

    def _close_open(self, now: float) -> None:
        """The last save taken is open until its snapshot is over or its copies are issued on
        the GPU; a save is settled once its commit is done and its slowdown charged."""
        handle = self._open
        if handle is not None and (handle.staged.done() or (
                handle.staging_ordered is not None and handle.staging_ordered())):
            self.account.guess(_cost(handle))
            self._open = None
        for handle in self.drag.over(now):
            handle.figures.cost_s = max(0.0, _cost(handle))  # a net gain is no cost
            self.account.settle(handle.figures.cost_s)

    def _end_call(self, open_figures: bool) -> None:
        end = self.clock()
        self._charge(end - self._call, open_figures)
        self._mark, self._waited = end, 0.0

    def _charge(self, cost_s: float, open_figures: bool) -> None:
        """Spend ``cost_s``; with ``open_figures``, it is the open save's cost too."""
        self.account.spend(cost_s)
        if open_figures and self._open is not None:
            self._open.figures.cost_s = _cost(self._open) + cost_s


def _share(cost_s: float, handles: list[SaveHandle]) -> None:
    """Add ``cost_s`` to the costs of ``handles`` (saves the budget tracks), in equal parts."""
    for handle in handles:
        handle.figures.cost_s = _cost(handle) + cost_s / len(handles)


def _cost(handle: SaveHandle) -> float:
    """The cost so far of a save the budget tracks (:meth:`Budget.taken` set it to 0.0)."""
    cost = handle.figures.cost_s
    assert cost is not None, "a save the budget tracks has a cost"
    return cost
