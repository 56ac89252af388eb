"""Idle pools lend their slots (arbiter/lending.py), without a process: the pure pass, and the
slot table that keeps who lent what to whom (the two-kernel scenario is in test_auto.py)."""
from __future__ import annotations

from elastic_jupyter.arbiter.fairshare import Demand, allocate
from elastic_jupyter.arbiter.speed import Speed
from elastic_jupyter.arbiter.table import SlotTable


def auto(run, user, arrival, lo=1, hi=4, **kw):
    return Demand(run, user, arrival, min=lo, max=hi, auto=True, **kw)


def lender(run, user, arrival, held=1):
    """An idle auto pool (its ceiling is its min) that lends."""
    return Demand(run, user, arrival, min=1, max=1, auto=True, held=held, lends=True)


def test_an_idle_pool_lends_to_an_auto_run_that_wants_more_and_keeps_what_nobody_wants():
    out = allocate([auto("A", "alice", 1, held=1), lender("B", "bob", 2)], 2)
    assert out.targets == {"A": 2, "B": 0} and out.lent == {"B": 1}
    # nobody wants more: the lender keeps its slot (and its engine up)
    out = allocate([auto("A", "alice", 1, hi=1, held=1), lender("B", "bob", 2)], 2)
    assert out.targets == {"A": 1, "B": 1} and out.lent == {}


def test_only_auto_runs_borrow_within_their_users_cap():
    manual = Demand("M", "alice", 1, min=1, max=4, wanted=4, held=1)
    assert allocate([manual, lender("B", "bob", 2)], 2).targets == {"M": 1, "B": 1}
    capped = allocate([auto("A", "alice", 1, held=1), lender("B", "bob", 2)], 2,
                      caps={"alice": 1})
    assert capped.targets == {"A": 1, "B": 1}
    # a slot moving between one user's runs changes nothing in that user's cap
    same_user = allocate([auto("A", "bob", 1, held=1), lender("B", "bob", 2)], 2,
                         caps={"bob": 2})
    assert same_user.targets == {"A": 2, "B": 0}


def test_the_fewest_slots_per_weight_borrow_first_and_a_slot_that_adds_no_speed_is_not_taken():
    out = allocate([auto("A", "alice", 1, held=2), auto("C", "carol", 3, held=1),
                    lender("B", "bob", 2)], 4)
    assert out.targets == {"A": 2, "C": 2, "B": 0}
    flat = Speed(((1, 10.0), (2, 10.0)))  # a second slot makes it no faster
    out = allocate([auto("A", "alice", 1, hi=2, held=1, speed=flat), lender("B", "bob", 2)], 2)
    assert out.targets == {"A": 1, "B": 1} and out.lent == {}


def test_a_lent_slot_never_admits_a_run():
    # B lends its slot to A; C's min does not fit beside A's and B's mins: C waits
    out = allocate([auto("A", "alice", 1, held=1), lender("B", "bob", 2),
                    auto("C", "carol", 3)], 2)
    assert out.queue == ["C"] and out.targets == {"A": 2, "B": 0}


# ---------------------------------------------------------------------- the slot table

def two_pools(**kw) -> SlotTable:
    """A (alice, auto 1..2) holds slot 0 and wants 2; B (bob, auto min 1) holds slot 1 and
    stops training at t=1000."""
    t = SlotTable([0, 1], None, hold_s=0.0, lend_s=60.0, **kw)
    t.register(1, "alice", 11, 1.0, "A", name="a", min=1, max=2, auto=True, now=1000.0)
    t.register(2, "bob", 22, 2.0, "B", name="b", min=1, max=1, auto=True, now=1000.0)
    t.release(1, "A", t.poll(1, "A", now=1000.0)["give_back"], now=1000.0)
    assert t.poll(1, "A", now=1000.0)["slots"] == [0]
    assert t.poll(2, "B", active=False, now=1000.0)["slots"] == [1]
    return t


def test_a_pool_idle_for_lend_s_lends_and_gets_its_slot_back_when_it_trains():
    t = two_pools()
    assert t.poll(2, "B", active=False, now=1059.0)["give_back"] == []  # not idle long enough
    assert t.poll(2, "B", active=False, now=1061.0)["give_back"] == [1]
    t.release(2, "B", [1], now=1061.5)
    assert t.poll(1, "A", now=1062.0)["slots"] == [0, 1]
    b = t.poll(2, "B", active=False, now=1062.0)
    assert b["lent"] == [{"slot": 1, "to": "a", "user": "alice"}] and b["target"] == 0
    view = t.view(now=1062.0)
    assert view["slots"][1]["holder"]["lent_by"] == {"name": "b", "user": "bob"}
    assert [r["lent"] for r in view["runs"]] == [0, 1]
    # B trains again: A hands the slot back at its next step boundary, B's min is kept
    assert t.poll(2, "B", active=True, now=1100.0)["target"] == 1
    assert t.poll(1, "A", now=1100.0)["give_back"] == [1]
    t.release(1, "A", [1], now=1101.0)
    assert t.poll(2, "B", now=1101.0)["slots"] == [1]
    assert t.poll(2, "B", now=1101.0)["lent"] == [] and t.view(now=1101.0)["runs"][1]["lent"] == 0


def test_a_pool_that_keeps_its_slots_never_lends():
    t = two_pools()
    t.register(2, "bob", 22, 2.0, "B", name="b", min=1, max=1, auto=True, active=False,
               lend=False, now=1000.0)
    assert t.poll(2, "B", active=False, now=1500.0)["give_back"] == []
    assert t.view(now=1500.0)["runs"][1]["lend"] is False


def test_a_lender_keeps_its_place_and_a_manual_lender_gets_every_slot_back():
    # L lent its only slot to A; Q (earlier, min 2) is not admitted in L's place
    q = Demand("Q", "carol", 1, min=2, max=2, auto=True)
    out = allocate([auto("A", "alice", 2, held=2), q,
                    Demand("L", "bob", 3, min=1, max=1, auto=True, lent=1, lends=True)], 3)
    assert out.queue == ["Q"] and out.targets == {"A": 3, "L": 0}
    # a manual pool that lent 2 slots and trains again gets both back, not its fair share
    back = allocate([auto("A", "alice", 1, held=3),
                     Demand("M", "bob", 2, min=1, max=2, wanted=2, held=0, lent=2)], 3)
    assert back.targets == {"A": 1, "M": 2}


def test_lent_slots_go_by_user_weight_first_as_the_fair_share_does():
    runs = [auto(f"A{i}", "alice", i, held=1) for i in range(3)]
    out = allocate(runs + [auto("B", "bob", 5, held=1), lender("L", "carol", 6)], 5,
                   user_weights={"bob": 3})
    assert out.targets["B"] == 2 and out.borrowed == {"B": 1}


def test_a_pool_that_waited_in_the_queue_does_not_lend_the_slot_it_just_got():
    t = SlotTable([0, 1], None, hold_s=0.0, lend_s=60.0)
    t.register(1, "alice", 11, 1.0, "A", name="a", min=2, max=2, wanted=2, now=1000.0)
    t.register(2, "bob", 22, 2.0, "P", name="p", min=1, max=1, auto=True, active=False,
               now=1000.0)
    t.register(3, "carol", 33, 3.0, "C", name="c", min=1, max=2, auto=True, now=1000.0)
    assert t.poll(2, "P", active=False, now=1100.0)["queued"] == 1
    t.unregister(1, "A", now=1101.0)  # P is admitted 101 s after it registered
    assert t.poll(2, "P", active=False, now=1102.0)["slots"] == [0]
    assert t.poll(3, "C", now=1102.0)["slots"] == [1]
    assert t.poll(2, "P", active=False, now=1150.0)["give_back"] == []  # its clock started anew
    assert t.poll(2, "P", active=False, now=1163.0)["give_back"] == [0]  # now C borrows it


def test_a_lender_that_trains_again_is_owed_no_more_once_a_borrower_gives_back_any_slot():
    t = SlotTable([0, 1, 2], None, hold_s=30.0, lend_s=60.0)
    t.register(1, "alice", 11, 1.0, "A", name="a", min=1, max=3, auto=True, now=0.0)
    t.register(2, "bob", 22, 2.0, "L", name="l", min=1, max=1, auto=True, now=0.0)
    t.release(1, "A", t.poll(1, "A", now=0.0)["give_back"], now=0.0)
    assert t.poll(2, "L", active=False, now=0.0)["slots"] == [2]
    t.release(2, "L", t.poll(2, "L", active=False, now=100.0)["give_back"], now=100.0)
    assert t.poll(1, "A", now=100.0)["slots"] == [0, 1, 2]  # slot 2 is pinned to A for 30 s
    assert t.poll(2, "L", active=True, now=101.0)["lent"] == [{"slot": 2, "to": "a",
                                                              "user": "alice"}]
    give = t.poll(1, "A", now=101.0)["give_back"]
    assert give == [1]  # an older slot goes first
    t.release(1, "A", give, now=101.5)
    assert t.poll(2, "L", now=102.0)["slots"] == [1]
    assert t.poll(2, "L", now=102.0)["lent"] == [] and t.view(now=102.0)["slots"][2]["holder"][
        "lent_by"] is None


def test_an_idle_pool_past_idle_s_stays_given_back():
    t = SlotTable([0, 1], None, hold_s=0.0, lend_s=60.0, idle_s=600.0)
    t.register(1, "alice", 11, 1.0, "A", name="a", min=1, max=1, auto=True, now=0.0)
    assert t.poll(1, "A", active=False, now=0.0)["slots"] == [0]
    t.release(1, "A", t.poll(1, "A", active=False, now=601.0)["give_back"], now=601.0)
    for now in (602.0, 700.0, 1300.0):
        assert t.poll(1, "A", active=False, now=now)["target"] == 0
    assert t.poll(1, "A", active=True, now=1301.0)["slots"] == [0]  # it trains again
