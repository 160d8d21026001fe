"""malleus.torch.Watchdog: a rank stopped with SIGSTOP in the middle of training (as a hung device
or driver leaves it) is named, with its host, by the others, which end within the watchdog's limit
with that error (exit status 87), not a gloo traceback after the process group's timeout; the job
then starts again without it, from the last checkpoint, and its losses equal one process training
on the whole global batch.

Judges elapsed time: alone (SERIAL), in a session of its own."""

import json
import os
import signal
import socket
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_common as tc  # noqa: E402
import malleus.torch as mt  # noqa: E402
from malleus.torch import run, watchdog  # noqa: E402

WORKER = os.path.join(HERE, "torch_watchdog_worker.py")
STEPS, STOP_AT = 12, 6


class StoppedRank(unittest.TestCase):
    def test_the_others_end_within_the_limit_naming_it_and_the_job_goes_on_without_it(self):
        with tempfile.TemporaryDirectory() as run_dir:
            procs = run.start([sys.executable, WORKER, run_dir, str(STEPS), "2", str(STOP_AT)], 3)
            try:
                # Ranks 0 and 1 end by themselves; rank 2 stays stopped.
                deadline = time.monotonic() + 120
                while any(p.poll() is None for p in procs[:2]) and time.monotonic() < deadline:
                    time.sleep(0.02)
                ended = time.time()
                codes = [p.poll() for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
            self.assertEqual(codes[:2], [watchdog.HANG_EXIT_CODE] * 2, codes)
            self.assertIsNone(codes[2])  # still stopped when the others had ended
            report = watchdog.hang_report(run_dir)
            self.assertEqual(watchdog.lost_ranks(run_dir), [2])
            with open(os.path.join(run_dir, "stopped")) as f:
                stopped = float(f.read())
            limit = report["limit_s"]
            self.assertGreaterEqual(limit, 3.0)
            # Within the limit, a beat, and the time to read the heartbeats and exit.
            self.assertLess(ended - stopped, limit + 2.0, report["message"])
            errors = ""
            for rank in range(2):
                with open(os.path.join(run_dir, f"stderr_{rank}.txt")) as f:
                    errors += f.read()
            self.assertIn(f"watchdog: step {STOP_AT} has taken", errors)
            self.assertIn("did not arrive: rank 2: no heartbeat for", errors)
            self.assertIn(f"on {socket.gethostname()} is not running), last in ", errors)
            self.assertNotIn("Traceback", errors)
            self.assertNotIn("gloo", errors.lower())

            # What a launcher does next: the same script on the ranks left, from the checkpoint.
            left = 3 - len(watchdog.lost_ranks(run_dir))
            os.rename(os.path.join(run_dir, "hang.json"), os.path.join(run_dir, "hang-1.json"))
            status = run.launch([sys.executable, WORKER, run_dir, str(STEPS), "-1", "0"], left,
                                timeout=300)
            self.assertEqual(status, 0)
            with open(os.path.join(run_dir, "losses.json")) as f:
                losses = json.load(f)
            want, _, _ = tc.reference_run(STEPS)
            self.assertEqual(len(losses), STEPS)
            for got, ref in zip(losses, want):
                self.assertLessEqual(abs(got - ref), 1e-5 * abs(ref), (losses, want))

    def test_one_rank_waits_for_nobody_and_bad_arguments_are_named(self):
        with tempfile.TemporaryDirectory() as run_dir:
            alone = mt.Watchdog(run_dir, rank=0, world_size=1)
            alone.step(1)
            self.assertEqual(alone.limit_s(), 0.0)
            self.assertFalse(os.path.exists(os.path.join(run_dir, "heartbeats")))
            with self.assertRaisesRegex(TypeError, "run_dir must be a path"):
                mt.Watchdog(None, rank=0, world_size=2)
            with self.assertRaisesRegex(ValueError, "rank 2 of world size 2 is not a rank"):
                mt.Watchdog(run_dir, rank=2, world_size=2)
            with self.assertRaisesRegex(ValueError, "floor_s and cut_after_s must be positive"):
                mt.Watchdog(run_dir, floor_s=0, rank=0, world_size=2)
            self.assertIsNone(watchdog.hang_report(run_dir))
            self.assertEqual(watchdog.lost_ranks(run_dir), [])


if __name__ == "__main__":
    unittest.main()
