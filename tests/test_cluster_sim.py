"""The cluster simulator (benchmarks/cluster_sim.py) holds the model it judges by: it reproduces
the Pollux study's published Tiresias figure, places no GPU twice, and finishes every job under
the arbiter's own fair share."""
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from sim.baselines import Tiresias  # noqa: E402
from sim.cluster import Cluster, load_workload, pack, simulate  # noqa: E402
from sim.jobs import PAPER_COSTS, Costs  # noqa: E402
from sim.product import FairShare, FixedAllocations  # noqa: E402


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
