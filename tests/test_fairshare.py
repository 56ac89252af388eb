"""The arbiter's decisions without a process: fair share (pure) and the slot table's leases."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from elastic_jupyter.arbiter.fairshare import Demand, allocate
from elastic_jupyter.arbiter.table import ArbiterError, SlotTable


def auto(run, user, arrival, lo=1, hi=8, **kw):
    return Demand(run, user, arrival, min=lo, max=hi, auto=True, **kw)


def test_alone_a_run_takes_every_slot_and_splits_them_with_a_newcomer():
    assert allocate([auto("A", "u", 1, held=4)], 4).targets == {"A": 4}
    both = allocate([auto("A", "u", 1, held=4), auto("B", "v", 2)], 4)
    assert both.targets == {"A": 2, "B": 2} and both.queue == []


def test_weights_are_per_user_and_split_among_the_users_runs():
    two_to_one = allocate([auto("A", "u", 1), auto("B", "v", 2)], 6, user_weights={"u": 2})
    assert two_to_one.targets == {"A": 4, "B": 2}
    # a second run, or a larger run weight, gains user u nothing over user v
    gaming = allocate([auto("A", "u", 1), auto("A2", "u", 2, weight=5), auto("B", "v", 3)], 8)
    assert gaming.targets["B"] == 4 and gaming.targets["A"] + gaming.targets["A2"] == 4
    assert gaming.targets["A2"] > gaming.targets["A"]


def test_a_users_cap_bounds_all_their_runs():
    out = allocate([auto("A", "u", 1), auto("A2", "u", 2), auto("B", "v", 3, hi=1)], 8,
                   caps={"u": 3})
    assert out.targets["A"] + out.targets["A2"] == 3 and out.targets["B"] == 1
    # mins count against the cap: the second run waits, and holds up nobody else
    out = allocate([auto("A", "u", 1, lo=2), auto("A2", "u", 2, lo=2), auto("B", "v", 3)], 8,
                   caps={"u": 3})
    assert out.queue == ["A2"] and out.targets == {"A": 3, "B": 5}


def test_what_one_run_of_a_user_cannot_take_goes_to_that_users_other_runs():
    out = allocate([auto("A", "u", 1, hi=1), auto("B", "u", 2), auto("C", "v", 3)], 8)
    assert out.targets == {"A": 1, "B": 3, "C": 4}
    idle = allocate([auto("A", "u", 1, lo=0, hi=0), auto("B", "u", 2), auto("C", "v", 3)], 8)
    assert idle.targets == {"A": 0, "B": 4, "C": 4}


def test_manual_runs_are_never_taken_and_grow_only_to_their_fair_share():
    held = Demand("M", "u", 1, min=1, max=4, wanted=3, held=3)
    assert allocate([held, auto("B", "v", 2)], 4).targets == {"M": 3, "B": 1}
    growing = Demand("M", "u", 1, min=1, max=4, wanted=4, held=1)
    assert allocate([growing, auto("B", "v", 2, held=3)], 4).targets == {"M": 2, "B": 2}
    shrinking = Demand("M", "u", 1, min=1, max=4, wanted=1, held=3)
    assert allocate([shrinking, auto("B", "v", 2, held=1)], 4).targets == {"M": 1, "B": 3}


def test_runs_whose_min_does_not_fit_wait_in_arrival_order():
    out = allocate([Demand("M", "u", 1, min=3, max=3, wanted=3, held=3),
                    auto("C", "w", 2, lo=2), auto("D", "x", 3, lo=1)], 4)
    # D's min would fit, but C came first: first come, first served
    assert out.queue == ["C", "D"] and out.targets == {"M": 3}


def test_pinned_slots_stay_unless_a_min_needs_them():
    pinned = auto("A", "u", 1, held=4, pinned=4)
    assert allocate([pinned, auto("B", "v", 2)], 4).targets == {"A": 3, "B": 1}  # B's min
    assert allocate([pinned, auto("B", "v", 2, lo=2)], 4).targets == {"A": 2, "B": 2}
    half = auto("A", "u", 1, held=4, pinned=1)
    out = allocate([half, auto("B", "v", 2)], 4)
    assert out.targets == {"A": 2, "B": 2} and out.fair == {"A": 2, "B": 2}


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(
    st.integers(1, 3), st.integers(0, 4), st.booleans(), st.integers(0, 3),
    st.integers(0, 4), st.sampled_from("uvw"), st.integers(1, 3)), min_size=1, max_size=5))
def test_allocation_invariants(capacity, specs):
    demands, used = [], 0
    for i, (lo, extra, is_auto, held, pinned, user, weight) in enumerate(specs):
        held = min(held, capacity - used)
        used += held
        demands.append(Demand(f"r{i}", user, i, min=lo, max=lo + extra, weight=weight,
                              auto=is_auto, wanted=lo + extra // 2, held=held,
                              pinned=min(pinned, held)))
    out = allocate(demands, capacity)
    fixed = sum(max(d.min, min(d.held, d.wanted)) for d in demands
                if not d.auto and d.held > 0)
    assert sum(out.targets.values()) <= max(capacity, fixed)
    for d in demands:
        if d.run in out.queue:
            assert d.held == 0 and d.run not in out.targets
            continue
        t = out.targets[d.run]
        assert t <= max(d.max, d.held if not d.auto else 0)
        if not d.auto:
            assert t >= min(d.held, d.wanted)  # never taken
        if d.held == 0 and sum(x.min for x in demands if x.run in out.targets) <= capacity:
            assert t >= d.min


# ---------------------------------------------------------------------- the slot table

def table(**kw) -> SlotTable:
    return SlotTable([0, 1, 2, 3], None, hold_s=kw.pop("hold_s", 0.0), **kw)


def test_leases_move_at_give_back_and_name_who_freed_them():
    t = table()
    assert t.register(1, "alice", 11, 1.0, "A", name="a", max=4, auto=True)["slots"] == [
        0, 1, 2, 3]
    assert t.register(2, "bob", 22, 2.0, "B", name="b", max=4, auto=True)["target"] == 2
    grant = t.poll(1, "A")
    assert grant["target"] == 2 and grant["give_back"] == [3, 2]  # the newest first
    t.release(1, "A", [3, 2])
    b = t.poll(2, "B")
    assert b["slots"] == [2, 3] and {e["from"] for e in b["events"]} == {"a"}
    assert {e["to"] for e in t.poll(1, "A")["events"] if e["kind"] == "gave"} == {"b"}
    t.unregister(2, "B")
    assert t.poll(1, "A")["slots"] == [0, 1, 2, 3]


def test_a_slot_none_of_the_runs_engines_uses_is_given_back_before_one_that_trains():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", name="a", max=4, auto=True)
    t.poll(1, "A", engines={0: 100, 1: 101, 3: 103})  # slot 2's engine still starts
    t.register(2, "bob", 22, 2.0, "B", name="b", max=4, auto=True)
    assert t.poll(1, "A")["give_back"] == [2, 3]  # not the newest two, [3, 2]: 2 goes first


def test_nobody_changes_another_users_run():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", max=2, auto=True)
    for call in (lambda: t.release(2, "A", [0]), lambda: t.unregister(2, "A"),
                 lambda: t.poll(2, "A"),
                 lambda: t.register(2, "bob", 22, 2.0, "A", max=4, auto=True)):
        with pytest.raises(ArbiterError, match="belongs to user alice"):
            call()
    with pytest.raises(ArbiterError, match="not held by run"):
        t.release(1, "A", [3])
    assert t.poll(1, "A")["slots"] == [0, 1]
    t.unregister(0, "A")  # root may
    assert all(slot["holder"] is None for slot in t.view()["slots"])


def test_standby_comes_from_spare_slots_and_goes_first():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", min=2, max=2, wanted=2, standby=1)
    assert t.poll(1, "A")["standby"] == [2]
    t.register(2, "bob", 22, 2.0, "B", min=2, max=2, auto=True)
    assert t.poll(2, "B")["slots"] == [3]  # the one free slot; the standby one is revoked
    assert t.poll(1, "A")["revoke"] == [2]
    t.release(1, "A", [2])
    assert t.poll(2, "B")["slots"] == [2, 3] and t.poll(1, "A")["standby"] == []


def test_a_standby_engine_joins_its_own_run_without_moving():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", min=1, max=4, wanted=1, standby=1)
    assert t.poll(1, "A")["standby"] == [1]
    grant = t.register(1, "alice", 11, 1.0, "A", min=1, max=4, wanted=2, standby=1)
    assert grant["slots"] == [0, 1] and grant["standby"] == [2]


def test_slots_busy_outside_are_given_back_and_offered_again():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", max=4, auto=True)
    t.set_outside({1: "pid 99 (eve)"})
    grant = t.poll(1, "A")
    assert grant["target"] == 3 and grant["give_back"] == [1]
    t.release(1, "A", [1])
    assert t.view()["slots"][1] == {"slot": 1, "holder": None, "outside": "pid 99 (eve)"}
    t.set_outside({})
    assert t.poll(1, "A")["slots"] == [0, 1, 2, 3]


def test_a_dead_process_loses_its_run_and_an_idle_pool_gives_back():
    living = {11}
    t = table(alive=lambda pid, start: pid in living, idle_s=60)
    t.register(1, "alice", 11, 1.0, "A", max=4, auto=True, now=1000.0)
    t.register(1, "alice", 12, 1.0, "B", max=4, auto=True, now=1000.0)
    assert t.reap(now=1000.5) == ["B"] and t.poll(1, "A", now=1001.0)["slots"] == [0, 1, 2, 3]
    idle = t.poll(1, "A", active=False, now=1100.0)
    assert idle["target"] == 0 and idle["give_back"] == [3, 2, 1, 0]


def test_leases_survive_a_new_table_on_the_same_state(tmp_path):
    path = str(tmp_path / "state.json")
    first = SlotTable([0, 1, 2, 3], path, hold_s=0)
    first.register(1, "alice", 11, 1.0, "A", max=2, auto=True)
    first.register(2, "bob", 22, 2.0, "B", min=2, max=2, auto=True)
    again = SlotTable([0, 1, 2, 3], path, hold_s=0)
    assert again.view()["slots"] == first.view()["slots"]
    assert again.register(3, "carol", 33, 3.0, "C", max=2, auto=True)["slots"] == []


def test_bad_demands_are_refused_and_change_nothing():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", max=2, auto=True)
    before = t.view(now=0)
    for kw, words in (({"min": 0}, "min must be"), ({"min": 3, "max": 2}, "exceeds max"),
                      ({"weight": 0}, "weight must be"), ({"wanted": 9, "max": 2}, "in \\[1, 2\\]"),
                      ({"standby": -1}, "standby must be"), ({"max": True}, "max must be"),
                      ({"weight": float("inf")}, "weight must be"),
                      ({"weight": float("nan")}, "weight must be")):
        with pytest.raises(ArbiterError, match=words):
            t.register(1, "alice", 11, 1.0, "A", **kw)
    assert t.view(now=0) == before


def test_a_min_above_the_users_cap_is_refused():
    t = table(cap=lambda user: 2 if user == "bob" else None)
    with pytest.raises(ArbiterError, match="exceeds the 2 slot\\(s\\) the machine's admin allows"):
        t.register(2, "bob", 22, 2.0, "B", min=3, max=4, auto=True)
    assert t.register(2, "bob", 22, 2.0, "B", min=1, max=4, auto=True)["target"] == 2


def test_a_standby_slot_taken_from_outside_is_revoked_not_joined():
    t = table()
    t.register(1, "alice", 11, 1.0, "A", min=1, max=4, wanted=1, standby=1)
    t.set_outside({1: "pid 99 (eve)"})
    grant = t.register(1, "alice", 11, 1.0, "A", min=1, max=4, wanted=2, standby=1)
    assert 1 not in grant["slots"] and grant["revoke"] == [1]


def test_an_auto_run_that_does_not_train_wants_only_its_min():
    t = table()
    t.register(0, "u", 1, 0.0, "A", min=1, max=4, auto=True, now=0)
    t.register(0, "u", 2, 0.0, "B", min=1, max=4, auto=True, active=False, now=0)
    assert (t.grant("A", 0)["target"], t.grant("B", 0)["target"]) == (3, 1)
    t.poll(0, "B", active=True, now=1)
    assert (t.grant("A", 1)["target"], t.grant("B", 1)["target"]) == (2, 2)
    t.poll(0, "A", active=False, now=2)  # its run ended: the pool keeps its min
    assert (t.grant("A", 2)["target"], t.grant("B", 2)["target"]) == (1, 3)


def test_a_runs_new_name_outlives_a_new_table(tmp_path):
    path = str(tmp_path / "state.json")
    first = SlotTable([0, 1, 2, 3], path, hold_s=0)
    first.register(1, "alice", 11, 1.0, "P", name="pool", max=2, wanted=1)
    first.register(1, "alice", 11, 1.0, "P", name="mnist", notebook="a.ipynb", max=2, wanted=1)
    again = SlotTable([0, 1, 2, 3], path, hold_s=0)
    assert (again.runs["P"].name, again.runs["P"].notebook) == ("mnist", "a.ipynb")
