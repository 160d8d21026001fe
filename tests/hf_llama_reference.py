#!/usr/bin/python3
"""Independent NumPy reference for Hugging Face's LlamaForCausalLM: forward pass and loss.

Reads <model_dir>/config.json (LlamaConfig fields) and <model_dir>/model.safetensors (parsed by
hand: 8-byte little-endian header length, JSON header, raw data) and computes, in float64, the mean
next-token cross-entropy that `LlamaForCausalLM(input_ids, labels=input_ids).loss` gives, following
transformers' modeling_llama.py:

  x = embed_tokens[ids]
  per layer:  x = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))
              with n = RMSNorm(x) (input_layernorm)
              x = x + down_proj(silu(gate_proj(n)) * up_proj(n))
              with n = RMSNorm(x) (post_attention_layernorm)
  logits = lm_head(RMSNorm(x)) (model.norm)

  RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
  rope: inv_freq = 1 / theta^(arange(0, d, 2) / d); emb = cat(freqs, freqs);
        q * cos(emb) + rotate_half(q) * sin(emb), rotate_half(x) = cat(-x[d/2:], x[:d/2])
  attention: key/value head j serves query heads j*rep .. j*rep+rep-1 (repeat_kv), causal
        softmax(q k^T / sqrt(head_dim)) v

It shares no code with malleus, so a loss that agrees with it checks our model, export layout and
tensor orientation against Hugging Face semantics without needing torch.

Usage:
  hf_llama_reference.py MODEL_DIR TOKENS_FILE   prints the mean loss
  hf_llama_reference.py --selftest              checks this script on random tiny models

TOKENS_FILE holds whitespace-separated token ids; each non-empty line is one sequence (inputs are
tokens[:-1], targets tokens[1:]); the loss is the mean over the targets of all sequences.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

# ---------------------------------------------------------------------------------------------
# safetensors

_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def read_safetensors(path):
    """Returns {name: float64 array} for the tensors of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file ({len(blob)} bytes)")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise ValueError(f"{path}: header length {header_len} is beyond the end of the file")
    header = json.loads(blob[8 : 8 + header_len].decode("utf-8"))
    data = memoryview(blob)[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name}: data_offsets out of range")
        raw = data[begin:end]
        if dtype == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _NUMPY_DTYPES:
            values = np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype])
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if values.size != math.prod(shape):
            raise ValueError(f"{path}: tensor {name}: shape {shape} does not match its data")
        tensors[name] = values.reshape(shape).astype(np.float64)
    return tensors


def write_safetensors(path, tensors):
    """Writes {name: array} as F32 (used by the self-test only)."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for chunk in chunks:
            f.write(chunk)


# ---------------------------------------------------------------------------------------------
# model


class LlamaConfig:
    """The LlamaConfig fields the forward pass uses, with transformers' defaults where it has them."""

    def __init__(self, d):
        self.vocab_size = int(d["vocab_size"])
        self.hidden_size = int(d["hidden_size"])
        self.intermediate_size = int(d["intermediate_size"])
        self.num_hidden_layers = int(d["num_hidden_layers"])
        self.num_attention_heads = int(d["num_attention_heads"])
        kv = d.get("num_key_value_heads")
        self.num_key_value_heads = int(kv) if kv is not None else self.num_attention_heads
        head_dim = d.get("head_dim")
        self.head_dim = (
            int(head_dim) if head_dim is not None else self.hidden_size // self.num_attention_heads
        )
        self.rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        self.rope_theta = float(d.get("rope_theta", 10000.0))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        self.attention_bias = bool(d.get("attention_bias", False))
        self.mlp_bias = bool(d.get("mlp_bias", False))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        if d.get("rope_scaling") is not None:
            raise ValueError("rope_scaling is not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")


def rms_norm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def rotary_cos_sin(seq_len, head_dim, theta):
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x, cos, sin):
    """x: (heads, seq, head_dim); cos, sin: (seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


def silu(x):
    # sigmoid(x) = (1 + tanh(x / 2)) / 2, which cannot overflow the way 1 / (1 + exp(-x)) can
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))


def linear(x, weights, name):
    y = x @ weights[name + ".weight"].T
    bias = weights.get(name + ".bias")
    return y if bias is None else y + bias


def attention(x, weights, prefix, cfg, cos, sin):
    seq = x.shape[0]
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = linear(x, weights, prefix + "q_proj").reshape(seq, heads, hd).transpose(1, 0, 2)
    k = linear(x, weights, prefix + "k_proj").reshape(seq, kv_heads, hd).transpose(1, 0, 2)
    v = linear(x, weights, prefix + "v_proj").reshape(seq, kv_heads, hd).transpose(1, 0, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # repeat_kv: each kv head is repeated consecutively, [k0, k0, k1, k1], not tiled.
    rep = heads // kv_heads
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    scores = (q @ k.transpose(0, 2, 1)) * hd**-0.5
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    scores = np.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(seq, heads * hd)
    return linear(out, weights, prefix + "o_proj")


def forward(weights, cfg, ids):
    """Logits (seq, vocab) for one sequence of token ids."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("expected a non-empty sequence of token ids")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    x = weights["model.embed_tokens.weight"][ids]
    cos, sin = rotary_cos_sin(ids.size, cfg.head_dim, cfg.rope_theta)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        x = x + attention(h, weights, p + "self_attn.", cfg, cos, sin)
        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = linear(h, weights, p + "mlp.gate_proj")
        up = linear(h, weights, p + "mlp.up_proj")
        x = x + linear(silu(gate) * up, weights, p + "mlp.down_proj")
    x = rms_norm(x, weights["model.norm.weight"], cfg.rms_norm_eps)
    head = weights.get("lm_head.weight")
    if head is None:
        if not cfg.tie_word_embeddings:
            raise ValueError("lm_head.weight is missing and tie_word_embeddings is false")
        head = weights["model.embed_tokens.weight"]
    return x @ head.T


def token_losses(logits, targets):
    """Cross-entropy of each position (natural log)."""
    m = logits.max(axis=-1, keepdims=True)
    log_z = m[:, 0] + np.log(np.exp(logits - m).sum(axis=-1))
    return log_z - logits[np.arange(len(targets)), targets]


def mean_loss(weights, cfg, sequences):
    total, count = 0.0, 0
    for tokens in sequences:
        if len(tokens) < 2:
            raise ValueError("every sequence needs at least two tokens")
        losses = token_losses(forward(weights, cfg, tokens[:-1]), np.asarray(tokens[1:]))
        total += float(losses.sum())
        count += losses.size
    return total / count


def load_model(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = LlamaConfig(json.load(f))
    weights = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    return weights, cfg


def read_tokens(path):
    with open(path) as f:
        sequences = [[int(t) for t in line.split()] for line in f if line.strip()]
    if not sequences:
        raise ValueError(f"{path}: no tokens")
    return sequences


# ---------------------------------------------------------------------------------------------
# self-test


def _random_model(rng, cfg_dict, scale=0.3):
    cfg = LlamaConfig(cfg_dict)
    c, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def mat(*shape):
        return rng.normal(0.0, scale, size=shape)

    def gain(n):
        return 1.0 + 0.2 * rng.normal(size=n)

    w = {"model.embed_tokens.weight": mat(v, c)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = gain(c)
        w[p + "self_attn.q_proj.weight"] = mat(q, c)
        w[p + "self_attn.k_proj.weight"] = mat(kv, c)
        w[p + "self_attn.v_proj.weight"] = mat(kv, c)
        w[p + "self_attn.o_proj.weight"] = mat(c, q)
        w[p + "post_attention_layernorm.weight"] = gain(c)
        w[p + "mlp.gate_proj.weight"] = mat(f, c)
        w[p + "mlp.up_proj.weight"] = mat(f, c)
        w[p + "mlp.down_proj.weight"] = mat(c, f)
    w["model.norm.weight"] = gain(c)
    w["lm_head.weight"] = mat(v, c)
    return w, cfg


def _rope_pairwise(x, position, theta):
    """Rotary embedding of one vector written as explicit 2-D rotations of the pairs (i, i + d/2)."""
    d = x.shape[-1]
    y = np.empty_like(x)
    for i in range(d // 2):
        angle = position * theta ** (-2.0 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        y[i] = x[i] * c - x[i + d // 2] * s
        y[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return y


def _forward_naive(weights, cfg, ids):
    """The same model written position by position and head by head, with explicit loops."""
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    rep = cfg.num_attention_heads // cfg.num_key_value_heads

    def norm(vec, w):
        return w * vec / math.sqrt(sum(t * t for t in vec) / len(vec) + eps)

    xs = [weights["model.embed_tokens.weight"][t].copy() for t in ids]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        hs = [norm(x, weights[p + "input_layernorm.weight"]) for x in xs]
        qs = [weights[a + "q_proj.weight"] @ h for h in hs]
        ks = [weights[a + "k_proj.weight"] @ h for h in hs]
        vs = [weights[a + "v_proj.weight"] @ h for h in hs]
        new_xs = []
        for t in range(len(ids)):
            heads_out = []
            for head in range(cfg.num_attention_heads):
                g = head // rep
                qh = _rope_pairwise(qs[t][head * hd : (head + 1) * hd], t, cfg.rope_theta)
                scores = []
                for s in range(t + 1):
                    kh = _rope_pairwise(ks[s][g * hd : (g + 1) * hd], s, cfg.rope_theta)
                    scores.append(float(qh @ kh) / math.sqrt(hd))
                top = max(scores)
                e = [math.exp(sc - top) for sc in scores]
                z = sum(e)
                out = sum(e[s] / z * vs[s][g * hd : (g + 1) * hd] for s in range(t + 1))
                heads_out.append(out)
            new_xs.append(xs[t] + weights[a + "o_proj.weight"] @ np.concatenate(heads_out))
        xs = new_xs
        for t in range(len(ids)):
            h = norm(xs[t], weights[p + "post_attention_layernorm.weight"])
            gate = weights[p + "mlp.gate_proj.weight"] @ h
            up = weights[p + "mlp.up_proj.weight"] @ h
            act = np.array([gi / (1.0 + math.exp(-gi)) for gi in gate]) * up
            xs[t] = xs[t] + weights[p + "mlp.down_proj.weight"] @ act
    return np.array([weights["lm_head.weight"] @ norm(x, weights["model.norm.weight"]) for x in xs])


def _check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"  ok: {what}")


def selftest():
    rng = np.random.default_rng(1234)
    cfg_dict = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 13,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    weights, cfg = _random_model(rng, cfg_dict)
    ids = rng.integers(0, cfg.vocab_size, size=7)

    # RMSNorm
    x = rng.normal(size=(5, 16)) * 3.0
    y = rms_norm(x, np.ones(16), 0.0)
    _check(np.allclose(np.sqrt(np.mean(y * y, axis=-1)), 1.0), "rmsnorm output has unit RMS")
    _check(np.allclose(rms_norm(7.5 * x, np.ones(16), 0.0), y), "rmsnorm is scale invariant")
    w = rng.normal(size=16)
    expected = x[0] * w / math.sqrt(float(np.mean(x[0] ** 2)) + 0.25)
    _check(np.allclose(rms_norm(x, w, 0.25)[0], expected), "rmsnorm applies eps and gain")

    # Rotary embedding
    d, theta = 8, 100.0
    cos, sin = rotary_cos_sin(6, d, theta)
    v = rng.normal(size=(1, 6, d))
    roped = apply_rotary(v, cos, sin)
    _check(np.allclose(roped[0, 0], v[0, 0]), "rope leaves position 0 unchanged")
    _check(
        all(np.allclose(roped[0, t], _rope_pairwise(v[0, t], t, theta)) for t in range(6)),
        "rope rotates the pairs (i, i + d/2) by position * theta^(-2i/d) (rotate_half convention)",
    )
    _check(
        np.allclose(np.linalg.norm(roped, axis=-1), np.linalg.norm(v, axis=-1)),
        "rope preserves norms",
    )
    cos9, sin9 = rotary_cos_sin(9, d, theta)
    qv, kv = rng.normal(size=d), rng.normal(size=d)

    def rope_at(vec, pos):
        return apply_rotary(vec[None, None, :], cos9[pos : pos + 1], sin9[pos : pos + 1])[0, 0]

    _check(
        np.isclose(rope_at(qv, 5) @ rope_at(kv, 2), rope_at(qv, 8) @ rope_at(kv, 5)),
        "rope scores depend only on relative position",
    )

    # Whole model against the loop-by-loop version
    logits = forward(weights, cfg, ids)
    naive = _forward_naive(weights, cfg, ids)
    _check(np.allclose(logits, naive, rtol=1e-10, atol=1e-10), "forward matches the naive loops")

    # Causality
    changed = ids.copy()
    changed[4] = (changed[4] + 1) % cfg.vocab_size
    logits2 = forward(weights, cfg, changed)
    _check(np.array_equal(logits[:4], logits2[:4]), "positions before a change are unaffected")
    _check(not np.allclose(logits[4:], logits2[4:]), "positions from a change on are affected")
    prefix = forward(weights, cfg, ids[:3])
    _check(np.allclose(prefix, logits[:3], rtol=1e-12, atol=1e-12), "a prefix gives the same logits")

    # Grouped-query attention equals multi-head attention with each kv head copied to its group
    mha_dict = dict(cfg_dict, num_key_value_heads=cfg_dict["num_attention_heads"])
    mha_cfg = LlamaConfig(mha_dict)
    mha = dict(weights)
    hd, rep = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in range(cfg.num_hidden_layers):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            blocks = [weights[key][(h // rep) * hd : (h // rep + 1) * hd] for h in range(4)]
            mha[key] = np.concatenate(blocks)
    _check(
        np.allclose(forward(mha, mha_cfg, ids), logits, rtol=1e-12, atol=1e-12),
        "GQA: query head h uses kv head h // (heads / kv_heads)",
    )

    # Loss
    targets = rng.integers(0, cfg.vocab_size, size=ids.size)
    log_probs = naive - np.log(np.exp(naive).sum(axis=-1, keepdims=True))
    expected = -np.mean(log_probs[np.arange(ids.size), targets])
    _check(np.isclose(token_losses(logits, targets).mean(), expected), "cross-entropy")
    uniform = dict(weights, **{"lm_head.weight": np.zeros_like(weights["lm_head.weight"])})
    _check(
        np.isclose(mean_loss(uniform, cfg, [list(ids)]), math.log(cfg.vocab_size)),
        "zero lm_head gives loss log(vocab_size)",
    )
    tied_cfg = LlamaConfig(dict(cfg_dict, tie_word_embeddings=True))
    tied = {k: val for k, val in weights.items() if k != "lm_head.weight"}
    tied_head = dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"]})
    _check(
        np.allclose(forward(tied, tied_cfg, ids), forward(tied_head, cfg, ids)),
        "tied embeddings serve as lm_head",
    )

    # Files and command line, with float32 weights as a safetensors file holds them
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg_dict, f)
        write_safetensors(os.path.join(tmp, "model.safetensors"), weights)
        loaded, loaded_cfg = load_model(tmp)
        _check(
            set(loaded) == set(weights)
            and all(np.array_equal(loaded[k], weights[k].astype(np.float32)) for k in weights),
            "safetensors round trip",
        )
        sequences = [list(map(int, ids)), [1, 2, 3]]
        with open(os.path.join(tmp, "tokens.txt"), "w") as f:
            f.write("\n".join(" ".join(map(str, s)) for s in sequences) + "\n")
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__), tmp, os.path.join(tmp, "tokens.txt")],
            check=True,
            capture_output=True,
            text=True,
        )
        printed = float(result.stdout.strip())
        per_token = np.concatenate(
            [token_losses(forward(loaded, loaded_cfg, s[:-1]), np.array(s[1:])) for s in sequences]
        )
        per_sequence = np.mean([per_token[:6].mean(), per_token[6:].mean()])
        _check(
            math.isclose(printed, float(per_token.mean()), rel_tol=1e-12)
            and not math.isclose(printed, float(per_sequence), rel_tol=1e-6),
            "command line prints the mean over all tokens of all sequences",
        )
    print("selftest passed")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("tokens_file", nargs="?")
    parser.add_argument("--selftest", action="store_true", help="check this script and exit")
    args = parser.parse_args(argv)
    if args.selftest:
        selftest()
        return 0
    if args.model_dir is None or args.tokens_file is None:
        parser.error("MODEL_DIR and TOKENS_FILE are required")
    try:
        weights, cfg = load_model(args.model_dir)
        loss = mean_loss(weights, cfg, read_tokens(args.tokens_file))
    except (OSError, ValueError, KeyError) as e:
        print(f"hf_llama_reference.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(repr(loss))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
