"""The sharing policies on a published cluster workload: the Pollux study's 8 workloads (160 jobs
each over about 8 hours, from Microsoft's Philly trace) on its cluster of 16 nodes of 4 GPUs,
with its per-application measurements (benchmarks/data/pollux: source and licence there).

First it reproduces the study's published Tiresias figures with the study's own model (60 s
decisions, a 30 s restart per placement change, benchmarks/sim/baselines.py); a model that
misses them by more than 10 % judges nothing. Then it runs, per workload, fixed allocations,
this product's fair share and its sharing by value (the arbiter's own decision function,
benchmarks/sim/product.py; by value, each job reports the steps per second it trained at for
each GPU count it held) with this project's measured costs of a start, a grow and a shrink and again with the study's
30 s, and prints average and p99 job completion time (JCT), makespan and GPU utilisation
beside the published Tiresias, Pollux and Optimus+Oracle averages. Every job keeps the batch
size of its workload row (this product changes resources, never the training result).

    python benchmarks/cluster_sim.py                 # all 8 workloads, every policy
    python benchmarks/cluster_sim.py --workloads 1,3 --costs ours

**What-if for admins**: ``--sacct FILE`` reads a Slurm accounting export instead
(benchmarks/sim/sacct.py says which fields and the speedup model it assumes) and reports what
Slurm recorded beside what fixed allocations, fair share and sharing by value would have done
on that history, with this project's costs::

    python benchmarks/cluster_sim.py --sacct history.txt --slots gpu --parallel-fraction 0.9

Sizes: GPUs; times: seconds of the simulated clock.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from sim.baselines import Tiresias  # noqa: E402
from sim.cluster import Cluster, Outcome, load_workload, simulate  # noqa: E402
from sim.jobs import PAPER_COSTS, Costs  # noqa: E402
from sim.product import FairShare, FixedAllocations, ValueShare, auto_max  # noqa: E402
from sim.sacct import busiest, load_sacct, recorded  # noqa: E402

PUBLISHED = pathlib.Path(__file__).resolve().parent / "data" / "pollux" / "published.json"

# This project's measured costs (BENCHMARKS.md, CPU engines): a grow by one GPU binds the run's
# warm engine, 0.9 s (auto_day.py's freed slot); a grow by more also starts engines and runs
# the cell, 5.4 s, while the run trains on; a shrink is one step boundary, 0.1 s; a start (or
# a move to other GPUs) costs an engine start and the cell, 5.4 s, without training. Assumed
# the same on GPUs (unmeasured: a CUDA context and a larger model add seconds).
# The warm engine is this host's (pools over ssh or of Slurm jobs keep none): on the simulated
# cluster every job is assumed to keep one wherever it grows.
OUR_COSTS = Costs(start=5.4, grow=5.4, shrink=0.1, trains_while_growing=True, grow_one=0.9,
                  label="ours (5.4 s start/grow, 0.9 s +1, 0.1 s shrink)")
TOLERANCE = 0.10  # how far the reproduced Tiresias may be from the published one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8",
                        help="workload numbers, comma-separated (default all 8)")
    parser.add_argument("--costs", choices=("ours", "paper", "both"), default="both")
    what_if = parser.add_argument_group("what-if on a Slurm history (--sacct)")
    what_if.add_argument("--sacct", metavar="FILE", help="a sacct --parsable2 export")
    what_if.add_argument("--slots", choices=("gpu", "cpu"), default="gpu",
                         help="what a slot is: a GPU (AllocTRES gres/gpu) or a CPU (AllocCPUS)")
    what_if.add_argument("--cluster-slots", type=int,
                         help="the cluster's slots (default: the most the history held at once)")
    what_if.add_argument("--parallel-fraction", type=float, default=0.9,
                         help="Amdahl's parallel fraction of every job (default 0.9)")
    what_if.add_argument("--max-factor", type=float, default=2.0,
                         help="an auto job's most slots, times what it held (default 2)")
    what_if.add_argument("--interval", type=float, default=60.0,
                         help="seconds between the policy's decisions (default 60)")
    args = parser.parse_args()
    if args.sacct:
        return sacct_what_if(args)
    numbers = [int(w) for w in args.workloads.split(",")]
    published = json.loads(PUBLISHED.read_text())["policies"]
    cluster = Cluster()

    reproduced = {w: run(w, Tiresias(), PAPER_COSTS, cluster) for w in numbers}
    print("Tiresias reproduced with the study's model (60 s decisions, 30 s restarts):")
    print(f"{'workload':<10} {'ours':>8} {'published':>9} {'diff':>7}")
    worst = 0.0
    for w, outcome in reproduced.items():
        paper = published["tiresias"]["workloads"][f"workload-{w}"]
        diff = outcome.mean_jct / paper - 1
        worst = max(worst, abs(diff))
        print(f"{w:<10} {outcome.mean_jct:>8.0f} {paper:>9.0f} {diff:>+7.1%}")
    mean = sum(o.mean_jct for o in reproduced.values()) / len(reproduced)
    paper_mean = sum(published["tiresias"]["workloads"][f"workload-{w}"] for w in numbers) / len(
        numbers)
    print(f"{'mean':<10} {mean:>8.0f} {paper_mean:>9.0f} {mean / paper_mean - 1:>+7.1%}")
    if worst > TOLERANCE:
        sys.exit(f"the model misses the published Tiresias by {worst:.0%} (> {TOLERANCE:.0%}): "
                 "it judges nothing")

    costs = {"ours": [OUR_COSTS], "paper": [PAPER_COSTS], "both": [OUR_COSTS, PAPER_COSTS]}
    rows = [("tiresias", PAPER_COSTS, reproduced)]
    for c in costs[args.costs]:
        for policy in (FixedAllocations, FairShare, ValueShare):
            rows.append((policy.name, c, {w: run(w, policy(), c, cluster) for w in numbers}))
    report(rows, numbers, published)


def sacct_what_if(args) -> None:
    """What Slurm recorded, and what each policy would have done, on one export."""
    def jobs():  # a fresh copy for each policy: a simulation advances its jobs
        return load_sacct(args.sacct, args.slots, args.parallel_fraction, args.max_factor)
    history = jobs()
    slots = args.cluster_slots or busiest(history)
    cluster = Cluster(nodes=1, gpus_per_node=slots, interval=args.interval)
    print(f"{len(history)} jobs from {args.sacct} on {slots} {args.slots} slots; speedup by "
          f"Amdahl's law with parallel fraction {args.parallel_fraction}; auto jobs take 1 to "
          f"{args.max_factor:g}x the slots they held; {OUR_COSTS.label}")
    print(f"{'policy':<22} {'avg JCT':>9} {'p99 JCT':>9} {'makespan':>9} {'util':>6}")
    seen = recorded(history, slots)
    print(f"{'as recorded (Slurm)':<22} {seen.mean_jct:>9.0f} {seen.p99_jct:>9.0f} "
          f"{seen.makespan:>9.0f} {seen.utilisation:>6.0%}")
    for policy in (FixedAllocations, FairShare, ValueShare):
        o = simulate(jobs(), policy(), OUR_COSTS, cluster, limit_s=10 * seen.makespan + 86400)
        print(f"{policy.name + ' (simulated)':<22} {o.mean_jct:>9.0f} {o.p99_jct:>9.0f} "
              f"{o.makespan:>9.0f} {o.utilisation:>6.0%}")


def run(workload: int, policy, costs: Costs, cluster: Cluster) -> Outcome:
    return simulate(load_workload(workload), policy, costs, cluster)


def report(rows, numbers: list[int], published: dict) -> None:
    print("\nPer workload: average JCT (s) / p99 JCT (s) / makespan (s) / GPU utilisation")
    for name, costs, outcomes in rows:
        print(f"\n{name}, {costs.label}")
        for w in numbers:
            o = outcomes[w]
            print(f"  workload-{w}: {o.mean_jct:>7.0f} / {o.p99_jct:>7.0f} / {o.makespan:>7.0f} "
                  f"/ {o.utilisation:.0%}   ({o.restarts} placement changes)")
    print(f"\nMean over workloads {','.join(map(str, numbers))}:")
    print(f"{'policy':<14} {'costs':<40} {'avg JCT':>8} {'p99 JCT':>8} {'makespan':>9} "
          f"{'GPU util':>8} {'vs Tiresias':>11}")
    base = None
    for name, costs, outcomes in rows:
        o = list(outcomes.values())
        avg = sum(x.mean_jct for x in o) / len(o)
        base = base or avg
        print(f"{name:<14} {costs.label:<40} {avg:>8.0f} "
              f"{sum(x.p99_jct for x in o) / len(o):>8.0f} "
              f"{sum(x.makespan for x in o) / len(o):>9.0f} "
              f"{sum(x.utilisation for x in o) / len(o):>8.0%} {avg / base:>10.2f}x")
    for policy in ("tiresias", "pollux", "optimus"):
        avg = sum(published[policy]["workloads"][f"workload-{w}"] for w in numbers) / len(numbers)
        print(f"{policy + ' (paper)':<14} {'published':<40} {avg:>8.0f}")
    job = load_workload(numbers[0])[0]
    print(f"\nJobs: fixed holds its row's GPUs; fair share min 1, max = batch // the "
          f"application's smallest local batch (e.g. {job.name}: batch {job.batch}, max "
          f"{auto_max(job, Cluster())}).")


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
