"""malleus.torch around a real straggler: 2 ranks over gloo pinned to one core each; two busy
processes (taskset) share rank 1's core from step BUSY_FROM to step BUSY_TO (rank 1 gets a third
of it). The monitor must see it, the controller move micro-batches off rank 1 within 3 steps, and
the split must return to within one micro-batch of even within 3 x the monitor's window of the
busy processes leaving and stay there: the window must first clear of the busy steps, a partial
move back made while it does starts a second, and a third allows for the cores' own noise (seen:
rank 0 at 1.17 while the busy processes shared the other vCPU, a move back to [10, 6] at step 17,
rank 1 then at 1.19 for three steps, and [8, 8] one step past 2 windows).

Judges elapsed time: CTest runs it alone, in a session of its own (tests/own_session.sh). Only
rank 1 is loaded: a run that saw load from outside the test is made again
(torch_common.check_a_quiet_run)."""

import os
import shutil
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_common as tc  # noqa: E402

STEPS, BUSY_FROM, BUSY_TO = 27, 9, 16
EVEN = [8, 8]

WINDOW = 3    # the monitor's sliding window (malleus.torch's default)


@unittest.skipIf(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                 "needs 2 cores and taskset")
class Straggler(unittest.TestCase):
    def test_replans_around_a_busy_core_and_back(self):
        cores = sorted(os.sched_getaffinity(0))[:2]
        tc.check_a_quiet_run(
            self, lambda: tc.straggler_run("torch_worker.py", STEPS, BUSY_FROM, BUSY_TO, cores,
                                           400),
            unloaded=0, busy_from=BUSY_FROM)

    def check(self, log):
        # Healthy before: the even split all along.
        for s in range(1, BUSY_FROM):
            self.assertEqual(log[s]["split"], EVEN, log[s])
        # Seen and re-planned around within 3 steps: by the end of step BUSY_FROM + 2 the
        # controller has switched to a split that gives rank 1 less, and it stays so.
        moved = [s for s in range(BUSY_FROM, BUSY_FROM + 3)
                 if log[s]["next_split"][1] < log[s]["next_split"][0]]
        self.assertTrue(moved, [log[s] for s in range(BUSY_FROM, BUSY_FROM + 3)])
        for s in range(moved[0], BUSY_TO):
            self.assertLess(log[s]["next_split"][1], log[s]["next_split"][0], log[s])
        self.assertGreater(max(log[s]["rates"][1] for s in range(BUSY_FROM, BUSY_TO)), 2)
        # Back to within one micro-batch of even within 3 windows of the busy processes leaving,
        # and so to the end.
        def near_even(split):
            return abs(split[0] - split[1]) <= 2

        back = [s for s in range(BUSY_TO, BUSY_TO + 3 * WINDOW)
                if near_even(log[s]["next_split"])]
        self.assertTrue(back, [log[s] for s in range(BUSY_TO, BUSY_TO + 3 * WINDOW)])
        for s in range(back[0] + 1, STEPS + 1):
            self.assertTrue(near_even(log[s]["split"]), log[s])


if __name__ == "__main__":
    unittest.main()
