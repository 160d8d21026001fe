"""Trains malleus's demo LLaMA in PyTorch with malleus.torch's straggler-resilient data
parallelism, on the token shards `malleus train` reads (llm.c's format, src/data/shard.h).

    build/malleus prepare-data                 # data/fortunes/train_*.bin (once)
    build/malleus-python -m malleus.torch.run --nproc 2 examples/torch_llama.py --steps 20

The training loop is the one a DistributedDataParallel user writes (docs/python.md has the diff):
micro-batches with gradient accumulation, loss.backward(), clipping, optimizer.step().

Every rank prints nothing but rank 0 a step line in `malleus train`'s manner: loss, tokens/s,
step time, the plan (micro-batches per rank) and every rank's rate; and a line per re-plan.
"""

import argparse
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import malleus
import malleus.torch as mt

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256


def read_shard(path):
    """One llm.c token shard: 256 little-endian int32 (magic, version, count, ...), then uint16
    tokens."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < HEADER_INTS:
        raise ValueError(f"{path}: truncated header")
    if header[0] != SHARD_MAGIC:
        raise ValueError(f"{path}: not a token shard: bad magic {header[0]}")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: unsupported shard version {header[1]}")
    tokens = np.fromfile(path, dtype="<u2", offset=4 * HEADER_INTS)
    if len(tokens) != header[2]:
        raise ValueError(f"{path}: header says {header[2]} tokens but file holds {len(tokens)}")
    return tokens


# ---- the model: malleus's LLaMA-style decoder (model/config.h) in PyTorch ---------------------

class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    """Rotary embedding on [batch, heads, seq, head_dim], pairs (i, i + head_dim / 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.heads, self.kv = c["hidden_size"], c["num_heads"], c["num_kv_heads"]
        self.hd = h // self.heads
        self.attn_norm, self.mlp_norm = RMSNorm(h, c["norm_eps"]), RMSNorm(h, c["norm_eps"])
        self.q = torch.nn.Linear(h, h, bias=False)
        self.k = torch.nn.Linear(h, self.kv * self.hd, bias=False)
        self.v = torch.nn.Linear(h, self.kv * self.hd, bias=False)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Linear(h, c["ffn_hidden_size"], bias=False)
        self.up = torch.nn.Linear(h, c["ffn_hidden_size"], bias=False)
        self.down = torch.nn.Linear(c["ffn_hidden_size"], h, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, h = x.shape
        y = self.attn_norm(x)
        q = rope(self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2), cos, sin)
        k = rope(self.k(y).view(b, s, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        if self.kv != self.heads:  # grouped-query attention
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(y)
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c["num_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        std = c.get("init_std", 0.02)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual outputs scaled by 1/sqrt(2L), as malleus initialises them.
                scale = 1 / math.sqrt(2 * c["num_layers"]) if name.endswith(("o.weight",
                                                                            "down.weight")) else 1
                torch.nn.init.normal_(p, 0.0, std * scale)

    def forward(self, tokens):
        s, hd = tokens.shape[1], self.c["hidden_size"] // self.c["num_heads"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd // 2).float() / (hd // 2)))
        angles = torch.arange(s).float().view(-1, 1) * inv.view(1, -1)
        cos, sin = angles.cos(), angles.sin()
        mask = torch.full((s, s), float("-inf")).triu(1)
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, cos, sin, mask)
        return self.head(self.norm(x))


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
    rank = dist.get_rank()
    shards = sorted(glob.glob(os.path.join(a.data, "train_*.bin")))
    if not shards:
        raise SystemExit(f"{a.data}: no train_*.bin shards (run `build/malleus prepare-data`)")
    tokens = torch.from_numpy(np.concatenate([read_shard(s) for s in shards]).astype(np.int64))
    config = malleus.model_config(a.model)
    meta = os.path.join(a.data, "tokenizer_meta.json")
    if os.path.exists(meta):  # the model's vocabulary is the data's tokenizer's, as in malleus
        with open(meta) as f:
            config["vocab_size"] = json.load(f)["vocab_size"]
    if int(tokens.max()) >= config["vocab_size"]:
        raise SystemExit(f"{a.data}: token {int(tokens.max())} >= vocab_size "
                         f"{config['vocab_size']}")
    if a.seq_len + 1 > len(tokens):
        raise SystemExit(f"{a.data}: {len(tokens)} tokens, fewer than one sequence")

    torch.manual_seed(0)
    model = mt.DataParallel(Llama(config), global_batch=a.global_batch,
                            micro_batch=a.micro_batch, seq_len=a.seq_len, model_config=config,
                            total_steps=a.steps)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if rank == 0:
        n = sum(t.numel() for t in model.parameters())
        print(f"model {config['name']}: {n / 1e6:.2f}M parameters; data {a.data}: "
              f"{len(tokens)} tokens; global batch {a.global_batch} x {a.seq_len} tokens "
              f"(micro-batches of {a.micro_batch}) on {model.world_size} ranks", flush=True)

    sampler = torch.Generator().manual_seed(a.seed)  # the same global batch on every rank
    for _ in range(a.steps):
        starts = torch.randint(0, len(tokens) - a.seq_len - 1, (a.global_batch,),
                               generator=sampler)

        def windows(first, count, starts=starts):  # only this rank's sequences are cut
            return torch.stack([tokens[s:s + a.seq_len + 1] for s in starts[first:first + count]])
        plan_text = model.plan.summary
        t0 = time.perf_counter()
        for w in model.micro_batches(windows):  # this rank's micro-batches of the global batch
            logits = model(w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            loss.backward()
            model.note_loss(loss)  # for the step line: the loss over the global batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - t0
        r = model.last
        if rank == 0:
            rates = " ".join(f"{x:.1f}" for x in r.rates)
            print(f"step {r.step:5d}/{a.steps} | loss {r.loss:.4f} | lr {a.lr:.2e} | "
                  f"{a.global_batch * a.seq_len / took / 1e3:.1f}k tok/s | {took:.3f} s | "
                  f"{plan_text} | rates {rates}", flush=True)
            if r.decision:
                print(r.decision, flush=True)  # the trainer's log line of the decision
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
