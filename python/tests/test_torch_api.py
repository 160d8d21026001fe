"""malleus.torch's arguments: what a caller gets wrong raises an exception that says what and
why (in a one-process gloo group, no launcher needed)."""

import os
import subprocess
import sys
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import malleus  # noqa: E402
import malleus.torch as mt  # noqa: E402
import torch_common as tc  # noqa: E402
from malleus.torch import run  # noqa: E402


class Arguments(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run.free_port()), RANK="0",
                          WORLD_SIZE="1")
        mt.init_from_env("gloo")

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def make(self, **kw):
        model = tc.make_model()
        args = dict(global_batch=16, micro_batch=2, seq_len=tc.SEQ)
        args.update(kw)
        return mt.DataParallel(model, tc.make_optimizer(model), **args)

    def test_bad_construction(self):
        model = tc.make_model()
        with self.assertRaisesRegex(TypeError, "torch.nn.Module"):
            mt.DataParallel("model", tc.make_optimizer(model), global_batch=4)
        with self.assertRaisesRegex(TypeError, "torch.optim.Optimizer"):
            mt.DataParallel(model, "adam", global_batch=4)
        with self.assertRaisesRegex(ValueError, "global_batch must be a positive int, got 0"):
            self.make(global_batch=0)
        with self.assertRaisesRegex(ValueError, "not a multiple of micro_batch 3"):
            self.make(micro_batch=3)
        with self.assertRaisesRegex(ValueError, "bucket_mb must be positive"):
            self.make(bucket_mb=0)
        with self.assertRaisesRegex(malleus.Error, "no-such-model"):
            self.make(model_config="no-such-model")
        with self.assertRaisesRegex(ValueError, "seq_len"):
            self.make(seq_len=0)
        with self.assertRaisesRegex(ValueError, "loss_reduction is \"mean\" or \"sum\""):
            self.make(loss_reduction="avg")
        with self.assertRaisesRegex(TypeError, "units must be a callable"):
            self.make(units=3)

    def test_the_wrapper_is_a_module_shaped_like_ddp(self):
        model = tc.make_model()
        dp = mt.DataParallel(model, global_batch=16, micro_batch=2, seq_len=tc.SEQ)
        self.assertIsInstance(dp, torch.nn.Module)
        self.assertIs(dp.module, model)
        inputs = tc.batches(1)[0][0][:2]
        self.assertTrue(torch.equal(dp(inputs), model(inputs)))
        self.assertTrue(all(k.startswith("module.") for k in dp.state_dict()))
        self.assertEqual(len(list(dp.parameters())), len(list(model.parameters())))
        with dp.no_sync():  # DistributedDataParallel's, kept for loops written for it
            pass
        with self.assertRaisesRegex(RuntimeError, "step\(\) needs the optimizer"):
            dp.step(tc.batches(1)[0], tc.loss_sum)

    def test_bad_loops_are_named(self):
        dp = self.make(units=tc.counted_tokens)
        data = tc.batches(1)[0]
        first = dp.micro_batches(data)
        next(first)
        with self.assertRaisesRegex(RuntimeError, "began before the last one ended"):
            next(dp.micro_batches(data))
        first.close()
        with self.assertRaisesRegex(RuntimeError, "second backward"):
            for k, micro_batch in enumerate(dp.micro_batches(data)):
                loss = tc.mean_loss(dp, micro_batch)
                loss.backward(retain_graph=True)
                if k == 7:  # the last micro-batch
                    loss.backward()
        bad = self.make(units=lambda samples: -1)
        with self.assertRaisesRegex(ValueError, "units\(micro_batch\) must be a non-negative "
                                                "int, got -1"):
            next(bad.micro_batches(data))
        none = self.make(units=lambda samples: 0)
        with self.assertRaisesRegex(ValueError, "no loss units"):
            for micro_batch in none.micro_batches(data):
                tc.mean_loss(none, micro_batch).backward()

    def test_bad_splits(self):
        dp = self.make()
        with self.assertRaisesRegex(ValueError, "1 non-negative ints"):
            dp.set_split([4, 4])
        with self.assertRaisesRegex(ValueError, "has 7 micro-batches, the global batch 8"):
            dp.set_split([7])
        with self.assertRaisesRegex(ValueError, "non-negative"):
            dp.set_split([-8])
        self.assertEqual(dp.split, [8])

    def test_bad_step_arguments(self):
        dp = self.make()
        data = tc.batches(1)[0]
        with self.assertRaisesRegex(TypeError, "data must be a callable"):
            dp.step("tokens", tc.loss_sum)
        with self.assertRaisesRegex(TypeError, r"loss_fn must return \(loss_sum, units\)"):
            dp.step(data, lambda m, s: tc.loss_sum(m, s)[0])
        with self.assertRaisesRegex(ValueError, "no loss units"):
            dp.step(data, lambda m, s: (tc.loss_sum(m, s)[0] * 0, 0))
        # A callable gets (first, count) of the global batch, in order.
        seen = []

        def take(first, count):
            seen.append((first, count))
            return tuple(t[first:first + count] for t in data)
        r = dp.step(take, tc.loss_sum)
        self.assertEqual(seen, [(k, 2) for k in range(0, 16, 2)])
        self.assertEqual(r.split, [8])
        self.assertGreater(r.loss, 0)

    def test_a_step_that_is_not_finite_raises_and_leaves_the_model(self):
        dp = self.make()
        data = tc.batches(1)[0]
        before = [p.detach().clone() for p in dp.module.parameters()]
        for bad in (float("nan"), float("inf")):
            def scaled(model, samples):
                loss, units = tc.loss_sum(model, samples)
                return loss * bad, units
            with self.assertRaisesRegex(FloatingPointError,
                                        "step 1 is not finite .*the model was not updated"):
                dp.step(data, scaled)
        for b, p in zip(before, dp.module.parameters()):
            self.assertTrue(torch.equal(b, p))
        self.assertEqual(dp.steps, 0)
        # The next finite step runs as the first.
        r = dp.step(data, tc.loss_sum)
        self.assertEqual(r.step, 1)
        self.assertTrue(all(torch.isfinite(p).all() for p in dp.module.parameters()))

    def test_split_of_plan_rejects_other_parallelism(self):
        pp = malleus.uniform_plan("demo", 1, 1, 2, 8, 1, 2)
        with self.assertRaisesRegex(ValueError, "not a data-parallel plan"):
            mt.split_of_plan(pp, 2)
        self.assertEqual(mt.split_of_plan(mt.plan_of_split([3, 0, 5], 1, 4), 3), [3, 0, 5])


class ProcessGroupFaults(unittest.TestCase):
    """A rank that exits, or stops answering, in the middle of a step: the others stop with an
    error naming the step (at once, or after the process group's timeout), never hang, and the
    launcher reports the rank that failed first."""

    def run_fault(self, how, timeout_s):
        import tempfile
        import time
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "error.txt")
            worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_worker.py")
            start = time.monotonic()
            status = run.launch([sys.executable, worker, "fault", out, how, str(timeout_s)], 2,
                                timeout=240)
            elapsed = time.monotonic() - start
            with open(out) as f:
                return status, f.read(), elapsed

    def test_a_rank_that_exits_stops_the_others_at_once(self):
        status, error, _ = self.run_fault("exit", 300)
        self.assertEqual(status, 3)  # rank 1's own status, not the others' that follow from it
        self.assertIn("malleus.torch: step 2: the all-reduce of the gradients failed on rank 0 "
                      "of 2: another rank exited or did not answer", error)

    def test_a_rank_that_stops_answering_fails_the_others_after_the_timeout(self):
        status, error, elapsed = self.run_fault("hang", 5)
        self.assertEqual(status, 1)  # rank 0's; the launcher then stopped rank 1
        self.assertIn("malleus.torch: step 2: the all-reduce of the gradients failed", error)
        self.assertIn("Timed out", error)
        self.assertLess(elapsed, 120)

    def test_bad_environment_and_timeout(self):
        saved = dict(os.environ)
        try:
            with self.assertRaisesRegex(ValueError, "timeout_s must be a positive number"):
                mt.init_from_env("gloo", timeout_s=0)
            with self.assertRaisesRegex(ValueError, "timeout_s must be a positive number"):
                mt.init_from_env("gloo", timeout_s=float("nan"))
            os.environ.pop("MASTER_PORT", None)
            with self.assertRaisesRegex(RuntimeError, r"\$MASTER_PORT is not set"):
                mt.init_from_env("gloo")
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="x", RANK="0", WORLD_SIZE="1")
            with self.assertRaisesRegex(ValueError, r"\$MASTER_PORT must be a non-negative "
                                                    "integer, got 'x'"):
                mt.init_from_env("gloo")
            os.environ.update(MASTER_PORT="1234", RANK="2", WORLD_SIZE="2")
            with self.assertRaisesRegex(ValueError, r"\$RANK 2 is not below \$WORLD_SIZE 2"):
                mt.init_from_env("gloo")
        finally:
            os.environ.clear()
            os.environ.update(saved)


class WithoutTorch(unittest.TestCase):
    def test_import_names_the_interpreter_and_the_package(self):
        # An interpreter that cannot import torch (the pyenv python3 earlier on PATH than
        # Debian's): the error says which interpreter and where PyTorch comes from.
        code = ("import sys; sys.modules['torch'] = None\n"
                "try:\n    import malleus.torch\n"
                "except ImportError as e:\n    print(e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        self.assertIn(f"malleus.torch needs PyTorch, which {sys.executable} cannot import", out)
        self.assertIn("python3-torch", out)


if __name__ == "__main__":
    unittest.main()
