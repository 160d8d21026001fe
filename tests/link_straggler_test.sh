#!/usr/bin/env bash
# A slow link, end to end on the multi-host test bed (scripts/hosts.sh): `malleus train` on HOSTS
# hosts × RANKS ranks (default 2 × 2, the calibrated cpu-bed-2x2 cluster; the cluster file is
# configs/clusters/cpu-bed-HOSTSxRANKS.json), starting under data parallelism across the hosts.
# Once step SHAPE_AT is logged, host SHAPE_HOST's link (default 1) is throttled with tc to RATE
# (default 268mbit: a tenth of the bed's 0.335 GB/s between hosts); once step UNSHAPE_AT is
# logged, the limit is removed. The test asserts that
#   - within 3 steps of the throttle the monitor reports a link slowdown (a node link rate of at
#     least 3) while the compute rates stay below half of it (not a compute straggler); on 3 or
#     more hosts, on the throttled host's node, and within the same 3 steps a step where every
#     other node reads below half of it (localized);
#   - the controller re-plans for the slow link (on 3 or more hosts: asks for it, with the other
#     nodes' links planned below half the throttled one's, and re-plans or declines by the
#     cost-benefit rule),
#     and every decision until the limit is removed plans for the link either as healthy or at
#     3 or more, never for a partly slowed step;
#   - the link still reads slow (3 or more) on every step from that decision until the limit is
#     removed, whatever the new plan sends across it (the probe); on 3 or more hosts the other
#     nodes' highest reading, median over those steps, is below half the throttled node's;
#   - within 3 steps of the limit's removal every link reads below 3 and below half its level
#     before, and the controller then asks again with links below 3: it re-plans back, or
#     declines by its cost rules (the move does not pay, the plan is still the best, or it holds
#     still after re-plans that did not pay). (Link rates are relative to the cluster file's
#     inter-node figures; a healthy link reads 0.2-1.5 on this shared machine.)
#
# Usage: tests/link_straggler_test.sh MALLEUS_BINARY SOURCE_DIR
# Environment: LINK_TEST_HOSTS (2), LINK_TEST_RANKS (2 per host), LINK_TEST_SHAPE_HOST (1),
# LINK_TEST_GLOBAL_BATCH (16), LINK_TEST_STEPS (36), LINK_TEST_SHAPE_AT (8),
# LINK_TEST_UNSHAPE_AT (28), LINK_TEST_RATE (268mbit). Exits 77 (CTest: skipped) where network
# namespaces cannot be made. Every process carries a time limit, and the namespaces are deleted
# whatever happens.
set -euo pipefail
malleus=$1 source_dir=$2
hosts="$source_dir/scripts/hosts.sh"
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-ml} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.14}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
# The window: the re-plan for the link comes about 4 steps after the throttle, but a healthy
# rank that reads slow on this shared machine can bring a compute re-plan first, and the
# controller then holds still for about 10 steps (seen: re-plan at 11, held through 21), so the
# link stays throttled for 20 steps; the re-plan back comes 4 steps after it is freed (8 runs on
# both beds), so the run ends 8 steps after that.
steps=${LINK_TEST_STEPS:-36} shape_at=${LINK_TEST_SHAPE_AT:-8}
unshape_at=${LINK_TEST_UNSHAPE_AT:-28} rate=${LINK_TEST_RATE:-268mbit}
host_count=${LINK_TEST_HOSTS:-2} ranks=${LINK_TEST_RANKS:-2} shape_host=${LINK_TEST_SHAPE_HOST:-1}
global_batch=${LINK_TEST_GLOBAL_BATCH:-16}
np=$((host_count * ranks))
cluster="$source_dir/configs/clusters/cpu-bed-${host_count}x${ranks}.json"
[[ -f $cluster ]] || { echo "FAIL: no cluster file $cluster for $host_count hosts x $ranks ranks"; exit 1; }
export MALLEUS_HOSTS_SLOTS=$ranks

scratch=$(mktemp -d /tmp/link_straggler.XXXXXX)
job=""
cleanup() {
  [[ -z $job ]] || kill "$job" 2> /dev/null || true
  "$hosts" down || true
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
trap 'echo "FAIL: a command exited with $? at line $LINENO"' ERR

"$hosts" up "$host_count" # exits 77 where namespaces cannot be made
timeout 300 "$malleus" prepare-data --output "$scratch/data" > /dev/null

run="$scratch/run"
timeout -k 10 500 "$hosts" mpirun -np "$np" "$malleus" train --model demo --seq-len 128 \
  --micro-batch 1 --global-batch "$global_batch" --threads 1 --steps "$steps" --warmup-steps 2 \
  --lr 1e-3 --eval-every 0 --checkpoint-every 0 --val-data '' \
  --train-data "$scratch/data/train_*.bin" --dp "$np" --cluster "$cluster" --out "$run" \
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
at_step "$shape_at" "$hosts" shape "$shape_host" "$rate"
echo "host $shape_host's link throttled to $rate after step $shape_at"
at_step "$unshape_at" "$hosts" unshape "$shape_host"
echo "host $shape_host's link back to full speed after step $unshape_at"
status=0
wait "$job" || status=$?
job=""
cat "$scratch/train.log"
((status == 0)) || { echo "FAIL: training exited with $status"; exit 1; }

python3 - "$run/metrics.jsonl" "$shape_at" "$unshape_at" "$host_count" "$shape_host" << 'EOF'
import json, sys
path, shape_at, unshape_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
host_count, shape_host = int(sys.argv[4]), int(sys.argv[5])
localize = host_count >= 3  # two hosts both read the one link between them


def kept_by_rule(d):
    """A decline by the controller's cost rules: the gain does not pay for the move, the plan is
    still the best, or it holds still after re-plans that did not pay (its rule against
    thrashing, "held")."""
    return d.get("held", False) or any(
        w in d.get("reason", "") for w in ("does not pay", "still the best"))


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

def slow_link(rates):  # the throttled node's reading on 3 or more hosts, else the highest
    rates = rates or [1]
    return rates[shape_host] if localize and shape_host < len(rates) else max(rates)
def others(rates):  # the other nodes' highest reading (on 3 or more hosts)
    return max(r for n, r in enumerate(rates) if n != shape_host)
detected = next((s for s in range(shape_at + 1, shape_at + 4)
                 if slow_link(steps[s].get("link_rates")) >= 3), None)
if detected is None:
    fail(f"no link slowdown within 3 steps of step {shape_at}")
link, compute = slow_link(steps[detected]["link_rates"]), max(steps[detected]["rates"])
print(f"link slowdown seen at step {detected}: link rates {steps[detected]['link_rates']}, "
      f"compute rates {steps[detected]['rates']}")
if not compute < link / 2:
    fail(f"compute rates {steps[detected]['rates']} rose with the link ({link})")
if localize:
    # Within the same 3 steps, a step where only the throttled node reads slow: the others below
    # half of it (a healthy link's reading on this shared machine reaches 2-4 on single steps).
    localized = next((s for s in range(shape_at + 1, shape_at + 4)
                      if slow_link(steps[s]["link_rates"]) >= 3 and
                      others(steps[s]["link_rates"]) < slow_link(steps[s]["link_rates"]) / 2),
                     None)
    if localized is None:
        fail(f"the slow link was not localized to node {shape_host} within 3 steps")
    print(f"localized at step {localized}: link rates {steps[localized]['link_rates']}")

while_slow = [d for d in decisions if shape_at < d["step"] <= unshape_at]
partial = [d for d in while_slow if 1 < slow_link(d.get("link_rates")) < 3]
if partial:
    fail("planned for a partly slowed link: " + json.dumps(partial[0]))
if localize:
    # The planner is told which node is slow: the decision for the slow link has only its node
    # at 3 or more; it may switch, or decline by the cost-benefit rule.
    switch = next((d for d in while_slow if slow_link(d["link_rates"]) >= 3), None)
    if switch is None:
        fail("the controller did not ask for the slow link")
    if others(switch["link_rates"]) >= slow_link(switch["link_rates"]) / 2:
        fail(f"planned for more than node {shape_host}'s link: {switch['link_rates']}")
    if switch["event"] != "replan" and not kept_by_rule(switch):
        fail("for the slow link: " + json.dumps(switch))
else:
    switch = next((d for d in while_slow
                   if d["event"] == "replan" and max(d["link_rates"]) >= 3), None)
    if switch is None:
        fail("no re-plan for the slow link")
if switch["event"] == "replan":
    print(f"re-planned at step {switch['step']} for links {switch['link_rates']}: "
          f"{switch['old_plan']} -> {switch['new_plan']}")
else:
    print(f"at step {switch['step']} the controller kept the plan for links "
          f"{switch['link_rates']}: {switch['reason']}")
slow_steps = range(switch["step"] + 1, unshape_at + 1)
unseen = [s for s in slow_steps if slow_link(steps[s]["link_rates"]) < 3]
if unseen:
    fail(f"the slow link was not seen under the new plan at steps {unseen}")
if localize:
    import statistics
    slow = statistics.median(slow_link(steps[s]["link_rates"]) for s in slow_steps)
    rest = statistics.median(others(steps[s]["link_rates"]) for s in slow_steps)
    if not rest < slow / 2:
        fail(f"over steps {slow_steps[0]}-{slow_steps[-1]} the other nodes read {rest:.1f} "
             f"(median of their highest), not below half of node {shape_host}'s {slow:.1f}")
    print(f"over steps {slow_steps[0]}-{slow_steps[-1]}: node {shape_host} read {slow:.1f}, the "
          f"others {rest:.1f} (medians)")

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
elif kept_by_rule(back):
    print(f"at step {back['step']} the controller kept the plan by the cost-benefit rule: "
          f"{back['reason']}")
else:
    fail("after recovery: " + json.dumps(back))
EOF
