"""malleus.torch's numerics: on 1, 2 and 3 processes over gloo, with even, uneven and changing
splits (a rank given no micro-batch included), the losses and the parameters after every step
equal a single process training on the whole global batch in one forward: through step(), and
through a loop shaped like DistributedDataParallel's (mean losses per micro-batch weighted by
their tokens, global-norm clipping whose norm equals the single process's), with AdamW and with
torch.distributed.optim.ZeroRedundancyOptimizer.

Tolerance (fp32): the sums run in another order (per micro-batch, then across ranks), so losses
agree to a relative 1e-6 and parameters to an absolute 2e-6 after 4 AdamW steps at lr 1e-2
(measured: at most 1.4e-7 and 3.4e-7; a gradient weighted per rank or per micro-batch instead
of per token of the global batch is off by 1e-3 and more)."""

import json
import os
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_common as tc  # noqa: E402
from malleus.torch import run  # noqa: E402

STEPS = 4
SCHEDULES = {
    1: [[[8]] * STEPS],
    2: [[[4, 4]] * STEPS,                       # even
        [[7, 1]] * STEPS,                       # uneven
        [[4, 4], [8, 0], [1, 7], [0, 8]]],      # changing, down to none and back
    3: [[[3, 3, 2]] * STEPS,
        [[6, 1, 1]] * STEPS,
        [[3, 3, 2], [0, 4, 4], [8, 0, 0], [2, 5, 1]]],
}
LOSS_RTOL, PARAM_ATOL = 1e-6, 2e-6
NORM_RTOL = 1e-5


class Exactness(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ref_losses, cls.ref_params, _ = tc.reference_run(STEPS)
        _, cls.clipped_params, cls.ref_norms = tc.reference_run(STEPS, clip=tc.CLIP)

    def run_world(self, mode, world):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.pt")
            status = run.launch([sys.executable, os.path.join(HERE, "torch_worker.py"), mode,
                                 out, json.dumps(SCHEDULES[world])], world, timeout=300)
            self.assertEqual(status, 0)
            return torch.load(out)

    def check_loop(self, world):
        for result in self.run_world("loop", world):
            with self.subTest(world=world, optimizer=result["optimizer"],
                              schedule=result["schedule"]):
                self.assertEqual(result["splits"], result["schedule"])
                for got, want in zip(result["norms"], self.ref_norms):
                    self.assertLessEqual(abs(got - want), NORM_RTOL * want, (got, want))
                worst = max(float((a - b).abs().max())
                            for a, b in zip(result["params"], self.clipped_params))
                print(f"{world} processes, DDP-shaped loop, {result['optimizer']}, splits "
                      f"{result['schedule']}: worst parameter error {worst:.1e}", file=sys.stderr)
                self.assertLessEqual(worst, PARAM_ATOL)

    def check_world(self, world):
        results = self.run_world("exact", world)
        for schedule, result in zip(SCHEDULES[world], results):
            with self.subTest(world=world, schedule=schedule):
                self.assertEqual(result["splits"], schedule)
                for got, want in zip(result["losses"], self.ref_losses):
                    self.assertLessEqual(abs(got - want), LOSS_RTOL * abs(want), (got, want))
                worst = max(float((a - b).abs().max())
                            for a, b in zip(result["params"], self.ref_params))
                loss_err = max(abs(g - w) / abs(w) for g, w in zip(result["losses"],
                                                                   self.ref_losses))
                print(f"{world} processes, splits {schedule}: worst relative loss error "
                      f"{loss_err:.1e}, worst parameter error {worst:.1e}", file=sys.stderr)
                self.assertLessEqual(worst, PARAM_ATOL)

    def test_one_process(self):
        self.check_world(1)

    def test_two_processes(self):
        self.check_world(2)

    def test_three_processes(self):
        self.check_world(3)

    def test_ddp_shaped_loop_with_clipping_and_zero_on_one_process(self):
        self.check_loop(1)

    def test_ddp_shaped_loop_with_clipping_and_zero_on_two_processes(self):
        self.check_loop(2)

    def test_ddp_shaped_loop_with_clipping_and_zero_on_three_processes(self):
        self.check_loop(3)


if __name__ == "__main__":
    unittest.main()
