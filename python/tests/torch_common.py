"""What the malleus.torch tests share: a small decoder-ish language model, its data, the loss
(summed over counted tokens, with some targets ignored so that micro-batches count different
numbers of tokens), and a single-process reference run on the whole global batch."""

import os
import sys

import torch
import torch.nn.functional as F

VOCAB, SEQ, WIDTH = 37, 12, 32
GLOBAL_BATCH, MICRO_BATCH = 16, 2          # 8 micro-batches of 2 sequences
IGNORE = -100


class TinyLM(torch.nn.Module):
    def __init__(self, width=WIDTH, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                torch.nn.GELU(), torch.nn.Linear(2 * width, width))
            for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        # A causal mixing of positions, so that a sequence is more than independent tokens.
        x = torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def make_model(seed=0, width=WIDTH, layers=2):
    torch.manual_seed(seed)
    return TinyLM(width, layers)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches(steps, seed=1):
    """Per step (inputs, targets) of the global batch; about a fifth of the targets ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        targets = tokens[:, 1:].clone()
        targets[torch.rand(targets.shape, generator=g) < 0.2] = IGNORE
        out.append((tokens[:, :-1].contiguous(), targets))
    return out


def loss_sum(model, samples):
    """(loss summed over counted tokens, their number): malleus.torch's loss_fn."""
    inputs, targets = samples
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    return loss, int((targets != IGNORE).sum())


def counted_tokens(samples):
    """The loss units of a micro-batch: its targets that are not ignored (DataParallel's units)."""
    return int((samples[1] != IGNORE).sum())


def mean_loss(model, samples):
    """The loss as a DistributedDataParallel loop computes it: the mean over the micro-batch's
    counted tokens."""
    inputs, targets = samples
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1),
                           ignore_index=IGNORE)


# Global-norm clipping in the tests: below the gradients' norms (0.38 to 0.41 in the reference
# run's 4 steps), so that every step clips.
CLIP = 0.25


def reference_run(steps, clip=None):
    """One process, the whole global batch in one forward, the mean over its counted tokens:
    (losses, final parameters, gradient norms before clipping by `clip` when given)."""
    model = make_model()
    opt = make_optimizer(model)
    losses, norms = [], []
    for inputs, targets in batches(steps):
        opt.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                               ignore_index=IGNORE)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()], norms


def exit_without_finalizing(status=0):
    """Ends a worker process once its results are written, without Python's finalization.

    With torch 1.13 over gloo, a worker thread (ProcessGroupGloo::runLoop) can still be releasing
    a finished collective's tensors when the interpreter finalizes; a tensor that needs the GIL
    then ends that thread, and the C++ frames it unwinds through call std::terminate ("terminate
    called without an active exception", SIGABRT). Seen in this suite about once in 15 runs,
    reproduced under load (1 in about 30 runs of the 2-process ZeRO loop beside two busy cores),
    core dump: runLoop -> ~TensorImpl -> PyEval_AcquireThread -> pthread_exit -> terminate.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# The straggler tests' premise: only the test's busy processes load a rank. This 2-vCPU machine's
# cores are not always equal (an unloaded rank read 1.2-1.5 in some runs, and a core slowed for a
# step or two before any busy process: a switch the controller rightly made, and then a hold,
# that the test would read as its own failure). A run in which the unloaded rank read slower
# than QUIET, or either rank did before the busy processes began, proves nothing either way: it
# is made again, up to TRIALS runs; a quiet run that fails the checks fails the test, and no
# quiet run skips it, with the rates seen.
QUIET = 1.3   # a rate no unloaded rank should read
TRIALS = 3


def quiet(log, unloaded, busy_from):
    """Whether nothing but the test's busy processes loaded the ranks (log: step -> entry)."""
    return all(log[s]["rates"][unloaded] <= QUIET for s in log) and \
        all(max(log[s]["rates"]) <= QUIET for s in range(1, busy_from))


def straggler_run(worker, steps, busy_from, busy_to, cores, timeout):
    """`worker straggler OUT STEPS BUSY_FROM BUSY_TO CORE` (a worker of this folder) on 2 ranks
    pinned to `cores`, busy processes on the second: (exit status, step -> its log entry, or
    None where it failed)."""
    import json
    import tempfile
    from malleus.torch import run
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "log.json")
        status = run.launch([sys.executable, os.path.join(os.path.dirname(os.path.abspath(
            __file__)), worker), "straggler", out, str(steps), str(busy_from), str(busy_to),
            str(cores[1])], 2, cores=cores, timeout=timeout)
        if status != 0:
            return status, None
        with open(out) as f:
            return status, {e["step"]: e for e in json.load(f)}


def check_a_quiet_run(test, run_once, unloaded, busy_from):
    """Runs run_once() (-> (status, log), as straggler_run) until a quiet run, and
    test.check(log) on it."""
    seen = []
    for _ in range(TRIALS):
        status, log = run_once()
        test.assertEqual(status, 0)
        if quiet(log, unloaded, busy_from):
            return test.check(log)
        seen.append([log[s]["rates"] for s in sorted(log)])
        print(f"not a quiet run (rates over {QUIET} on an unloaded rank): made again",
              file=sys.stderr)
    test.skipTest(f"no quiet run in {TRIALS}; rates per step: {seen}")
