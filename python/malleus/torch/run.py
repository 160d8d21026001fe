"""Starts a script on N local processes for torch.distributed, as torchrun does on one host
(Debian's torchrun does not start): MASTER_ADDR, MASTER_PORT (a free port), RANK, LOCAL_RANK and
WORLD_SIZE in each process's environment; ``--cores`` pins rank r to the r-th core of a list.

    python3 -m malleus.torch.run --nproc 2 [--cores 0,1] script.py [args...]

Exits with the first non-zero exit status of a rank (the other ranks are then stopped, after up
to STOP_GRACE_S for them to exit by themselves and say why).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

# After a rank fails, how long the others get to exit by themselves before they are stopped: their
# collectives fail at once when a rank exits, and they print that error (which step, which rank)
# on their way out; a rank that hangs is stopped after it.
STOP_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: Sequence[str], nproc: int, cores: Optional[Sequence[int]] = None,
          env: Optional[dict] = None, port: Optional[int] = None) -> List[subprocess.Popen]:
    """Starts ``argv`` on ``nproc`` ranks; returns the processes (rank order)."""
    if nproc < 1:
        raise ValueError(f"malleus.torch.run: --nproc must be at least 1, got {nproc}")
    port = port or free_port()
    procs = []
    for rank in range(nproc):
        e = dict(os.environ if env is None else env)
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        pin = None
        if cores:
            core = cores[rank % len(cores)]
            pin = (lambda c: lambda: os.sched_setaffinity(0, {c}))(core)
        procs.append(subprocess.Popen(list(argv), env=e, preexec_fn=pin))
    return procs


def wait(procs: List[subprocess.Popen], timeout: Optional[float] = None) -> int:
    """Waits for every rank; on the first failure stops the others after STOP_GRACE_S (at the
    timeout at once). Returns the first non-zero exit status, or 0."""
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    while [p.poll() for p in procs].count(None):  # every rank polled (any() would stop early)
        # The rank that failed first (the others' errors follow from it).
        failed = [(r, p.returncode) for r, p in enumerate(procs)
                  if p.returncode not in (None, 0)]
        late = deadline is not None and time.monotonic() > deadline
        if failed or late:
            status = failed[0][1] if failed else 124
            print(f"malleus.torch.run: " + (f"rank {failed[0][0]} exited with status {status}"
                                            if failed else f"still running after {timeout} s")
                  + "; stopping the other ranks", file=sys.stderr, flush=True)
            grace = time.monotonic() + (STOP_GRACE_S if failed else 0.0)
            while time.monotonic() < grace and [p.poll() for p in procs].count(None):
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.05)
    for p in procs:
        if status == 0 and p.returncode:
            status = p.returncode
    return status


def launch(argv: Sequence[str], nproc: int, cores: Optional[Sequence[int]] = None,
           env: Optional[dict] = None, timeout: Optional[float] = None) -> int:
    return wait(start(argv, nproc, cores, env), timeout)


def main(args=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m malleus.torch.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes (ranks)")
    parser.add_argument("--cores", default="",
                        help="comma-separated cores; rank r runs on the r-th (mod the list)")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(args)
    try:
        cores = [int(c) for c in a.cores.split(",")] if a.cores else None
    except ValueError:
        parser.error(f"--cores must be comma-separated core numbers, got {a.cores!r}")
    if a.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {a.nproc}")
    return launch([sys.executable, a.script] + a.args, a.nproc, cores)


if __name__ == "__main__":
    sys.exit(main())
