"""Slurm as an auto pool's arbiter, its decisions and its reading of ``sinfo``/``squeue``
without a cluster (tests/test_slurm.py runs it against a real Slurm)."""
from elastic_jupyter.arbiter.slurm import (Partition, SlurmArbiter, _gres_gpus, _idle,
                                           _job_gpus, decide)

AUTO = {"min": 1, "max": 4, "auto": True, "wanted": 2}


def test_an_auto_pool_grows_into_idle_resources_only_while_nobody_waits():
    idle = Partition(fits=3, idle_cpus=3)
    assert decide(held=2, up=2, kept=2, demand=AUTO, seen=idle, settled=True, cpus=1,
                  gpus=0) == 4  # up to its max
    assert decide(2, 1, 2, AUTO, idle, True, 1, 0) == 2  # a job of its own still starts
    waiting = Partition(fits=1, idle_cpus=1, waiting=("7",), wanted_cpus=4)
    assert decide(4, 4, 4, AUTO, waiting, True, 1, 0) == 1  # lacks 3 CPUs: 3 back
    assert decide(4, 4, 4, AUTO, waiting, True, 2, 0) == 2  # 2 CPUs an engine: 2 back
    assert decide(4, 4, 4, AUTO, waiting, False, 1, 0) == 4  # the last give-back settles
    assert decide(1, 1, 1, AUTO, waiting, True, 1, 0) == 1  # never below its min
    assert decide(3, 3, 3, AUTO, None, True, 1, 0) == 3  # Slurm did not answer: hold
    idle_pool = dict(AUTO, active=False)  # no run trains on it: it holds its min
    assert decide(3, 3, 3, idle_pool, idle, True, 1, 0) == 1


def test_a_waiting_job_that_idle_resources_would_fit_still_gets_one_slot_back():
    # it waits though the totals suffice (another node's CPUs, memory): make room anyway
    assert Partition(idle_cpus=8, waiting=("9",), wanted_cpus=2).lacking(1, 0) == 1
    gpus = Partition(idle_cpus=8, idle_gpus=1, waiting=("9",), wanted_cpus=2, wanted_gpus=4)
    assert gpus.lacking(cpus_per_engine=4, gpus_per_engine=1) == 3


def test_auto_off_holds_the_wanted_size():
    manual = dict(AUTO, auto=False, wanted=3)
    busy = Partition(waiting=("1", "2"), wanted_cpus=64)
    assert decide(3, 3, 3, manual, busy, True, 1, 0) == 3
    assert decide(1, 1, 1, dict(manual, wanted=9), busy, True, 1, 0) == 4  # within max


def test_engines_fit_node_by_node_and_gres_strings_count_gpus():
    sinfo = "\n".join([
        "gpu1|6/2/0/8|gpu:h100:4(S:0-1)|gpu:h100:2(IDX:0-1)|mix",  # 2 CPUs, 2 GPUs free
        "gpu2|0/8/0/8|gpu:4|gpu:0|idle",  # 8 CPUs, 4 GPUs free
        "gpu3|0/8/0/8|gpu:4|gpu:0|drain",  # not usable
        "gpu4|0/8/0/8|gpu:4|gpu:0|idle*",  # not responding: not usable
    ])
    seen = _idle(sinfo, cpus_per_engine=2, gpus_per_engine=1)
    assert (seen.fits, seen.idle_cpus, seen.idle_gpus) == (1 + 4, 10, 6)
    assert _idle(sinfo, 4, 0).fits == 0 + 2
    assert _job_gpus(nodes="2", tasks="8", per_node="gres/gpu:4", per_task="N/A",
                     per_job="N/A") == 8
    assert _job_gpus("1", "2", "N/A", "gres/gpu:a100:1", "N/A") == 2
    assert _job_gpus("1", "1", "N/A", "N/A", "N/A") == 0
    assert [_gres_gpus(g) for g in ("gpu:(null):2", "gpu:a100:2(IDX:0,2),gpu:v100:1",
                                    "gres/gpu", "gres/gpu:h100:3", "(null)", "N/A")] == [
        2, 3, 1, 3, 0, 0]


def test_slots_given_back_are_queued_jobs_first_then_the_newest():
    arbiter = SlurmArbiter("batch", 1, 0, own_jobs=lambda: [])
    arbiter.seen, arbiter._looked = Partition(fits=4, idle_cpus=4), float("inf")
    grant = arbiter.register("pool-1", min=1, max=4, auto=True, wanted=1)
    assert grant["slots"] == [0, 1, 2, 3] and [e["kind"] for e in grant["events"]] == ["grew"] * 4
    arbiter.seen = Partition(waiting=("41",), wanted_cpus=2)
    grant = arbiter.poll("pool-1", engines={0: 10, 1: 11, 3: 13})  # slot 2's job still waits
    assert grant["give_back"] == [2, 3], grant
    assert "job(s) 41 wait" in grant["events"][0]["why"]
    arbiter.seen = Partition(waiting=("41", "42"), wanted_cpus=3)  # more wait meanwhile
    assert arbiter.poll("pool-1", engines={0: 10, 1: 11, 3: 13})["give_back"] == [2, 3]
    grant = arbiter.release("pool-1", [2, 3])  # no more until the last give-back settled
    assert grant["slots"] == [0, 1] and grant["give_back"] == [], grant
