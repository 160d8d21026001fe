#!/usr/bin/env bash
# A slow link, end to end on the multi-host test bed (scripts/hosts.sh): `malleus train` on 2
# hosts × 2 ranks under data parallelism across the hosts; once step SHAPE_AT is logged, host 1's
# link is throttled with tc. The test asserts that within 3 steps the monitor reports a link
# slowdown (a node link rate of at least 3) while the compute rates stay below half of it (not a
# compute straggler), and that the controller re-plans for the slow link.
#
# Usage: tests/link_straggler_test.sh MALLEUS_BINARY SOURCE_DIR
# Exits 77 (CTest: skipped) where network namespaces cannot be made. Every process carries a
# time limit, and the namespaces are deleted whatever happens.
set -euo pipefail
malleus=$1 source_dir=$2
hosts="$source_dir/scripts/hosts.sh"
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-ml} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.14}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
steps=${LINK_TEST_STEPS:-24} shape_at=${LINK_TEST_SHAPE_AT:-8} rate=${LINK_TEST_RATE:-200mbit}

scratch=$(mktemp -d /tmp/link_straggler.XXXXXX)
job=""
cleanup() {
  [[ -z $job ]] || kill "$job" 2> /dev/null || true
  "$hosts" down || true
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

"$hosts" up 2 # exits 77 where namespaces cannot be made
timeout 300 "$malleus" prepare-data --output "$scratch/data" > /dev/null
# The test bed's cluster with links as fast across hosts as inside them, so that data parallelism
# across the hosts is the healthy plan (on cpu-bed-2x2 itself the planner would leave it at the
# first noisy step, and no gradient sync would cross the link to be throttled).
python3 - "$source_dir/configs/clusters/cpu-bed-2x2.json" "$scratch/cluster.json" << 'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["name"] = "cpu-bed-2x2-uniform-links"
c["inter_node_bandwidth_gbs"] = c["intra_node_bandwidth_gbs"]
c["inter_node_latency_us"] = c["intra_node_latency_us"]
json.dump(c, open(sys.argv[2], "w"))
PY

run="$scratch/run"
timeout -k 10 400 "$hosts" mpirun -np 4 "$malleus" train --model demo --seq-len 128 \
  --micro-batch 1 --global-batch 16 --threads 1 --steps "$steps" --warmup-steps 2 --lr 1e-3 \
  --eval-every 0 --checkpoint-every 0 --val-data '' --train-data "$scratch/data/train_*.bin" \
  --dp 4 --cluster "$scratch/cluster.json" --out "$run" \
  > "$scratch/train.log" 2>&1 &
job=$!

# Throttle host 1 once step $shape_at is logged.
deadline=$((SECONDS + 300))
until grep -q "\"step\":$shape_at," "$run/metrics.jsonl" 2> /dev/null; do
  if ! kill -0 "$job" 2> /dev/null || ((SECONDS > deadline)); then
    cat "$scratch/train.log"
    echo "FAIL: the run ended or stalled before step $shape_at"
    exit 1
  fi
  sleep 0.2
done
"$hosts" shape 1 "$rate"
echo "host 1's link throttled to $rate after step $shape_at"
status=0
wait "$job" || status=$?
job=""
cat "$scratch/train.log"
((status == 0)) || { echo "FAIL: training exited with $status"; exit 1; }

python3 - "$run/metrics.jsonl" "$shape_at" << 'EOF'
import json, sys
path, shape_at = sys.argv[1], int(sys.argv[2])
steps, replans = {}, []
for line in open(path):
    r = json.loads(line)
    if r.get("event") in ("replan", "replan_declined"):
        replans.append(r)
    elif "step_time_s" in r:
        steps[r["step"]] = r
detected = None
for s in range(shape_at + 1, shape_at + 4):
    links, rates = steps[s].get("link_rates", []), steps[s]["rates"]
    if links and max(links) >= 3:
        detected = s
        break
if detected is None:
    sys.exit(f"FAIL: no link slowdown within 3 steps of step {shape_at}: " +
             str([(s, steps[s].get("link_rates"), steps[s]["rates"]) for s in sorted(steps)]))
link, compute = max(steps[detected]["link_rates"]), max(steps[detected]["rates"])
print(f"link slowdown seen at step {detected}: link rates {steps[detected]['link_rates']}, "
      f"compute rates {steps[detected]['rates']}")
if not compute < link / 2:
    sys.exit(f"FAIL: compute rates {steps[detected]['rates']} rose with the link ({link})")
after = [r for r in replans if r["step"] > shape_at and r.get("event") == "replan"
         and max(r.get("link_rates", [1])) >= 3]
if not after:
    sys.exit("FAIL: no re-plan for the slow link: " + json.dumps(replans))
print(f"re-planned at step {after[0]['step']}: {after[0]['old_plan']} -> {after[0]['new_plan']}")
EOF
