"""What the malleus.torch pipeline tests share: a small language model cut into blocks (an
embedding with a causal mixing of positions, LAYERS residual MLP blocks, a norm and head), the
malleus model config the planner splits it with, the loss, and a single-process reference run
on the whole global batch (the blocks run one after the other, no malleus code)."""

import torch
import torch.nn.functional as F

import malleus
import torch_common as tc

LAYERS = 6                       # planner layers; blocks: embedding, LAYERS layers, head
GLOBAL_BATCH, MICRO_BATCH = tc.GLOBAL_BATCH, tc.MICRO_BATCH   # 8 micro-batches of 2


class Embed(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.embed = torch.nn.Embedding(tc.VOCAB, width)

    def forward(self, tokens):
        x = self.embed(tokens)
        return torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1,
                                                     device=x.device).view(1, -1, 1)


class Layer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width),
                                       torch.nn.GELU(), torch.nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


class Head(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, tc.VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


def make_blocks(seed=0, width=tc.WIDTH, layers=LAYERS):
    torch.manual_seed(seed)
    return [Embed(width)] + [Layer(width) for _ in range(layers)] + [Head(width)]


def config(layers=LAYERS):
    """The malleus model config the planner splits the blocks with: demo's, with LAYERS layers."""
    return dict(malleus.model_config("demo"), num_layers=layers)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def loss_fn(logits, targets):
    """(loss summed over counted tokens, their number): the pipeline's loss_fn."""
    loss = F.cross_entropy(logits.reshape(-1, tc.VOCAB), targets.reshape(-1),
                           ignore_index=tc.IGNORE, reduction="sum")
    return loss, int((targets != tc.IGNORE).sum())


def reference_run(steps, device="cpu"):
    """One process, the whole global batch in one forward through the blocks in order, the mean
    over its counted tokens, on `device`: (losses, every block's state after every step, on the
    CPU)."""
    blocks = [b.to(device) for b in make_blocks()]
    opt = make_optimizer([p for b in blocks for p in b.parameters()])
    losses, states = [], []
    for inputs, targets in tc.batches(steps):
        opt.zero_grad()
        x = inputs.to(device)
        for b in blocks:
            x = b(x)
        loss = F.cross_entropy(x.reshape(-1, tc.VOCAB), targets.to(device).reshape(-1),
                               ignore_index=tc.IGNORE)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        states.append([{k: v.detach().cpu().clone() for k, v in b.state_dict().items()}
                       for b in blocks])
    return losses, states


def stage(layers, rank):
    return {"layers": list(layers), "ranks": [rank]}


def pipeline(micro_batches, *stages):
    return {"micro_batches": micro_batches, "stages": list(stages)}


def plan(world, *pipelines):
    return {"world_size": world, "micro_batch_size": MICRO_BATCH, "pipelines": list(pipelines)}


def cluster_holding(config, world, seq_len, layers, micro_batch=1, global_batch=16):
    """cpu-local with ``world`` devices on one node, each with memory for a first stage of
    ``layers`` layers (the planner's memory model, 2 % to spare) and no more: a model that
    needs pipelines, where the planner must keep enough stages."""
    c = malleus.cluster("cpu-local")
    c.update(devices_per_node=world, nodes=1)
    p = {"world_size": world, "micro_batch_size": micro_batch, "pipelines": [{
        "micro_batches": global_batch // micro_batch,
        "stages": [{"layers": [0, layers], "ranks": [0]},
                   {"layers": [layers, config["num_layers"]], "ranks": [1]}]}]}
    need = malleus.simulate(c, config, p, global_batch=global_batch, micro_batch=micro_batch,
                            seq_len=seq_len)["devices"][0]["memory_gib"]
    c["memory_gib"] = need * 1.02 / c["usable_memory_fraction"]
    return c


def planner_plans(world, slowdowns, seq_len=128):
    """The plans malleus's straggler loop switches to (the C++ planner's "malleus" strategy, one
    rank per stage, no recomputation: what PipelineParallel asks) from an even 2-pipeline plan
    when the ranks run ``slowdown`` times slower, one JSON plan per slowdown list: pipelines of
    unlike shape and micro-batch counts, idle ranks. Each rank's seconds are its FLOPs under the
    running plan at 1e11 FLOP/s times its slowdown; healthy for 3 steps, then slowed."""
    even = malleus.uniform_plan(config(), 2, 1, world // 2, GLOBAL_BATCH, MICRO_BATCH, world)
    plans = []
    for slow in slowdowns:
        loop = malleus.StragglerLoop(even, config(), seq_len=seq_len, recompute=False,
                                     distributed_optimizer=False, max_tp=1)
        for step in range(1, 7):
            rates = [1] * world if step <= 3 else slow
            d = loop.observe(step, [f * 1e-11 * r for f, r in zip(loop.work_flops, rates)],
                             remaining_steps=100)
            if d is not None and d.switched:
                plans.append(d.plan.to_dict())
                break
        else:
            raise AssertionError(f"the loop did not switch for slowdowns {slow}")
    return [even.to_dict()] + plans
