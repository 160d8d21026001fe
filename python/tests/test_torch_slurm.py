"""malleus.torch under srun: init_from_env reads Slurm's variables where torch's are absent
(slurm_rendezvous). Ranks that a real srun starts: tests/slurm_test.sh (case torch)."""

import os
import random
import socket
import subprocess
import sys
import unittest

import malleus
from malleus.torch import distributed as md

STEP = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "120",
        "SLURM_STEP_ID": "2", "SLURM_JOB_NODELIST": "gpu[07-08],login",
        "SLURM_STEP_NODELIST": "gpu[08],login"}


class SlurmRendezvous(unittest.TestCase):
    def test_torch_variables_from_slurms(self):
        self.assertEqual(md.slurm_rendezvous(STEP), {
            "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "MASTER_ADDR": "gpu08",  # the first host of the step's list, not the job's
            "MASTER_PORT": str(md.SLURM_PORT_BASE + 122)})
        job_only = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
        job_only["SLURM_STEP_ID"] = "batch"  # the batch step has a name, not a number
        values = md.slurm_rendezvous(job_only)
        self.assertEqual(values["MASTER_ADDR"], "gpu07")
        self.assertEqual(values["MASTER_PORT"], str(md.SLURM_PORT_BASE + 120))

    def test_torch_variables_win_and_outside_srun_nothing_changes(self):
        self.assertEqual(md.slurm_rendezvous(dict(STEP, RANK="0")), {})
        self.assertEqual(md.slurm_rendezvous({"SLURM_JOB_ID": "5"}), {})
        # Only what is missing is filled in.
        self.assertEqual(md.slurm_rendezvous(dict(STEP, MASTER_PORT="999"))["MASTER_ADDR"],
                         "gpu08")
        self.assertNotIn("MASTER_PORT", md.slurm_rendezvous(dict(STEP, MASTER_PORT="999")))

    def test_bad_slurm_variables_are_named(self):
        broken = {k: v for k, v in STEP.items() if k != "SLURM_NTASKS"}
        with self.assertRaisesRegex(RuntimeError, r"\$SLURM_PROCID is set .* but \$SLURM_NTASKS "
                                                  "is not"):
            md.slurm_rendezvous(broken)
        with self.assertRaisesRegex(ValueError, r"\$SLURM_PROCID must be a non-negative integer, "
                                                "got 'x'"):
            md.slurm_rendezvous(dict(STEP, SLURM_PROCID="x"))
        with self.assertRaisesRegex(malleus.Error, r"\$SLURM_STEP_NODELIST \"gpu\[3-1\]\": the "
                                                   "range \"3-1\" runs backwards"):
            md.slurm_rendezvous(dict(STEP, SLURM_STEP_NODELIST="gpu[3-1]"))

    def test_a_one_task_step_forms_its_process_group(self):
        # A free port of the span, reached through the job id as srun's ranks would reach it.
        port = None
        for _ in range(100):
            candidate = md.SLURM_PORT_BASE + random.randrange(md.SLURM_PORT_SPAN)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", candidate))
                except OSError:
                    continue
            port = candidate
            break
        self.assertIsNotNone(port, "no free port in the span")
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
        env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_STEP_ID="0",
                   SLURM_JOB_ID=str(port - md.SLURM_PORT_BASE), SLURM_JOB_NODELIST="localhost")
        env.pop("SLURM_STEP_NODELIST", None)
        code = ("import os, torch.distributed as dist, malleus.torch as mt; "
                "mt.init_from_env('gloo', timeout_s=60); "
                "print(dist.get_rank(), dist.get_world_size(), os.environ['MASTER_PORT']); "
                "dist.destroy_process_group()")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split(), ["0", "1", str(port)])


if __name__ == "__main__":
    unittest.main()
