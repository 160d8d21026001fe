"""The Python package over the C++ libraries: presets, plan, simulate, the monitor and the
straggler loop behave as the CLI and the C++ trainer's, the type stub names what the module
holds, and bad arguments raise malleus.Error (a ValueError) carrying the C++ message."""

import ast
import math
import os
import unittest

import malleus


class Presets(unittest.TestCase):
    def test_presets_are_the_compiled_in_files(self):
        self.assertIn("demo", malleus.model_presets())
        self.assertIn("cpu-local", malleus.cluster_presets())
        demo = malleus.model_config("demo")
        self.assertEqual((demo["hidden_size"], demo["num_layers"], demo["vocab_size"]),
                         (256, 4, 257))
        self.assertEqual(malleus.model_config(demo), demo)  # a dict round-trips
        self.assertEqual(malleus.cluster("cpu-local")["devices_per_node"], 4)
        self.assertIn("malleus", malleus.strategies())

    def test_bad_presets_name_the_problem(self):
        with self.assertRaisesRegex(malleus.Error, "no-such-model"):
            malleus.model_config("no-such-model")
        with self.assertRaisesRegex(malleus.Error, "hidden_size"):
            malleus.model_config(dict(malleus.model_config("demo"), hidden_size=-1))
        with self.assertRaises(ValueError):  # malleus.Error is a ValueError
            malleus.cluster("no-such-cluster")
        with self.assertRaisesRegex(malleus.Error, "expected a preset name"):
            malleus.model_config(42)


class PlanAndSimulate(unittest.TestCase):
    def test_plan_routes_around_a_straggler_as_the_cli_does(self):
        healthy = malleus.plan("cpu-local", "demo", global_batch=16, seq_len=128)
        slow = malleus.plan("cpu-local", "demo", rates={1: 4}, global_batch=16, seq_len=128)
        for r in (healthy, slow):
            self.assertEqual(r["strategy"], "malleus")
            self.assertEqual(sum(p["micro_batches"] for p in r["plan"].pipelines), 16)
            self.assertEqual(r["plan"].global_batch, 16)
            self.assertGreater(r["samples_per_s"], 0)
        self.assertGreater(slow["predicted_iteration_s"], healthy["predicted_iteration_s"])
        # The plan simulates to the time `plan` reported for it.
        sim = malleus.simulate("cpu-local", "demo", slow["plan"], rates={"1": 4},
                               global_batch=16, seq_len=128)
        self.assertAlmostEqual(sim["simulated_iteration_s"], slow["simulated_iteration_s"],
                               places=9)
        self.assertEqual(len(sim["devices"]), 4)

    def test_a_gone_device_reads_infinite(self):
        p = malleus.uniform_plan("demo", 4, 1, 1, 16, 1, 4)
        sim = malleus.simulate("cpu-local", "demo", p, rates={2: float("inf")},
                               global_batch=16, seq_len=128)
        self.assertTrue(math.isinf(sim["simulated_iteration_s"]))

    def test_data_parallel_strategy_drops_a_hopeless_replica(self):
        r = malleus.plan("cpu-local", "demo", rates=[1, 1, 1, 100], strategy="data-parallel",
                         global_batch=16, seq_len=128)
        ranks = sorted(p["stages"][0]["ranks"][0] for p in r["plan"].pipelines)
        self.assertEqual(ranks, [0, 1, 2])

    def test_bad_arguments_raise_the_cpp_message(self):
        with self.assertRaisesRegex(malleus.Error, "unknown strategy \"fastest\""):
            malleus.plan("cpu-local", "demo", strategy="fastest")
        with self.assertRaisesRegex(malleus.Error, "key \"9\" is not a device index"):
            malleus.plan("cpu-local", "demo", rates={9: 2})
        with self.assertRaisesRegex(malleus.Error, "rate"):
            malleus.plan("cpu-local", "demo", rates={1: 0.5})
        # Named at once, not a search that runs for minutes.
        with self.assertRaisesRegex(malleus.Error, "more than the 1048576 a step may have"):
            malleus.plan("cpu-local", "demo", global_batch=2**31 - 1)
        with self.assertRaisesRegex(malleus.Error, "global batch"):
            malleus.simulate("cpu-local", "demo", malleus.uniform_plan("demo", 4, 1, 1, 16),
                             global_batch=32)
        with self.assertRaisesRegex(malleus.Error, "micro"):
            malleus.plan_summary({"world_size": 1, "micro_batch_size": 1, "pipelines": [
                {"micro_batches": 0, "stages": [{"layers": [0, 4], "ranks": [0]}]}]}, "demo")


class MonitorAndController(unittest.TestCase):
    def test_the_monitor_rates_each_rank_against_its_own_healthy_speed(self):
        m = malleus.Monitor(2, window=3)
        for _ in range(4):
            rates = m.observe([1.0, 1.0], [1e9, 1e9], ["g", "g"])
        self.assertEqual(rates, [1.0, 1.0])
        rates = m.observe([1.0, 3.0], [1e9, 1e9], ["g", "g"])
        self.assertEqual(rates, [1.0, 1.0])  # one slow step moves nothing (median of 3)
        rates = m.observe([1.0, 3.0], [1e9, 1e9], ["g", "g"])
        self.assertAlmostEqual(rates[1], 3.0)
        self.assertEqual(m.samples, 6)
        # Slow from the first step: seen against the identical peer's calibration.
        slow = malleus.Monitor(2, window=3)
        for _ in range(3):
            rates = slow.observe([1.0, 2.0], [1e9, 1e9], ["g", "g"])
        self.assertAlmostEqual(rates[1], 2.0)
        with self.assertRaisesRegex(malleus.Error, "expected"):
            m.observe([1.0], [1e9], ["g"])
        with self.assertRaisesRegex(malleus.Error, "negative"):
            m.observe([1.0, -1.0], [1e9, 1e9], ["g", "g"])
        with self.assertRaisesRegex(malleus.Error, "world size"):
            malleus.Monitor(0)
        # Named, not a MemoryError from a failed allocation.
        with self.assertRaisesRegex(malleus.Error, "more than the 1048576 a monitor takes"):
            malleus.Monitor(10**9)
        with self.assertRaisesRegex(malleus.Error, "rank 1's time and FLOPs must be finite"):
            m.observe([1.0, float("inf")], [1e9, 1e9], ["g", "g"])



def same_record(a, b):
    """Two Decision.to_dict()s are equal (unknown numbers, NaN, equal each other)."""
    nan = lambda x: isinstance(x, float) and math.isnan(x)  # noqa: E731
    return a.keys() == b.keys() and all(a[k] == b[k] or (nan(a[k]) and nan(b[k])) for k in a)


def step_seconds(loop, slowdown):
    """Every rank's compute seconds for one step of its work under the loop's plan, on devices
    doing 1e11 FLOP/s slowed by `slowdown`."""
    return [f * 1e-11 * x for f, x in zip(loop.work_flops, slowdown)]


def run(loop, slowdowns, first_step=1, total=100):
    """Observes one step per slowdown list; returns the decisions by step."""
    decisions = {}
    for k, slow in enumerate(slowdowns):
        step = first_step + k
        d = loop.observe(step, step_seconds(loop, slow), remaining_steps=total - step)
        if d is not None:
            decisions[step] = d
    return decisions


class PlansAndTheStragglerLoop(unittest.TestCase):
    def test_a_plan_is_a_class_with_its_json_form_and_each_ranks_role(self):
        p = malleus.uniform_plan("demo", 2, 1, 2, 16, 1, 5)  # 2 pipelines of 2 stages, 1 idle
        self.assertIsInstance(p, malleus.Plan)
        self.assertEqual((p.world_size, p.micro_batch_size, p.global_batch), (5, 1, 16))
        self.assertEqual(p.idle_ranks, [4])
        self.assertEqual(malleus.Plan(p.to_dict(), "demo"), p)  # the JSON form round-trips
        self.assertEqual(p.summary, malleus.plan_summary(p.to_dict(), "demo"))
        self.assertEqual(p.role(1), {"pipeline": 0, "stage": 1, "stages": 2, "layers": (2, 4),
                                     "micro_batches": 8, "tp_rank": 0, "tp_ranks": [1],
                                     "previous_ranks": [0], "next_ranks": []})
        self.assertIsNone(p.role(4))
        flops = p.work_flops("demo", 128)
        self.assertEqual(flops[4], malleus.PROBE_FLOPS)
        self.assertEqual(malleus.PROBE_FLOPS, 2.0 * malleus.PROBE_REPEATS * malleus.PROBE_SIZE ** 3)
        whole = malleus.training_flops("demo", 1, 128)
        self.assertAlmostEqual(sum(flops[:4]) / (16 * whole), 1.0, places=12)
        with self.assertRaisesRegex(malleus.Error, "no rank 5"):
            p.role(5)
        with self.assertRaisesRegex(malleus.Error, "plan dict"):
            malleus.Plan({"world_size": 1, "micro_batch_size": 1, "pipelines": []}, "demo")

    def test_the_loop_switches_by_the_shared_rule_and_the_decision_is_one_record(self):
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        loop = malleus.StragglerLoop(even, "demo", seq_len=128, strategy="data-parallel",
                                     distributed_optimizer=False)
        self.assertEqual(run(loop, [[1, 1.1]] * 4), {})  # calm: the controller is not asked
        decisions = run(loop, [[1, 3]] * 3, first_step=5)
        self.assertEqual(len(decisions), 1)
        (step, d), = decisions.items()
        self.assertTrue(d.switched, d.reason)
        self.assertEqual(loop.plan, d.plan)
        split = {p["stages"][0]["ranks"][0]: p["micro_batches"] for p in d.plan.pipelines}
        self.assertEqual(split, {0: 6, 1: 2})
        self.assertLess(d.predicted_new_s, d.predicted_old_s)
        self.assertAlmostEqual(d.predicted_gain_s, d.predicted_old_s - d.predicted_new_s)
        self.assertEqual(d.search, "full")  # only the malleus strategy re-plans incrementally
        self.assertEqual((d.step, d.horizon_steps), (step, 50))
        self.assertAlmostEqual(d.rates[1], 3.0 / 1.1)  # against its own healthy speed (1.1)
        self.assertEqual(loop.monitored_steps, 7 - step)  # counted again from the switch
        # One record: to_dict() has every field by the names the class has, and str() is the
        # trainer's log line.
        record = d.to_dict()
        self.assertEqual(tuple(record), malleus.Decision.fields)
        self.assertTrue(same_record(record, {k: getattr(d, k) for k in malleus.Decision.fields}))
        self.assertTrue(math.isnan(d.migration_s))  # unknown: nothing measured a migration
        self.assertTrue(str(d).startswith(f"re-plan at step {step}: 2 pipelines"), str(d))
        # The loop's geometries and FLOPs are the new plan's.
        self.assertEqual(loop.work_flops, d.plan.work_flops("demo", 128))

    def test_a_hopeless_replica_gets_nothing_and_rejoins_when_healed(self):
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        loop = malleus.StragglerLoop(even, "demo", seq_len=128, strategy="data-parallel",
                                     distributed_optimizer=False)
        gone = run(loop, [[1, 1]] * 3 + [[1, 50]] * 3)
        self.assertEqual(len(gone), 1)
        d = list(gone.values())[0]
        self.assertTrue(d.switched, d.reason)
        self.assertEqual([p["stages"][0]["ranks"] for p in d.plan.pipelines], [[0]])
        self.assertEqual(loop.geometries[1], "probe")  # the idle rank times the probe
        self.assertEqual(run(loop, [[1, 50]] * 4, first_step=7), {})  # it pays while slow
        self.assertFalse(loop.holding)
        healed = run(loop, [[1, 1]] * 3, first_step=11)
        self.assertEqual([d.switched for d in healed.values()], [True])
        self.assertEqual(sorted(p["micro_batches"] for p in loop.plan.pipelines), [4, 4])

    def test_the_loop_measures_without_asking_when_replanning_is_off(self):
        loop = malleus.StragglerLoop(malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2), "demo",
                                     seq_len=128, replan=False)
        self.assertFalse(loop.replans)
        self.assertEqual(run(loop, [[1, 1]] * 3 + [[1, 4]] * 3), {})
        self.assertAlmostEqual(loop.rates[1], 4.0)

    def test_the_decision_travels_over_the_callers_broadcast(self):
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        root, other = (malleus.StragglerLoop(even, "demo", seq_len=128, strategy="data-parallel")
                       for _ in range(2))
        sent = []

        def broadcast(text):
            sent.append(text)
            return text

        for step in range(1, 7):
            slow = [1, 3] if step > 3 else [1, 1]
            d = root.observe(step, step_seconds(root, slow), root=True, broadcast=broadcast)
            if d is not None:
                o = other.observe(step, step_seconds(other, slow), root=False,
                                  broadcast=lambda text: sent[-1])
                self.assertTrue(same_record(o.to_dict(), d.to_dict()))  # the same on every rank
                break
            other.observe(step, step_seconds(other, slow), root=False,
                          broadcast=lambda text: self.fail("asked on one rank only"))
        self.assertEqual(root.plan, other.plan)
        self.assertTrue(d is not None and d.switched)

    def test_a_loop_without_tensor_parallelism_plans_one_rank_per_stage(self):
        # On 4 ranks of cpu-local the malleus strategy forms TP groups around a slow rank; with
        # max_tp=1 (malleus.torch's pipelines) every stage it plans has one rank.
        even = malleus.uniform_plan("demo", 4, 1, 1, 16, 2, 4)

        def widest(plan):
            return max(len(s["ranks"]) for p in plan.pipelines for s in p["stages"])

        for slow in ([1, 1, 1, 2], [1, 4, 1, 1], [3, 1, 1, 1.5]):
            plans = {}
            for max_tp in (0, 1):
                loop = malleus.StragglerLoop(even, "demo", seq_len=128, recompute=False,
                                             distributed_optimizer=False, max_tp=max_tp)
                switched = [d for d in run(loop, [[1] * 4] * 3 + [slow] * 3).values()
                            if d.switched]
                self.assertEqual(len(switched), 1, slow)
                plans[max_tp] = switched[0].plan
            self.assertGreater(widest(plans[0]), 1, (slow, plans[0].summary))
            self.assertEqual(widest(plans[1]), 1, (slow, plans[1].summary))
        with self.assertRaisesRegex(malleus.Error, "max_tp must not be negative"):
            malleus.StragglerLoop(even, "demo", max_tp=-1)

    def test_bad_loop_arguments_are_named(self):
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        with self.assertRaisesRegex(malleus.Error, "unknown strategy"):
            malleus.StragglerLoop(even, "demo", strategy="nope")
        with self.assertRaisesRegex(malleus.Error, "the cluster has 4 devices, the plan 2"):
            malleus.StragglerLoop(even, "demo", cluster=malleus.cluster("cpu-local"))
        with self.assertRaisesRegex(malleus.Error, "seq_len"):
            malleus.StragglerLoop(even, "demo", seq_len=10**6)
        loop = malleus.StragglerLoop(even, "demo", seq_len=128)
        with self.assertRaisesRegex(malleus.Error, "a compute time for each of the 2 ranks, got 1"):
            loop.observe(1, [1.0])
        with self.assertRaisesRegex(malleus.Error, "needs a broadcast"):
            loop.observe(1, [1.0, 1.0], root=False)
        with self.assertRaisesRegex(malleus.Error, "must be finite and not negative"):
            loop.observe(1, [1.0, -1.0])
        with self.assertRaisesRegex(malleus.Error, "rank 0's time and FLOPs must be finite"):
            loop.observe(1, [float("nan"), 1.0])
        with self.assertRaisesRegex(malleus.Error, "world_size must be 0"):
            malleus.uniform_plan("demo", 2, 1, 1, 8, 1, -5)

    def test_a_broken_broadcast_is_named_not_followed(self):
        """The broadcast is the caller's transport: one that returns something else than rank
        0's decision would leave ranks on different plans; each breach is named."""
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)

        def decide(broadcast, root):  # rank 1 slowed 3x from step 4: the loop is asked
            loop = malleus.StragglerLoop(even, "demo", seq_len=128, strategy="data-parallel",
                                         distributed_optimizer=False)
            for step in range(1, 8):
                d = loop.observe(step, step_seconds(loop, [1, 3] if step > 3 else [1, 1]),
                                 root=root, broadcast=broadcast)
                if d is not None:
                    return d
            self.fail("the loop was never asked")

        # The same transport, faithful: rank 0's text goes through unchanged.
        sent = []
        root = decide(lambda text: sent.append(text) or text, True)
        self.assertTrue(root.switched, root.reason)
        self.assertEqual(sent[0][0], "0")
        other = decide(lambda text: sent[0], False)
        self.assertEqual(other.plan, root.plan)
        for broadcast, root, message in [
                (lambda text: text + "x", True, "on rank 0 the broadcast must return the text"),
                (lambda text: 5, True, "must return a str"),
                (lambda text: None, False, "must return a str"),
                (lambda text: "1garbage{", False, "not rank 0's decision"),
                (lambda text: "{}", False, "not rank 0's decision"),
                (lambda text: "1{}", False, "lacks its record or its plan"),
                ("not a function", True, "broadcast must be a function")]:
            with self.assertRaisesRegex(malleus.Error, message):
                decide(broadcast, root)
        # The caller's own exception comes through as it is.
        with self.assertRaises(ZeroDivisionError):
            decide(lambda text: 1 / 0, True)

    def test_a_device_or_a_folder_is_no_file(self):
        with self.assertRaisesRegex(malleus.Error, "cannot read /dev/zero: it is a device"):
            malleus.plan("cpu-local", "/dev/zero")
        with self.assertRaisesRegex(malleus.Error, "cannot read /tmp: it is a directory"):
            malleus.model_config("/tmp")


class TypeStub(unittest.TestCase):
    """_malleus.pyi against the module: the same names, and Decision's attributes exactly the
    decision record's fields (the C++ field list)."""

    def test_the_stub_names_what_the_module_holds(self):
        path = os.path.join(os.path.dirname(malleus.__file__), "_malleus.pyi")
        with open(path) as f:
            tree = ast.parse(f.read())
        top, classes = set(), {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                top.add(node.name)
                classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                classes[node.name] |= {n.target.id for n in node.body
                                       if isinstance(n, ast.AnnAssign)}
            elif isinstance(node, ast.FunctionDef):
                top.add(node.name)
            elif isinstance(node, ast.AnnAssign) and node.target.id.isupper():
                top.add(node.target.id)
        public = {n for n in dir(malleus._malleus) if not n.startswith("_")}
        self.assertEqual(top, public)
        for name, members in classes.items():
            if name == "Error":
                continue
            have = {n for n in dir(getattr(malleus._malleus, name)) if not n.startswith("_")}
            self.assertEqual(members - {"__init__", "__eq__", "__hash__"}, have, name)
        self.assertEqual(classes["Decision"] - {"to_dict", "fields"},
                         set(malleus.Decision.fields))


if __name__ == "__main__":
    unittest.main()
