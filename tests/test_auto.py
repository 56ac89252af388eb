"""Auto mode: three real kernels train with auto runs on a machine of 4 CPU slots, sharing them
through a real arbiter process, while a process outside takes a slot and gives it back.

The timeline (each step waits for the world sizes the arbiter's fair share implies):

1. A (auto, min 1, max 4) alone grows to 4.
2. B (auto) starts: A shrinks to 2 at a step boundary, B trains on the 2 freed slots.
3. C (manual, 1 engine) starts: it takes a slot from an auto run; A + B hold 3.
4. B stops its run: once its pool has been idle for the admin's lend_s, it lends its slot and
   A grows to 3 (its warm engine, set up on no slot, is bound there: no engine starts) while
   B's kernel and pool stay up ("lent to a" in B's status, "lent by b" in the
   machine's view). B trains again: A hands the slot back at a step boundary. Then B stops its
   pool: A grows to 3. C's slot is never taken.
5. A process outside takes one of A's slots: A gives it up; once free, A grows back into it.

Every run is then stopped, and its float64 parameters must equal those of a run of as many
steps at a fixed size (elastic resizes change nothing in what is learned).
"""
import json
import os
import re
import threading
import time

import torch

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.arbiter.client import ArbiterClient
from kernels import BODY as LIFECYCLE_BODY, Kernel
from test_arbiter import start_arbiter, stop

# the kernel lifecycle test's float64 model, with DELAY seconds of sleep per pass
BODY = LIFECYCLE_BODY.replace("time.sleep(0.01)", "time.sleep(DELAY)")
assert "DELAY" in BODY
OPTIONS = "--steps 100000 --global-batch 64 --seed 7 --checkpoint-every 0 --no-dashboard"
STATE = ('import json; _s = run.pool.status()["lease"]; print("@@" + json.dumps({"w": '
         'run.world_size, "step": run.step, "state": run.state, "slots": sorted(m.slot for m '
         'in run.members), "leased": _s["slots"], "events": [e.get("message") for e in '
         'run.events if e["kind"] == "slot"]}))')
STATUS = ('import io, contextlib, json\n_buf = io.StringIO()\nwith contextlib.redirect_stdout(_buf):'
          '\n    get_ipython().run_line_magic("elastic_pool", "status")\n'
          'print("@@" + json.dumps(_buf.getvalue()))')
# the pids of the run's ranks, and of its warm engines set up (on no slot) and ready to bind
PIDS = ('import json; print("@@" + json.dumps({"members": [m.pid for m in run.members], '
        '"warm": [e.pid for e in run._driver.membership.warm.ready]}))')
PARAMS = ('import json; print("@@" + json.dumps({"step": run.step, "state": run.state, '
          '"params": {k: v.tolist() for k, v in run.state_dict().items()}}))')


def start(kernel: Kernel, name: str, pool_options: str) -> None:
    kernel.execute(f"%load_ext elastic_jupyter\nDELAY = 0.02\n"
                   f"%elastic_pool start {pool_options} --gpus none")
    kernel.execute(f"%%elastic_train --name {name} --push DELAY {OPTIONS}\n{BODY}")


def state(kernel: Kernel) -> dict:
    return kernel.execute(STATE)[0]


def wait_for(what: str, check, timeout: float = 120.0) -> float:
    """Seconds until check() holds; fails with the last states seen after `timeout`."""
    t0 = time.monotonic()
    while True:
        seen = check()
        if seen is True:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s; {seen}"
        time.sleep(0.5)


def sizes(**kernels):
    """A check: the world sizes of the kernels' runs are as given (else what they are)."""
    def check():
        seen = {name: state(k) for name, (k, _) in kernels.items()}
        return True if all(seen[n]["w"] == w for n, (_, w) in kernels.items()) else seen
    return check


def reference(pool, steps: int, tmp_path) -> dict:
    """The same run at a fixed size (2 engines, no arbiter), `steps` steps long."""
    config = RunConfig(name="fixed", steps=steps, global_batch=64, seed=7, checkpoint_every=0)
    run = TrainingRun(pool, config, source=BODY, push={"DELAY": 0}, engines=2,
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=600) == "finished", run.logs()
    return run.state_dict()


def test_auto_runs_share_the_machine_and_learn_what_fixed_runs_learn(tmp_path, idle_pool):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    arbiter = start_arbiter(str(folder), {"hold_s": 2, "lend_s": 3,
                                          "outside_file": str(outside)})
    env = {"ELASTIC_JUPYTER_ARBITER": str(folder)}
    kernels = {}
    try:
        for name in "abc":
            (tmp_path / name).mkdir()
        a = kernels["a"] = Kernel(tmp_path / "a", env)
        start(a, "a", "--auto --min 1 --max 4")
        wait_for("A alone grows to 4", sizes(a=(a, 4)))

        b = kernels["b"] = Kernel(tmp_path / "b", env)
        start(b, "b", "--auto --min 1 --max 4")
        took = wait_for("B's fair share", sizes(a=(a, 2), b=(b, 2)))
        print(f"A shrank and B grew into the freed slots {took:.1f} s after B's start")
        assert any("gave slot" in e for e in state(a)["events"])

        c = kernels["c"] = Kernel(tmp_path / "c", env)
        start(c, "c", "-n 1 --min 1 --max 2")
        wait_for("C's manual slot", lambda: sizes(c=(c, 1))() is True and (
            state(a)["w"] + state(b)["w"] == 3 or "A + B still hold 4"))

        wait_for("A's warm engine", lambda: bool(a.execute(PIDS)[0]["warm"]) or "not ready")
        (warm,) = a.execute(PIDS)[0]["warm"]
        assert f"Warm engine (pid {warm}): set up on no slot" in a.execute(STATUS)[0]
        final = {"b": b.execute("%elastic_stop\n" + PARAMS)[0]}
        took = wait_for("A grows into the slot B's idle pool lends", sizes(a=(a, 3), c=(c, 1)))
        print(f"A grew into B's lent slot {took:.1f} s after B's run stopped (lend_s 3)")
        assert warm in a.execute(PIDS)[0]["members"]  # bound to the slot: no engine started
        (table,) = b.execute(STATUS)
        assert "lent to a (" in table and "back when you train" in table, table
        lent = [s for s in ArbiterClient(str(folder)).view()["slots"]
                if s["holder"] and s["holder"]["lent_by"]]
        assert [(s["holder"]["name"], s["holder"]["lent_by"]["name"]) for s in lent] == [
            ("a", "b")], lent
        t0 = time.monotonic()
        b.execute(f"%%elastic_train --name b2 --push DELAY {OPTIONS}\n{BODY}")
        print(f"B's next run started on its slot, given back at A's step boundary, in "
              f"{time.monotonic() - t0:.1f} s")
        wait_for("B trains again beside A", lambda: (
            state(b)["w"] == 1 and state(a)["w"] == 2) or (state(a), state(b)))
        b.execute("%elastic_stop")
        b.execute("%elastic_pool stop")
        wait_for("A grows into B's slots", sizes(a=(a, 3), c=(c, 1)))

        taken = max(state(a)["slots"])
        outside.write_text(json.dumps({str(taken): "pid 4242 (someone else's job)"}))
        wait_for("A gives the slot taken outside", lambda: (
            state(a)["w"] == 2 and taken not in state(a)["leased"]) or state(a))
        view = ArbiterClient(str(folder)).view()
        assert view["slots"][taken]["holder"] is None, view
        assert view["slots"][taken]["outside"] == "pid 4242 (someone else's job)"
        assert sizes(c=(c, 1))() is True  # a manual run's slot is never taken
        (table,) = a.execute(STATUS)
        assert f"outside: pid 4242 (someone else's job)" in table and "c  " in table, table
        # the machine's runs with the speeds they report (A's at the sizes it trained at)
        assert "samples/s by size" in table and re.search(r"\n\s*a\s.*\b3: [\d.]+", table), table
        outside.write_text("{}")
        wait_for("A grows back once the slot is free", sizes(a=(a, 3)))

        for name in "ac":
            final[name] = kernels[name].execute("%elastic_stop\n" + PARAMS)[0]
    finally:
        for kernel in kernels.values():
            kernel.close()
        stop(arbiter)
    for name, result in final.items():
        assert result["state"] == "stopped", (name, result["state"])
        expected = reference(idle_pool, result["step"], tmp_path / f"fixed-{name}")
        for key, value in expected.items():
            got = torch.tensor(result["params"][key], dtype=torch.float64)
            assert torch.allclose(got, value, rtol=1e-7, atol=1e-9), \
                f"run {name}, {key}: max diff {(got - value).abs().max().item():.3e}"


def test_an_arbiter_killed_and_restarted_mid_run_costs_no_slot(tmp_path, monkeypatch):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    arbiter = start_arbiter(str(folder), {"hold_s": 0})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    client = ArbiterClient(str(folder))
    pools, runs = [], []
    try:
        pools.append(EnginePool(min_size=1, max_size=4, gpus="none", auto=True).start())
        pools.append(EnginePool(n=1, min_size=1, max_size=2, gpus="none").start())  # manual
        for name, pool in zip("ab", pools):
            config = RunConfig(name=name, steps=100000, global_batch=64, seed=7,
                               checkpoint_every=0)
            runs.append(TrainingRun(pool, config, source=BODY, push={"DELAY": 0.02},
                                    workspace=str(tmp_path)).start())
        wait_for("A grows into the 3 slots B does not hold",
                 lambda: [r.world_size for r in runs] == [3, 1] or [r.world_size for r in runs])
        before = holders(client)
        assert sorted(before.values()).count("a") == 3, before

        stop(arbiter)  # SIGKILL: it saves nothing more
        steps = [r.step for r in runs]
        time.sleep(3)  # the pools' looks fail meanwhile: they keep what they hold
        assert [r.world_size for r in runs] == [3, 1]
        assert all(r.step > s for r, s in zip(runs, steps)), "a run stopped training"
        arbiter = start_arbiter(str(folder), {"hold_s": 0})
        time.sleep(2)  # a few looks at the restarted arbiter
        assert holders(client) == before
        assert [r.world_size for r in runs] == [3, 1] and all(r.active for r in runs)
        engines = [e.slot for p in pools for e in p.engine_sets.engines]
        assert len(engines) == len(set(engines)) == 4, engines  # no slot twice

        pools[1].stop()  # the restarted arbiter goes on deciding: A grows into B's slot
        wait_for("A grows into B's slot", lambda: runs[0].world_size == 4 or runs[0].world_size)
    finally:
        for pool in pools:
            pool.stop()
        stop(arbiter)


def holders(client) -> dict:
    """slot -> the name of the run (pool) leasing it."""
    return {s["slot"]: s["holder"]["name"] for s in client.view()["slots"] if s["holder"]}


def test_a_slot_taken_outside_is_swapped_for_a_free_one_at_the_same_size(tmp_path,
                                                                         monkeypatch):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    arbiter = start_arbiter(str(folder), {"hold_s": 0, "outside_file": str(outside)})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    pool = EnginePool(min_size=1, max_size=2, gpus="none", auto=True).start()
    try:
        run = TrainingRun(pool, RunConfig(name="swap", steps=100000, global_batch=64, seed=7,
                                          checkpoint_every=0),
                          source=BODY, push={"DELAY": 0.02}, workspace=str(tmp_path)).start()
        wait_for("2 ranks", lambda: run.world_size == 2 or run.world_size)
        # the pool reports the run's speed at each size it trained at with its look
        wait_for("the run's speed at 2 ranks, at the arbiter", lambda: 2 in [
            n for r in ArbiterClient(str(folder)).view()["runs"] for n, _ in r["speed"]] or
            ArbiterClient(str(folder)).view()["runs"])
        taken, step = run.members[-1].slot, run.step
        outside.write_text(json.dumps({str(taken): "pid 4242 (someone else's job)"}))

        def swapped():
            slots = sorted(m.slot for m in run.members)
            return (taken not in slots and len(slots) == 2
                    and taken not in pool.lease.leased) or slots
        wait_for("the rank on the taken slot moved to a free one", swapped)
        sizes = {r["world_size"] for r in run.history if r["step"] > step}
        assert sizes == {2}, sizes  # the same size throughout: a swap, not a shrink and a grow
        assert any("moved 1 rank" in e.get("message", "") for e in run.events)
    finally:
        pool.stop()
        stop(arbiter)


def test_a_standby_engine_is_the_first_to_go_when_another_run_needs_its_slot(tmp_path,
                                                                               monkeypatch):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    arbiter = start_arbiter(str(folder), {"hold_s": 0})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    client = ArbiterClient(str(folder))
    pools = [EnginePool(n=2, min_size=1, max_size=3, gpus="none")]
    try:
        run = TrainingRun(pools[0], RunConfig(name="a", steps=100000, global_batch=64, seed=7,
                                              checkpoint_every=0, standby=1),
                          source=BODY, push={"DELAY": 0.02}, workspace=str(tmp_path)).start()
        wait_for("a's standby engine", lambda: len(pools[0].engine_sets.engines) == 3 or holders(client))
        standby = [s["slot"] for s in client.view()["slots"]
                   if s["holder"] and s["holder"]["standby"]]
        assert len(standby) == 1, client.view()
        pools.append(EnginePool(n=2, min_size=2, max_size=2, gpus="none").start())  # needs 2
        assert standby[0] in {e.slot for e in pools[1].engine_sets.engines}
        assert run.world_size == 2 and standby[0] not in {e.slot for e in pools[0].engine_sets.engines}
    finally:
        for pool in pools:
            pool.stop()
        stop(arbiter)


def test_a_start_that_waits_for_slots_says_its_place_in_the_machine_queue(tmp_path, monkeypatch,
                                                                          capsys):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    arbiter = start_arbiter(str(folder), {"hold_s": 0, "cpu_slots": 2})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    holder = EnginePool(n=2, min_size=2, max_size=2, gpus="none").start()  # every slot
    waiter = EnginePool(n=1, min_size=1, max_size=1, gpus="none")
    started = threading.Thread(target=waiter.start)
    try:
        started.start()
        wait_for("the waiting start's line", lambda: "place 1 in the machine's queue" in
                 capsys.readouterr().out or waiter.lease.grant, timeout=30)
        assert started.is_alive() and not waiter.engine_sets.engines
        holder.stop()
        started.join(timeout=60)
        assert not started.is_alive() and waiter.size == 1
    finally:
        holder.stop()
        waiter.stop()
        stop(arbiter)


# growth engines (on slots other than the first) take 20 s to set up
SLOW_GROWTH = '''
import os, time
if os.environ.get("ELASTIC_JUPYTER_SLOT") not in ("0", ""):
    time.sleep(20)
''' + BODY


def test_a_slot_the_arbiter_takes_back_while_an_engine_starts_there_goes_at_once(tmp_path,
                                                                                 monkeypatch):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    arbiter = start_arbiter(str(folder))
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    grower = EnginePool(min_size=1, max_size=4, gpus="none", auto=True).start()
    pools = [grower]
    try:
        run = TrainingRun(grower, RunConfig(name="grower", steps=100000, global_batch=64,
                                            checkpoint_every=0), source=SLOW_GROWTH,
                          push={"DELAY": 0.02}, workspace=str(tmp_path)).start()
        wait_for("engines setting up on the granted slots",
                 lambda: len(grower.engine_sets.engines) >= 2 or grower.engine_sets.engines)
        asked = time.monotonic()
        pools.append(EnginePool(n=2, min_size=2, max_size=2, gpus="none").start())
        took = time.monotonic() - asked
        assert took < 15, f"the slots came after their engines' setup: {took:.1f} s"
        assert "given back while their engine started" in run.logs(), run.logs()
        assert run.world_size == 1 and run.state == "training"
    finally:
        for pool in pools:
            pool.stop()
        stop(arbiter)
