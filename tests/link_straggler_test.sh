#!/usr/bin/env bash
# A slow link, end to end on the multi-host test bed (scripts/hosts.sh): `malleus train` on 2
# hosts × 2 ranks (the calibrated cpu-bed-2x2 cluster), starting under data parallelism across
# the hosts. Once step SHAPE_AT is logged, host 1's link is throttled with tc to RATE (default
# 268mbit: a tenth of the bed's 0.335 GB/s between hosts); once step UNSHAPE_AT is logged, the
# limit is removed. The test asserts that
#   - within 3 steps of the throttle the monitor reports a link slowdown (a node link rate of at
#     least 3) while the compute rates stay below half of it (not a compute straggler);
#   - the controller re-plans for the slow link, and every decision until the limit is removed
#     plans for the link either as healthy or at 3 or more, never for a partly slowed step;
#   - the link still reads slow (3 or more) on every step from that re-plan until the limit is
#     removed, whatever the new plan sends across it (the probe);
#   - within 3 steps of the limit's removal every link reads below 3 and below half its level
#     before, and the controller then asks again with links below 3: it re-plans back, or
#     declines by the cost-benefit rule. (Link rates are relative to the cluster file's
#     inter-node figures; a healthy link reads 0.2-1.5 on this shared machine.)
#
# Usage: tests/link_straggler_test.sh MALLEUS_BINARY SOURCE_DIR
# Environment: LINK_TEST_STEPS (60), LINK_TEST_SHAPE_AT (8), LINK_TEST_UNSHAPE_AT (28),
# LINK_TEST_RATE (268mbit). Exits 77 (CTest: skipped) where network namespaces cannot be made.
# Every process carries a time limit, and the namespaces are deleted whatever happens.
set -euo pipefail
malleus=$1 source_dir=$2
hosts="$source_dir/scripts/hosts.sh"
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-ml} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.14}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
steps=${LINK_TEST_STEPS:-60} shape_at=${LINK_TEST_SHAPE_AT:-8}
unshape_at=${LINK_TEST_UNSHAPE_AT:-28} rate=${LINK_TEST_RATE:-268mbit}

scratch=$(mktemp -d /tmp/link_straggler.XXXXXX)
job=""
cleanup() {
  [[ -z $job ]] || kill "$job" 2> /dev/null || true
  "$hosts" down || true
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
trap 'echo "FAIL: ${BASH_COMMAND} exited with $? (line $LINENO)"' ERR

"$hosts" up 2 # exits 77 where namespaces cannot be made
timeout 300 "$malleus" prepare-data --output "$scratch/data" > /dev/null

run="$scratch/run"
timeout -k 10 500 "$hosts" mpirun -np 4 "$malleus" train --model demo --seq-len 128 \
  --micro-batch 1 --global-batch 16 --threads 1 --steps "$steps" --warmup-steps 2 --lr 1e-3 \
  --eval-every 0 --checkpoint-every 0 --val-data '' --train-data "$scratch/data/train_*.bin" \
  --dp 4 --cluster "$source_dir/configs/clusters/cpu-bed-2x2.json" --out "$run" \
  > "$scratch/train.log" 2>&1 &
job=$!

# Runs "$2..." once step $1 is logged.
at_step() {
  local step=$1
  shift
  local deadline=$((SECONDS + 400))
  until grep -q "\"step\":$step," "$run/metrics.jsonl" 2> /dev/null; do
    if ! kill -0 "$job" 2> /dev/null || ((SECONDS > deadline)); then
      cat "$scratch/train.log"
      echo "FAIL: the run ended or stalled before step $step"
      exit 1
    fi
    sleep 0.2
  done
  "$@"
}
at_step "$shape_at" "$hosts" shape 1 "$rate"
echo "host 1's link throttled to $rate after step $shape_at"
at_step "$unshape_at" "$hosts" unshape 1
echo "host 1's link back to full speed after step $unshape_at"
status=0
wait "$job" || status=$?
job=""
cat "$scratch/train.log"
((status == 0)) || { echo "FAIL: training exited with $status"; exit 1; }

python3 - "$run/metrics.jsonl" "$shape_at" "$unshape_at" << 'EOF'
import json, sys
path, shape_at, unshape_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps, decisions = {}, []
for line in open(path):
    r = json.loads(line)
    if r.get("event") in ("replan", "replan_declined"):
        decisions.append(r)
    elif "step_time_s" in r:
        steps[r["step"]] = r
def fail(why):
    print("link rates by step: " + str([(s, steps[s].get("link_rates")) for s in sorted(steps)]))
    print("decisions: " + json.dumps(decisions))
    sys.exit("FAIL: " + why)

detected = next((s for s in range(shape_at + 1, shape_at + 4)
                 if max(steps[s].get("link_rates") or [1]) >= 3), None)
if detected is None:
    fail(f"no link slowdown within 3 steps of step {shape_at}")
link, compute = max(steps[detected]["link_rates"]), max(steps[detected]["rates"])
print(f"link slowdown seen at step {detected}: link rates {steps[detected]['link_rates']}, "
      f"compute rates {steps[detected]['rates']}")
if not compute < link / 2:
    fail(f"compute rates {steps[detected]['rates']} rose with the link ({link})")

while_slow = [d for d in decisions if shape_at < d["step"] <= unshape_at]
partial = [d for d in while_slow if 1 < max(d.get("link_rates") or [1]) < 3]
if partial:
    fail("planned for a partly slowed link: " + json.dumps(partial[0]))
switch = next((d for d in while_slow if d["event"] == "replan" and max(d["link_rates"]) >= 3), None)
if switch is None:
    fail("no re-plan for the slow link")
print(f"re-planned at step {switch['step']} for links {switch['link_rates']}: "
      f"{switch['old_plan']} -> {switch['new_plan']}")
unseen = [s for s in range(switch["step"] + 1, unshape_at + 1) if max(steps[s]["link_rates"]) < 3]
if unseen:
    fail(f"the slow link was not seen under the new plan at steps {unseen}")

slow_level = max(steps[unshape_at]["link_rates"])
recovered = next((s for s in range(unshape_at + 1, unshape_at + 4)
                  if max(steps[s]["link_rates"]) < min(3, slow_level / 2)), None)
if recovered is None:
    fail(f"the link did not read healthy (below 3 and half of {slow_level:.1f}) within 3 steps "
         f"of step {unshape_at}")
print(f"link recovery seen at step {recovered}: link rates {steps[recovered]['link_rates']}")
back = next((d for d in decisions if d["step"] > unshape_at and
             max(d.get("link_rates", [1])) < 3), None)
if back is None:
    fail("the controller did not ask again for the recovered link")
if back["event"] == "replan":
    print(f"re-planned back at step {back['step']}: {back['old_plan']} -> {back['new_plan']}")
elif any(w in back.get("reason", "") for w in ("does not pay", "still the best")):
    print(f"at step {back['step']} the controller kept the plan by the cost-benefit rule: "
          f"{back['reason']}")
else:
    fail("after recovery: " + json.dumps(back))
EOF
