"""The Python package over the C++ libraries: presets, plan, simulate, the monitor and the
controller behave as the CLI and the C++ trainer's, and bad arguments raise malleus.Error (a
ValueError) carrying the C++ message."""

import math
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
            self.assertEqual(sum(p["micro_batches"] for p in r["plan"]["pipelines"]), 16)
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
        ranks = sorted(p["stages"][0]["ranks"][0] for p in r["plan"]["pipelines"])
        self.assertEqual(ranks, [0, 1, 2])

    def test_bad_arguments_raise_the_cpp_message(self):
        with self.assertRaisesRegex(malleus.Error, "unknown strategy \"fastest\""):
            malleus.plan("cpu-local", "demo", strategy="fastest")
        with self.assertRaisesRegex(malleus.Error, "key \"9\" is not a device index"):
            malleus.plan("cpu-local", "demo", rates={9: 2})
        with self.assertRaisesRegex(malleus.Error, "rate"):
            malleus.plan("cpu-local", "demo", rates={1: 0.5})
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

    def test_the_controller_decides_with_the_shared_switch_rule(self):
        c = malleus.Controller("demo", world_size=2, global_batch=8, seq_len=128,
                               strategy="data-parallel", distributed_optimizer=False)
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        calm = c.decide(even, [1.0, 1.1], 3, 3, 50)
        self.assertFalse(calm.asked)
        d = c.decide(even, [1.0, 3.0], 3, 4, 50)
        self.assertTrue(d.asked and d.take, d.reason)
        split = {p["stages"][0]["ranks"][0]: p["micro_batches"] for p in d.plan["pipelines"]}
        self.assertEqual(split, {0: 6, 1: 2})
        self.assertLess(d.proposed_step_s, d.current_step_s)
        self.assertAlmostEqual(d.gain_s, (d.current_step_s - d.proposed_step_s) * 50)
        self.assertFalse(d.incremental)  # only the malleus strategy re-plans incrementally
        # Near the end the same gain need not pay: propose() answers whether or not rates moved.
        late = c.propose(even, [1.0, 3.0], 99, 1)
        self.assertEqual(late.horizon_steps, 1)

    def test_a_hopeless_replica_gets_nothing_and_rejoins_when_healed(self):
        c = malleus.Controller("demo", world_size=2, global_batch=8, seq_len=128,
                               strategy="data-parallel", distributed_optimizer=False)
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        gone = c.decide(even, [1.0, 50.0], 3, 1, 100)
        self.assertTrue(gone.take, gone.reason)
        self.assertEqual([p["stages"][0]["ranks"] for p in gone.plan["pipelines"]], [[0]])
        self.assertEqual(gone.plan["pipelines"][0]["micro_batches"], 8)
        for step in (2, 3, 4):  # the switch pays while rank 1 stays slow
            self.assertFalse(c.decide(gone.plan, [1.0, 50.0], 3, step, 100 - step).asked)
        self.assertFalse(c.holding)
        healed = c.decide(gone.plan, [1.0, 1.0], 3, 5, 96)
        self.assertTrue(healed.take, healed.reason)
        self.assertEqual(sorted(p["micro_batches"] for p in healed.plan["pipelines"]), [4, 4])

    def test_bad_controller_arguments_are_named(self):
        with self.assertRaisesRegex(malleus.Error, "unknown strategy"):
            malleus.Controller("demo", world_size=2, global_batch=8, strategy="nope")
        with self.assertRaisesRegex(malleus.Error, "world_size"):
            malleus.Controller("demo", world_size=0, global_batch=8)
        c = malleus.Controller("demo", world_size=2, global_batch=8, seq_len=128)
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)
        with self.assertRaisesRegex(malleus.Error, "expected a rate for each of the 2 ranks"):
            c.decide(even, [1.0], 3, 1, 10)
        with self.assertRaisesRegex(malleus.Error, "needs a broadcast"):
            c.decide(even, [1.0, 5.0], 3, 1, 10, root=False)
        with self.assertRaisesRegex(malleus.Error, "world_size must be 0"):
            malleus.uniform_plan("demo", 2, 1, 1, 8, 1, -5)

    def test_a_broken_broadcast_is_named_not_followed(self):
        """The broadcast is the caller's transport: one that returns something else than rank
        0's decision would leave ranks on different plans; each breach is named."""
        even = malleus.uniform_plan("demo", 2, 1, 1, 8, 1, 2)

        def decide(broadcast, root):
            c = malleus.Controller("demo", world_size=2, global_batch=8, seq_len=128,
                                   strategy="data-parallel", distributed_optimizer=False)
            return c.decide(even, [1.0, 3.0], 3, 4, 50, root=root, broadcast=broadcast)

        # The same transport, faithful: rank 0's text goes through unchanged.
        sent = []
        root = decide(lambda text: sent.append(text) or text, True)
        self.assertTrue(root.take, root.reason)
        self.assertEqual(sent[0][0], "0")
        other = decide(lambda text: sent[0], False)
        self.assertEqual(other.plan, root.plan)
        for broadcast, root, message in [
                (lambda text: text + "x", True, "on rank 0 the broadcast must return the text"),
                (lambda text: 5, True, "must return a str"),
                (lambda text: None, False, "must return a str"),
                (lambda text: "1garbage{", False, "not rank 0's decision"),
                (lambda text: "{}", False, "not rank 0's decision"),
                (lambda text: "1{}", False, "re-plan: missing key"),
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


if __name__ == "__main__":
    unittest.main()
