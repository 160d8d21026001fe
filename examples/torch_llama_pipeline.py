"""Trains malleus's demo LLaMA in PyTorch with malleus.torch's pipelines that re-partition
themselves, on the token shards `malleus train` reads: the model of examples/torch_llama.py,
handed over as blocks (embedding, one block per transformer layer, norm and head).

    build/malleus prepare-data                 # data/fortunes/train_*.bin (once)
    PYTHONPATH=build/python /usr/bin/python3 -m malleus.torch.run --nproc 2 --cores 0,1 \\
        examples/torch_llama_pipeline.py --steps 20

It starts from one pipeline over every rank with the layers split evenly; rank 0 prints a step
line in `malleus train`'s manner (loss, tokens/s, step time, the plan, every rank's rate) and a
line for each re-plan, with the time its blocks took to move.
"""

import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import malleus
import malleus.torch as mt
from torch_llama import Llama, read_shard


class Embedding(torch.nn.Module):
    """Block 0: token ids [batch, seq] -> hidden states [batch, seq, hidden]."""

    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, tokens):
        return self.embed(tokens)


class Layer(torch.nn.Module):
    """One transformer layer as a block: it takes the hidden states alone and makes its rotary
    tables and causal mask itself (they depend only on the sequence length)."""

    def __init__(self, block, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, x):
        s, hd = x.shape[1], self.config["hidden_size"] // self.config["num_heads"]
        inv = 1.0 / (self.config["rope_theta"] ** (torch.arange(0, hd // 2).float() / (hd // 2)))
        angles = torch.arange(s).float().view(-1, 1) * inv.view(1, -1)
        mask = torch.full((s, s), float("-inf")).triu(1)
        return self.block(x, angles.cos(), angles.sin(), mask)


class NormHead(torch.nn.Module):
    """The last block: final norm and LM head -> logits."""

    def __init__(self, norm, head):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x):
        return self.head(self.norm(x))


def llama_blocks(config):
    """The LLaMA of examples/torch_llama.py (its initialisation) cut into num_layers + 2 blocks."""
    model = Llama(config)
    return ([Embedding(model.embed)] + [Layer(b, config) for b in model.blocks]
            + [NormHead(model.norm, model.head)])


def loss_fn(logits, targets):
    """On the last block's output: (loss summed over the tokens, their number)."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
    return loss, targets.numel()


def load_tokens(data, config, seq_len):
    shards = sorted(glob.glob(os.path.join(data, "train_*.bin")))
    if not shards:
        raise SystemExit(f"{data}: no train_*.bin shards (run `build/malleus prepare-data`)")
    tokens = torch.from_numpy(np.concatenate([read_shard(s) for s in shards]).astype(np.int64))
    meta = os.path.join(data, "tokenizer_meta.json")
    if os.path.exists(meta):  # the model's vocabulary is the data's tokenizer's, as in malleus
        with open(meta) as f:
            config["vocab_size"] = json.load(f)["vocab_size"]
    if int(tokens.max()) >= config["vocab_size"]:
        raise SystemExit(f"{data}: token {int(tokens.max())} >= vocab_size "
                         f"{config['vocab_size']}")
    if seq_len + 1 > len(tokens):
        raise SystemExit(f"{data}: {len(tokens)} tokens, fewer than one sequence")
    return tokens


def report(r, a, took):
    rates = " ".join(f"{x:.1f}" for x in r.rates)
    print(f"step {r.step:5d}/{a.steps} | loss {r.loss:.4f} | {r.units / took / 1e3:.1f}k tok/s | "
          f"{took:.3f} s | {r.plan} | rates {rates}", flush=True)
    if r.decision is not None:  # the straggler loop's record, as `malleus train` logs it
        moved = f" | blocks moved in {r.migrate_s:.3f} s" if r.switched else ""
        print(f"{r.decision}{moved}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/fortunes", help="directory of train_*.bin shards")
    p.add_argument("--model", default="demo", help="malleus model preset or JSON file")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    mt.init_from_env()
    config = malleus.model_config(a.model)
    tokens = load_tokens(a.data, config, a.seq_len)
    torch.manual_seed(0)
    blocks = llama_blocks(config)
    pp = mt.PipelineParallel(
        blocks, lambda params: torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95),
                                                 weight_decay=0.1),
        loss_fn, global_batch=a.global_batch, micro_batch=a.micro_batch, seq_len=a.seq_len,
        model_config=config, total_steps=a.steps)
    if pp.rank == 0:
        n = sum(s.numel() for shapes in pp.blocks.shapes for s in shapes)
        print(f"model {config['name']}: {n / 1e6:.2f}M parameters in {len(blocks)} blocks; "
              f"data {a.data}: {len(tokens)} tokens; global batch {a.global_batch} x "
              f"{a.seq_len} tokens (micro-batches of {a.micro_batch}) on {pp.world_size} ranks",
              flush=True)

    sampler = torch.Generator().manual_seed(a.seed)  # the same global batch on every rank
    for _ in range(a.steps):
        starts = torch.randint(0, len(tokens) - a.seq_len - 1, (a.global_batch,),
                               generator=sampler)

        def windows(first, count, starts=starts):  # only the samples a stage needs are cut
            w = torch.stack([tokens[s:s + a.seq_len + 1] for s in starts[first:first + count]])
            return w[:, :-1], w[:, 1:]
        t0 = time.perf_counter()
        r = pp.step(windows)
        if pp.rank == 0:
            report(r, a, time.perf_counter() - t0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
