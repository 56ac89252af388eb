"""Slots by value (arbiter/value.py), pure: the fair share for runs that report no speed or scale
alike; otherwise no auto run slower than at its fair share, and the rest where it adds most."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from elastic_jupyter.arbiter.fairshare import Demand, allocate
from elastic_jupyter.arbiter.speed import Speed
from elastic_jupyter.arbiter.table import ArbiterError, SlotTable
from elastic_jupyter.run.runlog import RunLog
from elastic_jupyter.run.speed_meter import SpeedMeter

LINEAR = Speed(((1, 2.0), (2, 4.0)))
FLAT = Speed(((1, 3.0), (2, 3.0)))  # input-bound: a second slot adds nothing


def auto(run, arrival, speed=None, lo=1, hi=8, user=None, **kw):
    return Demand(run, user or run, arrival, min=lo, max=hi, auto=True, speed=speed, **kw)


def test_a_speed_is_measured_where_seen_and_fitted_between_and_beyond():
    s = Speed(((1, 1.0), (2, 1.6)))  # step time 1.0 at 1, 0.625 at 2: 0.25 + 0.75 / n
    assert s.at(2) == 1.6 and s.at(0) == 0.0
    assert s.at(4) == pytest.approx(1 / (0.25 + 0.75 / 4))
    assert Speed(((2, 5.0),)).at(4) == pytest.approx(10.0)  # one size: linear
    with pytest.raises(ValueError):
        Speed(((0, 1.0),))


def test_runs_without_a_speed_or_that_scale_alike_get_exactly_the_fair_share():
    plain = [auto("A", 1, held=3), auto("B", 2), auto("C", 3, hi=2)]
    fair = allocate(plain, 8)
    alike = allocate([auto(d.run, d.arrival, LINEAR, hi=d.max, held=d.held) for d in plain], 8)
    assert alike.targets == fair.targets == {"A": 3, "B": 3, "C": 2}
    assert alike.takes == [] and fair.takes == []


def test_a_run_a_slot_does_not_speed_up_gives_it_to_one_it_does():
    out = allocate([auto("flat", 1, FLAT), auto("scales", 2, LINEAR)], 4)
    assert out.fair == {"flat": 2, "scales": 2}
    assert out.targets == {"flat": 1, "scales": 3}
    (take, _) = sorted(out.takes, key=lambda t: t.run)
    assert take.run == "flat" and take.fair == 2 and take.to == 1
    assert "gives up 1 slot(s) of its fair share 2" in take.why


def test_no_auto_run_is_slower_than_at_its_fair_share_and_manual_runs_are_never_moved():
    manual = Demand("M", "m", 0, min=2, max=2, wanted=2, held=2)
    diminishing = Speed(((1, 1.0), (2, 1.2)))
    out = allocate([manual, auto("D", 1, diminishing), auto("L", 2, LINEAR, hi=3)], 8)
    assert out.targets["M"] == 2
    assert diminishing.at(out.targets["D"]) >= diminishing.at(out.fair["D"])
    assert out.targets["L"] == 3 and sum(out.targets.values()) <= 8


def test_a_slot_that_makes_no_run_faster_stays_free_and_pinned_slots_stay():
    out = allocate([auto("flat", 1, FLAT, held=4, pinned=3)], 4)
    assert out.targets == {"flat": 3}  # one slot given up; the 3 moved just now are kept
    assert allocate([auto("flat", 1, FLAT)], 4).targets == {"flat": 1}


def test_caps_and_maxes_bound_what_the_value_pass_gives():
    out = allocate([auto("flat", 1, FLAT, user="u"), auto("A", 2, LINEAR, user="v", hi=3),
                    auto("B", 3, LINEAR, user="v")], 9, caps={"v": 5})
    assert out.targets["A"] + out.targets["B"] <= 5 and out.targets["A"] <= 3


speeds = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=4).map(
    lambda xs: Speed(tuple((n + 1, x) for n, x in enumerate(xs))))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 5), st.none() | speeds),
                min_size=1, max_size=5), st.integers(1, 12))
def test_the_promise_holds_for_any_speeds(runs, capacity):
    demands = [auto(f"r{i}", i, speed, lo=lo, hi=lo + extra)
               for i, (lo, extra, speed) in enumerate(runs)]
    out = allocate(demands, capacity)
    assert sum(out.targets.values()) <= capacity
    for d in demands:
        if d.run in out.targets:
            assert d.min <= out.targets[d.run] <= d.max
            if d.speed is not None:
                assert d.speed.at(out.targets[d.run]) >= d.speed.at(out.fair[d.run])


# ------------------------------------------------------------- the arbiter's table, a run's meter

def test_the_table_takes_each_runs_reported_speed_and_tells_it_why_it_moved():
    t = SlotTable([0, 1, 2, 3], None, hold_s=0.0, by_value=True)
    t.register(1, "alice", 11, 1.0, "A", name="a", max=4, auto=True)
    t.register(2, "bob", 22, 2.0, "B", name="b", max=4, auto=True)
    assert t.poll(1, "A")["target"] == 2  # no speed yet: the fair share
    grant = t.poll(1, "A", speed=[[1, 30.0], [2, 30.0]])  # input-bound: 2 slots, no faster
    assert grant["target"] == 1
    (why,) = [e["why"] for e in grant["events"] if e["kind"] == "value"]
    assert "gives up 1 slot(s) of its fair share 2" in why
    assert t.poll(2, "B", speed=[[2, 40.0]])["target"] == 3
    assert not [e for e in t.poll(1, "A", speed=[[1, 30.0], [2, 30.0]])["events"]
                if e["kind"] == "value"]  # told once per change
    with pytest.raises(ArbiterError, match=r"a speed is \[world size, speed\]"):
        t.poll(1, "A", speed=[[1, "fast"]])
    assert t.poll(1, "A")["target"] == 1  # the refused report changed nothing
    plain = SlotTable([0, 1, 2, 3], None, hold_s=0.0)  # the admin's default: fair share
    plain.register(1, "alice", 11, 1.0, "A", max=4, auto=True)
    plain.register(2, "bob", 22, 2.0, "B", max=4, auto=True)
    assert plain.poll(1, "A", speed=[[1, 30.0], [2, 30.0]])["target"] == 2


def test_a_runs_speed_is_the_median_of_its_recent_steps_at_each_size(tmp_path):
    log = RunLog(str(tmp_path))
    meter = SpeedMeter(log)
    sizes = [2] * 6 + [3] * 3 + [2] * 2
    log.load([{"step": i + 1, "world_size": n, "samples_per_s": 100.0 * n + i, "loss": 1.0}
              for i, n in enumerate(sizes)], upto=len(sizes))
    # each size's first step after a change is left out; size 3 has 2 steps left: too few
    assert meter.speeds() == [(2, 203.5)]
    log.load([{"step": 12, "world_size": 3, "samples_per_s": 300.0, "loss": 1.0}], upto=12)
    assert meter.speeds() == [(2, 203.5)]  # a new change of size: its first step left out
