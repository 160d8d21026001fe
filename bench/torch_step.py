#!/usr/bin/env python3
"""The training step of a malleus model config in plain PyTorch, timed the way
bench_step_throughput times malleus's (docs/performance.md: the GPU step against PyTorch).

The same LLaMA (RMSNorm, RoPE in the Hugging Face "rotate_half" convention, grouped-query causal
attention, SwiGLU MLP, untied LM head) with fp32 parameters, run under bf16 autocast with
torch.nn.functional.scaled_dot_product_attention (FlashAttention where torch has it), AdamW
(fused where torch has it) and global-norm clipping. One step = --accum micro-batches of --micro
sequences (forward, backward), the clip, the update; medians over --repeats steps after
--warmup steps, each ended by a device synchronisation. MFU counts the FLOPs as malleus does
(plan::shard_training_flops): 6 x matmul parameters x tokens plus causal attention, over
--peak-tflops.

    python3 bench/torch_step.py bench/models/llama-1b.json --micro 2 --accum 2

Prints one line a user can read and one JSON line (prefix "json:") for scripts.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a malleus model config (JSON)")
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--seq-len", type=int, default=0, help="default: the config's max_seq_len")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peak-tflops", type=float, default=989.4,
                   help="dense bf16 peak (H100 SXM datasheet; the H200's is the same)")
    a = p.parse_args()
    for name in ("micro", "accum", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    return a


class RMSNorm(torch.nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(q, k, v, groups):
    if hasattr(F, "scaled_dot_product_attention"):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        except TypeError:  # torch before 2.5: no enable_gqa
            pass
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if groups > 1:  # torch 1.13 (CPU smoke runs only)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(mask, float("-inf")).softmax(-1) @ v


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, f = c["hidden_size"], c["ffn_hidden_size"]
        self.heads, self.kv_heads = c["num_heads"], c.get("num_kv_heads", c["num_heads"])
        self.d = h // self.heads
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.attn_norm, self.mlp_norm = RMSNorm(h, c["eps"]), RMSNorm(h, c["eps"])
        self.q, self.k = lin(h, self.heads * self.d), lin(h, self.kv_heads * self.d)
        self.v, self.o = lin(h, self.kv_heads * self.d), lin(self.heads * self.d, h)
        self.gate, self.up, self.down = lin(h, f), lin(h, f), lin(f, h)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.k(y).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        v = self.v(y).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        a = attention(rotate(q, cos, sin), rotate(k, cos, sin), v, self.heads // self.kv_heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, self.heads * self.d))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(torch.nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        h = c["hidden_size"]
        self.embed = torch.nn.Embedding(c["vocab_size"], h)
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c["num_layers"]))
        self.norm = RMSNorm(h, c["eps"])
        self.head = torch.nn.Linear(h, c["vocab_size"], bias=False)
        d = h // c["num_heads"]
        inv = c["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def model_flops(c, tokens, seq):
    """6 x matmul parameters x tokens plus causal attention: malleus's MFU accounting."""
    h, f, v = c["hidden_size"], c["ffn_hidden_size"], c["vocab_size"]
    d = h // c["num_heads"]
    q, kv = c["num_heads"] * d, c.get("num_kv_heads", c["num_heads"]) * d
    layer = tokens * (2 * (h * q + 2 * h * kv + q * h) + 2 * h * seq + 2 * 3 * h * f)
    head = tokens * 2 * v * h
    return 3 * (c["num_layers"] * layer + head)


def main():
    a = parse()
    with open(a.model) as f:
        c = json.load(f)
    c.setdefault("eps", c.get("norm_eps", 1e-5))
    c.setdefault("rope_theta", 10000.0)
    seq = a.seq_len or c["max_seq_len"]
    device = torch.device(a.device)
    torch.manual_seed(1)
    model = Llama(c, seq).to(device)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1, fused=device.type == "cuda")
        fused = device.type == "cuda"
    except (TypeError, RuntimeError):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1)
        fused = False
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, c["vocab_size"], (a.accum, a.micro, seq + 1), generator=g)
    tokens = tokens.to(device)
    dtype = torch.bfloat16

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        optimizer.zero_grad(set_to_none=True)
        for m in range(a.accum):
            with torch.autocast(device_type=device.type, dtype=dtype):
                logits = model(tokens[m, :, :-1])
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                   tokens[m, :, 1:].reshape(-1)) / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sync()

    for _ in range(a.warmup):
        step()
    seconds = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    s = statistics.median(seconds)
    step_tokens = a.accum * a.micro * seq
    tflops = model_flops(c, step_tokens, seq) / s / 1e12
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}: {c.get('name', a.model)} ({params} parameters), "
          f"step = {a.accum} x {a.micro} sequences of {seq}, bf16 autocast, SDPA, "
          f"AdamW{' (fused)' if fused else ''}: {s:.3f} s/step [{min(seconds):.3f}-"
          f"{max(seconds):.3f}], {step_tokens / s:.0f} tokens/s, {tflops:.1f} TFLOP/s, "
          f"MFU {100 * tflops / a.peak_tflops:.1f} %")
    print("json: " + json.dumps({"torch": torch.__version__, "device": name, "step_s": s,
                                 "tokens_per_s": step_tokens / s, "tflops": tflops,
                                 "mfu": tflops / a.peak_tflops, "fused_adamw": fused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
