"""What malleus.torch's engines time for the straggler loop: a rank's compute alone (no
communication, no wait), and the fixed probe a rank without work runs instead (the C++ engine's:
``malleus.PROBE_REPEATS`` products of ``malleus.PROBE_SIZE`` square fp32 matrices, whose FLOPs the
loop counts for an idle rank), so that its recovery is seen."""

import time

import torch

import malleus

__all__ = ["ComputeTimer", "IdleProbe"]


class ComputeTimer:
    """Elapsed compute between ``start()`` and ``stop()``: ``time.perf_counter`` around
    synchronous CPU work, ``torch.cuda.Event`` pairs on ``device``'s current stream on a GPU
    (the device the module computes on, whatever the process group's backend: gloo reduces CUDA
    tensors too, and two processes sharing one GPU must use it)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._begin = self._end = None
        self._t0 = 0.0

    def start(self):
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._begin.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start()``."""
        if self.cuda:
            self._end.record(torch.cuda.current_stream(self.device))
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1000.0
        return time.perf_counter() - self._t0


class IdleProbe:
    """The idle rank's probe on ``device``: ``run()`` does ``malleus.PROBE_FLOPS`` of work."""

    def __init__(self, device: torch.device):
        g = torch.Generator().manual_seed(0)
        a = torch.rand(malleus.PROBE_SIZE, malleus.PROBE_SIZE, generator=g).to(device)
        self._a, self._b, self._c = a, a.clone(), torch.empty_like(a)

    def run(self):
        for _ in range(malleus.PROBE_REPEATS):
            torch.mm(self._a, self._b, out=self._c)
