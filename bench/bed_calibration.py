#!/usr/bin/python3
"""The test bed's calibration from one run of bench_comm and bench_plans (bench/bench_bed.sh).

    bench/bed_calibration.py COMM_JSON PLANS_JSON BASE_CLUSTER SCRATCH

COMM_JSON: bench_comm --json's figures; PLANS_JSON: bench_plans --json's. Writes
SCRATCH/cluster.json: BASE_CLUSTER with the links fitted to the pair all-reduces (as ranks take
turns on cores, when measured so) and the compute rate of dp1's rank alone on its core, at
cores_per_node 1. Prints that cluster, then each plan's measured median step next to the cost
model's prediction on it (build/malleus plan and simulate), and next to its prediction with the
compute rates the runtime measured for the plan's ranks.
"""
import json
import subprocess
import sys


def fit(sizes):
    """Latency (half the smallest all-reduce, us) and bandwidth (GB/s) between the smallest and
    largest message: a pair's ring all-reduce takes bytes / bandwidth + 2 latencies
    (CostModel::allreduce_time)."""
    times = {s["bytes"]: s["all_reduce_us"] for s in sizes}
    small, large = min(times), max(times)
    bandwidth = (large - small) / ((times[large] - times[small]) * 1e-6) / 1e9
    return round(times[small] / 2, 1), round(bandwidth, 3)


def link_figures(comm):
    """(intra latency, intra bandwidth, inter latency, inter bandwidth, measured in turns)."""
    tables = {}
    for pair in comm["pairs"]:
        tables[("intra" if pair["same_host"] else "inter") + ("_turns" if pair["turns"] else "")] = \
            pair["sizes"]
    kind = "_turns" if "intra_turns" in tables else ""
    return fit(tables["intra" + kind]) + fit(tables["inter" + kind]) + (bool(kind),)


def predict(name, cluster_file, rates, scratch):
    """The cost model's step time for the uniform plan `name` ("tp2 × dp2")."""
    degrees = {"dp": 1, "tp": 1, "pp": 1}
    for part in name.replace("×", " ").split():
        degrees[part[:2]] = int(part[2:])
    common = ["--model", "demo", "--global-batch", "16", "--micro-batch", "2", "--seq-len", "128",
              "--cluster", cluster_file]
    plan = f"{scratch}/plan.json"
    subprocess.run(["build/malleus", "plan", "--strategy", "uniform", "--base",
                    "dp{dp},tp{tp},pp{pp}".format(**degrees), "--out", plan] + common,
                   check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run(["build/malleus", "simulate", "--plan", plan, "--json",
                          "--rates", json.dumps(rates)] + common,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["predicted_iteration_s"]


def main():
    comm_json, plans_json, base_cluster, scratch = sys.argv[1:5]
    with open(comm_json) as f:
        comm = json.load(f)
    with open(plans_json) as f:
        plans = {p["name"]: p for p in json.load(f)["plans"]}
    intra_us, intra_gbs, inter_us, inter_gbs, turns = link_figures(comm)
    # The device: a rank alone on its core (dp1: rank 0 computes, its partner only runs the idle
    # probe), running at cores_per_node 1 (the two ranks of a host take turns on its core).
    core_gflops = plans["dp1 (3 ranks idle)"]["ranks"][0]["gflops"]
    with open(base_cluster) as f:
        cluster = json.load(f)
    cluster.update({
        "name": "cpu-bed-2x2 (calibrated by bench/bench_bed.sh)",
        "cores_per_node": 1, "peak_tflops": round(core_gflops / 1000, 5),
        "intra_node_latency_us": intra_us, "intra_node_bandwidth_gbs": intra_gbs,
        "inter_node_latency_us": inter_us, "inter_node_bandwidth_gbs": inter_gbs})
    calibrated = f"{scratch}/cluster.json"
    with open(calibrated, "w") as f:
        json.dump(cluster, f, indent=2)
    print(f"## Calibrated cluster (links: bench_comm's pair all-reduces"
          f"{' as ranks take turns' if turns else ''}; "
          f"compute: dp1's rank alone on its core, {core_gflops:.1f} GFLOP/s)")
    print("```json")
    print(json.dumps({k: v for k, v in cluster.items() if k != "comment"}, indent=2))
    print("```")
    print()
    print("## Measured against the cost model")
    print("| plan | measured median step | predicted (calibrated cluster) | error | "
          "predicted with the plan's measured compute rates | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ["dp4", "tp2 × dp2", "pp2 × dp2", "tp2 × pp2", "pp4"]:
        if name not in plans:
            continue
        measured = plans[name]["step_s"]["median"]
        plain = predict(name, calibrated, {}, scratch)
        # The plan's own rates: its fastest rank is the device, the others that many times slower.
        gflops = [r["gflops"] for r in plans[name]["ranks"]]
        fastest = max(g for g in gflops if g)
        per_plan_file = f"{scratch}/cluster_rates.json"
        with open(per_plan_file, "w") as f:
            json.dump(dict(cluster, peak_tflops=fastest / 1000), f)
        rates = {str(r): fastest / g for r, g in enumerate(gflops) if g and g < fastest}
        with_rates = predict(name, per_plan_file, rates, scratch)
        print(f"| {name} | {measured:.3f} s | {plain:.3f} s | "
              f"{100 * (plain - measured) / measured:+.0f} % | {with_rates:.3f} s | "
              f"{100 * (with_rates - measured) / measured:+.0f} % |")


if __name__ == "__main__":
    main()
