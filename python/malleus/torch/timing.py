"""What malleus.torch's engines time for the straggler loop: a rank's compute alone (no
communication, no wait), and the fixed probe a rank without work runs instead (the C++ engine's:
``malleus.PROBE_REPEATS`` products of ``malleus.PROBE_SIZE`` square fp32 matrices, whose FLOPs the
loop counts for an idle rank), so that its recovery is seen."""

import time

import torch

import malleus

__all__ = ["ComputeTimer", "IdleProbe"]


class ComputeTimer:
    """Compute time in sections: ``with timer:`` around each one (``start()`` and ``stop()`` for
    a single one), ``total()`` for their sum. ``time.perf_counter`` around synchronous CPU work;
    on a GPU a ``torch.cuda.Event`` pair on ``device``'s current stream per section, read once,
    in ``total()``, so that sections do not wait for the device (the device the module computes
    on, whatever the process group's backend: gloo reduces CUDA tensors too, and two processes
    sharing one GPU must use it)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._seconds, self._events, self._t0 = 0.0, [], 0.0

    def __enter__(self):
        if self.cuda:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pair[0].record(torch.cuda.current_stream(self.device))
            self._events.append(pair)
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._events[-1][1].record(torch.cuda.current_stream(self.device))
        else:
            self._seconds += time.perf_counter() - self._t0

    def total(self) -> float:
        """Seconds in the sections so far (on a GPU, once the device has finished them)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
            self._events = []
        return self._seconds

    def start(self):
        self.__enter__()

    def stop(self) -> float:
        """Ends the section ``start()`` began; the seconds of every section so far."""
        self.__exit__(None, None, None)
        return self.total()


class IdleProbe:
    """The idle rank's probe on ``device``: ``run()`` does ``malleus.PROBE_FLOPS`` of work."""

    def __init__(self, device: torch.device):
        g = torch.Generator().manual_seed(0)
        a = torch.rand(malleus.PROBE_SIZE, malleus.PROBE_SIZE, generator=g).to(device)
        self._a, self._b, self._c = a, a.clone(), torch.empty_like(a)

    def run(self):
        for _ in range(malleus.PROBE_REPEATS):
            torch.mm(self._a, self._b, out=self._c)
