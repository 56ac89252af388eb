"""Sizing and membership decisions, fed with plain events (no cluster)."""
import pytest

from elastic_jupyter.config import UsageError
from elastic_jupyter.pool.slots import free_slots
from elastic_jupyter.run.membership import (SlotHealth, cooldown, plan_shrink, plan_trim,
                                        restart_delay)
from elastic_jupyter.run.sizing import (COALESCE_S, Decision, Look, Schedule, SizeRequest, Sizer,
                                        UserRequests)


def sizer(size=2, min_size=1, usable=4):
    return Sizer(size, min_size, usable)


# ------------------------------------------------------------------ sizing

def test_newest_immediate_request_wins_and_is_timed_from_when_it_was_made():
    s = sizer()
    s.submit(SizeRequest(3, time=100.0), now=0)
    s.submit(SizeRequest(1, time=101.0), now=0.01)
    change = s.due(step=10, step_time=105.0)
    assert (change.target, change.requested_time, change.scheduled) == (1, 101.0, False)
    # the request time is used once: the next boundary has nothing to time
    assert s.due(step=11, step_time=106.0).requested_time is None


def test_scheduled_resize_falls_due_exactly_after_its_step_and_is_timed_from_it():
    s = sizer()
    s.take([Schedule([(20, 3), (10, 1)])], step=0, now=0)
    assert s.schedule == [(10, 1), (20, 3)]
    assert s.end_at(world_size=2, ready_spares=0) == 10  # leave exactly after step 10
    assert s.due(step=9, step_time=1.0).target == 2
    change = s.due(step=10, step_time=2.0)
    assert (change.target, change.requested_time, change.scheduled) == (1, 2.0, True)
    assert s.end_at(world_size=1, ready_spares=0) == 20


def test_a_later_immediate_request_overrides_a_schedule_that_fell_due():
    s = sizer()
    s.take([Schedule([(5, 4)])], step=0, now=0)
    assert s.due(step=5, step_time=0.0).target == 4
    s.submit(SizeRequest(2, time=1.0), now=1)
    assert s.due(step=6, step_time=1.5).target == 2


def test_end_at_shrink_at_once_grow_only_when_engines_are_ready_stop_wins():
    s = sizer(size=2)
    assert s.end_at(world_size=2, ready_spares=0) is None
    s.submit(SizeRequest(1), now=0)
    assert s.end_at(world_size=2, ready_spares=0) == 0
    s.submit(SizeRequest(4), now=0)
    assert s.end_at(world_size=2, ready_spares=1) is None  # 2 more needed, 1 ready
    assert s.end_at(world_size=2, ready_spares=2) == 0
    s.submit(SizeRequest(2), now=0)
    s.submit(SizeRequest(3, at_step=50), now=0)
    assert s.end_at(world_size=2, ready_spares=0) == 50
    s.stop()
    assert s.end_at(world_size=2, ready_spares=0) == 0


def test_a_run_of_batch_jobs_grows_by_the_engines_that_are_up():
    s = sizer(size=2)
    s.begin(2, 1, 4, grow_in_parts=True)  # jobs may wait in a scheduler's queue without bound
    s.submit(SizeRequest(4), now=0)
    assert s.end_at(world_size=2, ready_spares=0) is None
    assert s.end_at(world_size=2, ready_spares=1) == 0  # one job runs: it joins now
    assert s.end_at(world_size=3, ready_spares=1) == 0


def test_engines_wanted_counts_the_largest_wish_the_minimum_and_standby_within_bounds():
    s = sizer(size=2, min_size=1, usable=4)
    assert s.engines_wanted(standby=0) == 2
    assert s.engines_wanted(standby=1) == 3
    s.submit(SizeRequest(3, at_step=40), now=0)
    assert s.engines_wanted(standby=0) == 3
    assert s.engines_wanted(standby=5) == 4  # never more than the usable slots
    low = sizer(size=1, min_size=2, usable=4)
    assert low.engines_wanted(standby=0) == 2


def test_the_target_stays_within_the_usable_slots_and_grows_back_when_they_return():
    s = sizer(size=4, usable=4)
    s.set_usable(3)  # a slot was left out for a cooldown
    assert (s.requested, s.target) == (4, 3)
    assert s.end_at(world_size=3, ready_spares=0) is None  # no grow into the missing slot
    assert s.engines_wanted(standby=1) == 3
    s.set_usable(4)  # its cooldown ended
    assert s.target == 4 and s.end_at(world_size=3, ready_spares=1) == 0
    s.stop_growing_at(2)  # engines failed to start: ask for no more than what runs
    assert s.target == 2


def test_a_schedule_is_kept_as_given_for_validation_and_bounded_when_it_falls_due():
    s = sizer(size=2, usable=4)
    s.take([Schedule([(10, 8)])], step=0, now=0)
    assert s.schedule == [(10, 8)]  # the run refuses it with the pool's bounds
    s.set_usable(3)
    assert s.due(step=10, step_time=0.0).target == 3


def test_requests_coalesce_no_boot_until_they_settle():
    s = sizer()
    s.submit(SizeRequest(3), now=10.0)
    s.submit(SizeRequest(1), now=10.0 + COALESCE_S / 3)
    assert not s.settled(10.0 + COALESCE_S / 2)
    assert s.settled(10.0 + COALESCE_S / 3 + COALESCE_S)
    assert s.engines_wanted(standby=0) == 1  # the overridden 3 wants no engine


def test_a_burst_of_requests_ends_the_generation_only_once_it_settled():
    s = sizer()  # 2 engines, 4 usable
    s.submit(SizeRequest(1), now=10.0)
    assert s.end_at(world_size=2, ready_spares=0, now=10.0) == 0  # a lone request acts at once
    s.submit(SizeRequest(2), now=10.0 + COALESCE_S / 3)  # a slider dragged on: a burst
    assert s.end_at(world_size=2, ready_spares=0, now=10.0 + COALESCE_S / 2) is None
    s.submit(SizeRequest(1), now=10.0 + COALESCE_S / 2)
    assert s.end_at(world_size=2, ready_spares=0, now=10.0 + COALESCE_S) is None
    # settled: the newest wish (1) acts, the overridden 2 never did
    assert s.end_at(world_size=2, ready_spares=0, now=10.0 + 2 * COALESCE_S) == 0
    assert s.due(step=5, step_time=0.0).target == 1

def look(**seen):
    values = dict(step=10, world_size=2, ready_spares=0, usable=4, grow_in_parts=False,
                  gave_up=False, swappable=False, training=True, now=100.0)
    return Look(**{**values, **seen})


def test_a_look_returns_one_decision_with_every_choice_in_it():
    s, user = sizer(size=2), UserRequests()
    assert s.look([user], look(), standby=1) == Decision(
        target=2, end_at=None, size_after=2, wanted=3, boot=True, swap=False, stop=False)
    user.add(SizeRequest(4, time=5.0))
    grow = s.look([user], look(now=100.0), standby=0)
    assert [r.size for r in grow.requests] == [4]
    # no engine ready yet; none boots until the request settled (a slider may move on)
    assert (grow.target, grow.end_at, grow.wanted, grow.boot) == (4, None, 4, False)
    ready = s.look([user], look(ready_spares=2, now=101.0), standby=0)
    assert (ready.end_at, ready.size_after, ready.boot, ready.requests) == (0, 4, True, ())
    # the requests a look took are not part of what it decided
    assert grow == Decision(4, None, 4, 4, False, False, False, requests=())


def test_a_look_ends_the_generation_to_swap_ranks_off_slots_given_back_and_follows_the_slots():
    s = sizer(size=3, usable=4)
    swap = s.look([], look(world_size=3, swappable=True), standby=0)
    assert (swap.end_at, swap.swap, swap.target) == (0, True, 3)
    fewer = s.look([], look(world_size=3, usable=2), standby=0)  # a slot left out
    assert (fewer.target, fewer.end_at, fewer.wanted) == (2, 0, 2)
    s.look([], look(world_size=2, usable=4, gave_up=True), standby=0)  # failed starts
    assert s.requested == 2
    assert not s.look([], look(training=False), standby=0).boot  # stopping: boot nothing


def test_a_run_that_grows_in_parts_is_told_so_by_each_look():
    s = sizer(size=2)
    s.submit(SizeRequest(4), now=0)
    assert s.look([], look(ready_spares=1), standby=0).end_at is None  # all at once: wait
    assert s.reachable(4, world_size=2, ready_spares=1, scheduled=False) == 4
    assert s.look([], look(ready_spares=1, grow_in_parts=True), standby=0).end_at == 0
    assert s.reachable(4, world_size=2, ready_spares=1, scheduled=False) == 3
    assert s.reachable(4, world_size=2, ready_spares=1, scheduled=True) == 4  # exact


def test_user_requests_policy_hands_over_what_was_queued_once():
    user = UserRequests()
    user.add(SizeRequest(3))
    user.add(SizeRequest(2))
    s = sizer()
    assert [r.size for r in s.take([user], step=0, now=0)] == [3, 2]
    assert s.requested == 2
    assert s.take([user], step=1, now=1) == []


# ------------------------------------------------------------------ membership

def test_shrink_keeps_the_oldest_ranks_and_keeps_leavers_as_standby_when_wanted():
    members = ["r0", "r1", "r2", "r3"]
    assert plan_shrink(members, target=2, wanted=2, spares=0) == (["r0", "r1"], [], ["r2", "r3"])
    assert plan_shrink(members, target=2, wanted=3, spares=0) == (["r0", "r1"], ["r2"], ["r3"])
    # a spare already ready fills the standby: the leavers stop
    assert plan_shrink(members, target=2, wanted=3, spares=1) == (["r0", "r1"], [], ["r2", "r3"])


def test_trim_stops_spares_beyond_what_is_wanted_newest_first():
    assert plan_trim(["s0", "s1", "s2"], wanted=3, members=2) == (["s0"], ["s1", "s2"])
    assert plan_trim(["s0"], wanted=1, members=2) == ([], ["s0"])
    assert plan_trim(["s0"], wanted=4, members=2) == (["s0"], [])


def test_a_replacement_takes_the_lowest_free_slot_that_is_not_left_out():
    assert free_slots(4, used={0, 2}, excluded=set(), k=1) == [1]
    assert free_slots(4, used={0}, excluded={1}, k=2) == [2, 3]
    with pytest.raises(UsageError, match="1 left out"):
        free_slots(3, used={0, 2}, excluded={1}, k=1)


def test_a_slot_is_left_out_after_repeated_faults_within_the_window():
    health = SlotHealth(limit=3, window=60)
    assert [health.record_fault(1, t) for t in (0, 10, 20)] == [None, None, 10]
    # its count starts again: three more faults, ever longer cooldowns
    assert [health.record_fault(1, t) for t in (40, 41, 42)] == [None, None, 20]
    assert [health.record_fault(1, t) for t in (50, 51, 52)] == [None, None, 40]
    assert health.record_fault(0, 52) is None  # per slot


def test_faults_spread_wider_than_the_window_never_leave_a_slot_out():
    health = SlotHealth(limit=3, window=60)
    assert [health.record_fault(2, 31.0 * k) for k in range(20)] == [None] * 20


def test_cooldowns_double_up_to_the_most():
    assert [cooldown(n, first=10, most=600) for n in (1, 2, 3, 6, 7, 20)] == \
        [10, 20, 40, 320, 600, 600]


def test_a_slot_whose_engine_cannot_start_is_left_out_for_good_after_failures_in_a_row():
    health = SlotHealth(start_limit=2)
    assert health.record_start(3, ok=False) is False
    assert health.record_start(3, ok=True) is False  # a start in between clears it
    assert [health.record_start(3, ok=False) for _ in range(3)] == [False, True, False]


def test_a_slot_with_recent_faults_is_restarted_ever_more_slowly():
    assert [restart_delay(n) for n in range(7)] == [0, 0, 1, 2, 4, 8, 16]
    assert restart_delay(20) == 16
    health = SlotHealth(limit=10, window=60)
    for t in (0, 1, 2, 3):
        health.record_fault(1, t)
    assert health.delay(1, now=4) == 4 and health.delay(0, now=4) == 0
    assert health.delay(None, now=4) == 0
    assert health.delay(1, now=61.5) == 1  # two of them left the window


# ------------------------------------------------------------------ a resize's life in the run log

def test_a_resize_is_done_at_the_first_completed_step_at_the_new_size(tmp_path):
    from elastic_jupyter.run.runlog import RunLog
    log = RunLog(str(tmp_path))
    log.merge({"records": [{"step": s, "time": 100.0 + s, "world_size": 2} for s in (1, 2, 3)]})
    log.resize_started(step=3, old=2, new=3, requested_time=102.5, scheduled=False)
    assert log.resize["pending"] is True and log.resize["latency_s"] is None
    log.merge({"records": []})
    assert log.resize["pending"] is True  # the group is formed, no step at 3 yet
    log.merge({"records": [{"step": 4, "time": 104.0, "world_size": 3}]})
    assert log.resize == {"from": 2, "to": 3, "step": 4, "requested_time": 102.5,
                          "pending": False, "latency_s": 1.5}
    assert [(e["kind"], e["step"]) for e in log.events] == [("resize", 3), ("resized", 4)]


def test_shrink_stops_members_on_slots_the_arbiter_wants_back_whatever_their_age():
    r0, r1, r2, r3 = (Slot(s) for s in (5, 1, 7, 2))
    members = [r0, r1, r2, r3]
    # slot 5 (rank 0's) and slot 2 go back: never kept as spares, even when spares are wanted
    assert plan_shrink(members, target=2, wanted=3, spares=0, leaving_slots=frozenset({5, 2})) \
        == ([r1, r2], [], [r0, r3])
    # one slot back, a shrink by two: the youngest of the rest leaves too (kept as a spare)
    assert plan_shrink(members, target=2, wanted=3, spares=0, leaving_slots=frozenset({1})) \
        == ([r0, r2], [r3], [r1])
    # more members on leaving slots than the shrink removes: the run never drops below target
    assert plan_shrink(members, target=3, wanted=3, spares=0,
                       leaving_slots=frozenset({5, 1, 7})) == ([r0, r1, r3], [], [r2])


class Slot:
    def __init__(self, slot):
        self.slot = slot

    def __repr__(self):
        return f"engine on slot {self.slot}"
