"""The cluster simulator (benchmarks/cluster_sim.py) holds the model it judges by: it reproduces
the Pollux study's published Tiresias figure, places no GPU twice, and finishes every job under
the arbiter's own fair share; its what-if for admins reads a real Slurm's history."""
import json
import pathlib
import subprocess
import sys
import time

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from sim.baselines import Tiresias  # noqa: E402
from sim.cluster import Cluster, load_workload, pack, simulate  # noqa: E402
from sim.jobs import PAPER_COSTS, Costs  # noqa: E402
from sim.product import FairShare, FixedAllocations  # noqa: E402
from sim.sacct import busiest, load_sacct, recorded  # noqa: E402


def test_the_model_reproduces_the_published_tiresias_average_jct():
    published = json.loads((BENCHMARKS / "data/pollux/published.json").read_text())
    paper = published["policies"]["tiresias"]["workloads"]["workload-3"]
    outcome = simulate(load_workload(3), Tiresias(), PAPER_COSTS)
    assert outcome.mean_jct == pytest.approx(paper, rel=0.10)
    assert len(outcome.jcts) == 160 and 0 < outcome.utilisation <= 1


@pytest.mark.parametrize("policy", [FairShare, FixedAllocations])
def test_the_arbiters_policies_finish_every_job_without_placing_a_gpu_twice(policy):
    jobs = load_workload(1)[:40]  # simulate() fails on a GPU held twice
    costs = Costs(start=5.0, grow=5.0, shrink=0.1, trains_while_growing=True)
    outcome = simulate(jobs, policy(), costs)
    assert len(outcome.jcts) == 40 and all(t > 0 for t in outcome.jcts.values())


def test_pack_shrinks_where_a_job_holds_least_and_grows_onto_the_emptiest_node():
    free = {0: 0, 1: 3, 2: 1}
    assert pack(2, [0, 0, 2], free) == [0, 0] and free == {0: 0, 1: 3, 2: 2}
    assert pack(5, [0, 0], free) == [0, 0, 1, 1, 1] and free == {0: 0, 1: 0, 2: 2}
    with pytest.raises(ValueError):
        pack(8, [0, 0], free)


def test_the_what_if_reads_a_real_slurm_history_and_replays_it(tmp_path):
    """A real Slurm's completion records, exported with sacct --completion --parsable2: the
    what-if reads every job, measures what Slurm recorded and replays the history under each
    policy (an auto job finishes sooner where idle slots let it grow)."""
    from slurm_cluster import SlurmCluster, available
    if why := available():
        pytest.skip(why)
    with SlurmCluster(cpus=4):
        # 4 CPUs: a 3-CPU job, then two 2-CPU jobs that wait for it, then a 1-CPU job
        for cpus, seconds in ((3, 4), (2, 3), (2, 3), (1, 2)):
            subprocess.run(["sbatch", "--quiet", "-c", str(cpus), "-o", "/dev/null",
                            "--wrap", f"sleep {seconds}"], check=True, timeout=30)
        deadline = time.monotonic() + 90
        while subprocess.run(["squeue", "-h"], capture_output=True, text=True,
                             timeout=30).stdout.strip():
            assert time.monotonic() < deadline, "the jobs did not finish"
            time.sleep(0.5)
        export = subprocess.run(["sacct", "--completion", "--parsable2", "--format="
                                 "JobID,Eligible,Submit,Start,End,AllocCPUS,State"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    history = tmp_path / "history.txt"
    history.write_text(export)
    jobs = load_sacct(str(history), slots="cpu")
    assert sorted(j.gpus for j in jobs) == [1, 2, 2, 3], export
    seen = recorded(jobs, busiest(jobs))
    assert seen.mean_wait > 0 and 0 < seen.utilisation <= 1  # two jobs waited for the first
    out = subprocess.run([sys.executable, str(BENCHMARKS / "cluster_sim.py"), "--sacct",
                          str(history), "--slots", "cpu", "--cluster-slots", "4",
                          "--interval", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0].strip(): line.split()[-4:] for line in out.stdout.splitlines()
            if line.startswith(("as recorded", "fixed", "fair share", "by value"))}
    assert set(rows) == {"as recorded (Slurm)", "fixed (simulated)", "fair share (simulated)",
                         "by value (simulated)"}, out.stdout
    assert "Amdahl's law with parallel fraction 0.9" in out.stdout


def test_the_what_if_names_a_missing_field(tmp_path):
    history = tmp_path / "history.txt"
    history.write_text("JobID|Submit|End\n1|2026-12-01T10:00:00|2026-12-01T10:05:00\n")
    with pytest.raises(ValueError, match="lacks field.*Start.*--format=JobID,Eligible"):
        load_sacct(str(history), slots="cpu")
