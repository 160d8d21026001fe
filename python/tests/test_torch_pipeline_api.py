"""malleus.torch's pipelines, arguments and plans: what a caller gets wrong raises an exception
that says what and why (in a one-process gloo group, no launcher needed)."""

import os
import sys
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import malleus  # noqa: E402
import malleus.torch as mt  # noqa: E402
import pipeline_common as pc  # noqa: E402
import torch_common as tc  # noqa: E402
from pipeline_common import pipeline as pipe, plan, stage  # noqa: E402
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

    def make(self, blocks=None, optimizer=pc.make_optimizer, loss_fn=pc.loss_fn, **kw):
        args = dict(global_batch=pc.GLOBAL_BATCH, micro_batch=pc.MICRO_BATCH, seq_len=tc.SEQ,
                    model_config=pc.config())
        args.update(kw)
        return mt.PipelineParallel(pc.make_blocks() if blocks is None else blocks, optimizer,
                                   loss_fn, **args)

    def test_bad_construction(self):
        blocks = pc.make_blocks()
        with self.assertRaisesRegex(TypeError, "sequence of torch.nn.Module"):
            self.make(blocks=blocks[0])
        with self.assertRaisesRegex(TypeError, "sequence of torch.nn.Module"):
            self.make(blocks=[])
        with self.assertRaisesRegex(TypeError, "function params -> torch.optim.Optimizer"):
            self.make(optimizer=torch.optim.SGD(blocks[0].parameters(), lr=1))
        with self.assertRaisesRegex(TypeError, "must return a torch.optim.Optimizer"):
            self.make(optimizer=lambda params: None)
        with self.assertRaisesRegex(ValueError, "7 blocks for a model_config of 6 layers"):
            self.make(blocks=blocks[:7])
        with self.assertRaisesRegex(ValueError, "global_batch must be a positive int, got 0"):
            self.make(global_batch=0)
        with self.assertRaisesRegex(ValueError, "not a multiple of micro_batch 3"):
            self.make(micro_batch=3)
        with self.assertRaisesRegex(malleus.Error, "no-such-model"):
            self.make(model_config="no-such-model")
        with self.assertRaisesRegex(ValueError, "seq_len"):
            self.make(seq_len=0)
        tied = pc.make_blocks()
        tied[-1].out.weight = tied[0].embed.weight
        with self.assertRaisesRegex(ValueError, "blocks 0 and 7 share a parameter"):
            self.make(blocks=tied)

    def test_bad_plans_name_the_problem(self):
        one = [stage((0, 6), 0)]
        cases = [
            (42, "a plan is a malleus.Plan, a dict .* or a JSON file, got int"),
            ("/no/such/plan.json", "cannot open /no/such/plan.json"),
            ({"world_size": 1, "pipelines": []}, "no pipelines"),
            (plan(1, pipe(8, stage((0, 4), 0))), r"layers \[4, 6\) are not covered"),
            (plan(2, pipe(8, {"layers": [0, 6], "ranks": [0, 1]})),
             r"pipeline 0 stage 0 has ranks \[0, 1\]: malleus.torch runs one rank per stage"),
            (plan(1, pipe(8, dict(one[0], recompute="full"))), "does not recompute"),
            (plan(2, pipe(8, *one)), "the plan is for 2 ranks, the process group has 1"),
            (dict(plan(1, pipe(16, *one)), micro_batch_size=1),
             "micro_batch_size is 1, micro_batch is 2"),
            (plan(1, pipe(7, *one)), "sum to 14 samples, the global batch is 16"),
        ]
        for bad, message in cases:
            with self.subTest(plan=bad):
                with self.assertRaisesRegex((ValueError, TypeError), message):
                    self.make(plan=bad)
        pp = self.make(plan=plan(1, pipe(8, *one)))
        with self.assertRaisesRegex(ValueError, "one rank per stage"):
            pp.set_plan(plan(2, pipe(8, {"layers": [0, 6], "ranks": [0, 1]})))
        # A refused plan changes nothing.
        self.assertEqual(pp.plan, malleus.Plan(plan(1, pipe(8, *one)), pc.config()))

    def test_bad_steps(self):
        pp = self.make()
        data = tc.batches(1)[0]
        with self.assertRaisesRegex(TypeError, "callable .first, count. -> .inputs, targets."):
            pp.step(data[0])
        with self.assertRaisesRegex(TypeError, "must return .inputs, targets."):
            pp.step(lambda first, count: data[0][first:first + count])
        bad = self.make(loss_fn=lambda out, targets: out.sum())
        with self.assertRaisesRegex(TypeError, r"loss_fn must return \(loss_sum, units\)"):
            bad.step(data)
        none = self.make(loss_fn=lambda out, targets: (out.sum() * 0, 0))
        with self.assertRaisesRegex(ValueError, "no loss units"):
            none.step(data)

    def test_a_step_that_is_not_finite_raises_and_leaves_the_model(self):
        data = tc.batches(1)[0]
        for bad in (float("nan"), float("inf")):
            with self.subTest(loss=bad):
                pp = self.make(loss_fn=lambda out, targets: (
                    pc.loss_fn(out, targets)[0] * bad, pc.loss_fn(out, targets)[1]))
                before = [p.detach().clone() for b in pp.blocks.params for p in b]
                with self.assertRaisesRegex(FloatingPointError, "step 1 is not finite"):
                    pp.step(data)
                after = [p.detach() for b in pp.blocks.params for p in b]
                self.assertTrue(all(torch.equal(x, y) for x, y in zip(before, after)))

    def test_one_process_is_the_reference(self):
        pp = self.make()
        self.assertEqual(list(pp.held_blocks), list(range(8)))
        losses = [pp.step(d).loss for d in tc.batches(2)]
        want, _ = pc.reference_run(2)
        for got, ref in zip(losses, want):
            self.assertAlmostEqual(got, ref, delta=1e-6 * ref)


if __name__ == "__main__":
    unittest.main()
