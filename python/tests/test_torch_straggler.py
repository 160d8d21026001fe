"""malleus.torch around a real straggler: 2 ranks over gloo pinned to one core each; two busy
processes (taskset) share rank 1's core from step BUSY_FROM to step BUSY_TO (rank 1 gets a third
of it). The monitor must see it, the controller move micro-batches off rank 1 within 3 steps, and
the split must return to even within 3 steps of the busy processes leaving. Judges elapsed time:
CTest runs it alone, in a session of its own (tests/own_session.sh), so that other sessions' load
is not read as a slowdown of rank 0."""

import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from malleus.torch import run  # noqa: E402

STEPS, BUSY_FROM, BUSY_TO = 24, 9, 16
EVEN = [8, 8]


@unittest.skipIf(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                 "needs 2 cores and taskset")
class Straggler(unittest.TestCase):
    def test_replans_around_a_busy_core_and_back(self):
        cores = sorted(os.sched_getaffinity(0))[:2]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "log.json")
            status = run.launch([sys.executable, os.path.join(HERE, "torch_worker.py"),
                                 "straggler", out, str(STEPS), str(BUSY_FROM), str(BUSY_TO),
                                 str(cores[1])], 2, cores=cores, timeout=400)
            self.assertEqual(status, 0)
            with open(out) as f:
                log = {e["step"]: e for e in json.load(f)}
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
        # Back to even within 3 steps of the busy process leaving, and even to the end.
        back = [s for s in range(BUSY_TO, BUSY_TO + 3) if log[s]["next_split"] == EVEN]
        self.assertTrue(back, [log[s] for s in range(BUSY_TO, BUSY_TO + 3)])
        for s in range(back[0] + 1, STEPS + 1):
            self.assertEqual(log[s]["split"], EVEN, log[s])


if __name__ == "__main__":
    unittest.main()
