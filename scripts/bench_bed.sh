#!/usr/bin/env bash
# Calibration of the cost model on the multi-host test bed: 2 emulated hosts × 2 ranks
# (scripts/hosts.sh), each host one CPU core that its 2 ranks take turns on (core lease).
#   1. bench_comm measures the links, also as the runtime waits for them while ranks take turns;
#      the cluster's link figures come from its pair all-reduces in turns;
#   2. bench_plans measures the step time of the uniform plans (interleaved rounds, median step)
#      and every rank's phases (compute, time inside TP collectives, GFLOP/s while computing);
#   3. a cluster file is written from this run alone: the turn-taking link figures of step 1 and
#      the compute rate of a rank alone on its core (dp1's rank 0) with cores_per_node 1;
#   4. next to each plan's measured step: the cost model's prediction on that cluster file, and
#      its prediction with the compute rates the runtime measured for the plan's ranks (what the
#      straggler monitor hands the planner), so the rest of the error is communication and
#      schedule (bubbles, turns), not the speed of the machine's cores.
#   scripts/bench_bed.sh [rounds] [steps-per-round]   (default 5 × 4; about 1.5 minutes on the quiet 2-core machine, 5 on a loaded one)
# Prints the cluster file; CALIBRATED_CLUSTER=path also keeps it. Needs root (network
# namespaces); exits 77 where they cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
rounds=${1:-5} steps=${2:-4}
bench_build_targets build malleus bench_comm bench_plans
bench_allow_mpirun
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-mb} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.15}
base_cluster=configs/clusters/cpu-bed-2x2.json
scratch=$(mktemp -d /tmp/bench_bed.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

echo "## Links (bench_comm, 2 hosts x 2 ranks)"
echo "load average: $(bench_load_average)"
scripts/hosts.sh run 2 300 -np 4 build/bench/bench_comm | grep -v '^hosts.sh' | tee "$scratch/comm.txt"
echo
echo "## Step times (bench_plans: demo model, seq 128, 16 sequences in micro-batches of 2)"
scripts/hosts.sh run 2 900 -np 4 build/bench/bench_plans "$rounds" "$steps" | tee "$scratch/table.md" |
  grep -v '^hosts.sh'
echo
python3 - "$scratch" "$base_cluster" << 'EOF'
import json, re, subprocess, sys
scratch, base_cluster = sys.argv[1], sys.argv[2]

# Link figures from the pair all-reduces as the runtime runs them (the "turns" tables, bench_comm's
# second pass; the first pass where no rank shares a core): a pair's ring all-reduce takes
# bytes / bandwidth + 2 latencies (CostModel::allreduce_time), fitted between 1 KB and 4 MB. Tensor
# parallelism and gradient sync are all-reduces; a pipeline hand-off is one message of the same
# path (its one-way figures are printed above for comparison).
all_reduce, section = {}, None
for line in open(f"{scratch}/comm.txt"):
    if line.startswith("pairs ("):
        section = ("intra" if "inside one host" in line else "inter") + (
            "_turns" if "turns" in line else "")
    m = re.match(r"\s*(\d+) bytes: pair all-reduce\s+([\d.]+) us", line)
    if m and section:
        all_reduce.setdefault(section, {})[int(m.group(1))] = float(m.group(2))
kind = "_turns" if "intra_turns" in all_reduce else ""
def fit(times):
    small, large = min(times), max(times)
    bandwidth = (large - small) / ((times[large] - times[small]) * 1e-6) / 1e9
    return round(times[small] / 2, 1), round(bandwidth, 3)
(intra_us, intra_gbs), (inter_us, inter_gbs) = fit(all_reduce["intra" + kind]), fit(
    all_reduce["inter" + kind])

# bench_plans: step times (first table), then per-rank phases (second table).
steps, phases, in_phases = {}, {}, False
for line in open(f"{scratch}/table.md"):
    if line.startswith("Phases per rank"):
        in_phases = True
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if not line.startswith("| ") or len(cells) < 4 or cells[0] in ("plan", ""):
        continue
    if in_phases:
        phases[cells[0]] = {"compute": [float(x) for x in cells[1].split()],
                            "tp": [float(x) for x in cells[2].split()],
                            "gflops": [None if x == "idle" else float(x) for x in cells[3].split()]}
    else:
        steps[cells[0]] = float(cells[2].split()[0])

# The device: a rank alone on its core (dp1: rank 0 computes, its partner only runs the idle
# probe), running at cores_per_node 1 (the two ranks of a host take turns on its core).
core_gflops = phases["dp1 (3 ranks idle)"]["gflops"][0]
cluster = json.load(open(base_cluster))
cluster.update({
    "name": "cpu-bed-2x2 (calibrated by scripts/bench_bed.sh)",
    "cores_per_node": 1, "peak_tflops": round(core_gflops / 1000, 5),
    "intra_node_latency_us": intra_us, "intra_node_bandwidth_gbs": intra_gbs,
    "inter_node_latency_us": inter_us, "inter_node_bandwidth_gbs": inter_gbs})
calibrated = f"{scratch}/cluster.json"
json.dump(cluster, open(calibrated, "w"), indent=2)
print(f"## Calibrated cluster (links: bench_comm's pair all-reduces{' as ranks take turns' if kind else ''}; "
      f"compute: dp1's rank alone on its core, {core_gflops:.1f} GFLOP/s)")
print("```json")
print(json.dumps({k: v for k, v in cluster.items() if k != "comment"}, indent=2))
print("```")
print()

def predict(name, cluster_file, rates):
    dp = tp = pp = 1
    for part in name.replace("×", " ").split():
        n = int(part[2:])
        if part.startswith("dp"): dp = n
        elif part.startswith("tp"): tp = n
        elif part.startswith("pp"): pp = n
    common = ["--model", "demo", "--global-batch", "16", "--micro-batch", "2", "--seq-len", "128",
              "--cluster", cluster_file]
    plan = f"{scratch}/plan.json"
    subprocess.run(["build/malleus", "plan", "--strategy", "uniform", "--base",
                    f"dp{dp},tp{tp},pp{pp}", "--out", plan] + common,
                   check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run(["build/malleus", "simulate", "--plan", plan, "--json",
                          "--rates", json.dumps(rates)] + common,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["predicted_iteration_s"]

print("## Measured against the cost model")
print("| plan | measured median step | predicted (calibrated cluster) | error | "
      "predicted with the plan's measured compute rates | error |")
print("|---|---:|---:|---:|---:|---:|")
for name in ["dp4", "tp2 × dp2", "pp2 × dp2", "tp2 × pp2", "pp4"]:
    if name not in steps:
        continue
    measured = steps[name]
    plain = predict(name, calibrated, {})
    # The plan's own rates: its fastest rank is the device, the others that many times slower.
    speeds = [g for g in phases[name]["gflops"] if g]
    fastest = max(speeds)
    per_plan = dict(cluster, peak_tflops=fastest / 1000)
    per_plan_file = f"{scratch}/cluster_rates.json"
    json.dump(per_plan, open(per_plan_file, "w"))
    rates = {str(r): fastest / g for r, g in enumerate(phases[name]["gflops"]) if g and g < fastest}
    with_rates = predict(name, per_plan_file, rates)
    print(f"| {name} | {measured:.3f} s | {plain:.3f} s | {100 * (plain - measured) / measured:+.0f} % "
          f"| {with_rates:.3f} s | {100 * (with_rates - measured) / measured:+.0f} % |")
EOF
if [[ -n ${CALIBRATED_CLUSTER:-} ]]; then cp "$scratch/cluster.json" "$CALIBRATED_CLUSTER"; fi
