// The small model configs that tests build by hand (the presets come from configs/models): each
// named for what it is shaped to exercise, in one place rather than spelt out by every test file.
#pragma once

#include "model/config.h"

namespace malleus::testing {

// Small, but with room for uneven parallel shares: 8 heads in 4 KV groups, 4 layers.
inline model::ModelConfig parallel_test_model() {
  model::ModelConfig c;
  c.name = "parallel-test";
  c.vocab_size = 257;
  c.hidden_size = 32;
  c.num_layers = 4;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.ffn_hidden_size = 48;
  c.max_seq_len = 16;
  c.init_std = 0.1f;
  return c;
}

// Gradient checks: grouped KV heads, and an init large enough that every path carries gradient.
inline model::ModelConfig gradcheck_model() {
  model::ModelConfig c;
  c.name = "gradcheck";
  c.vocab_size = 13;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 24;
  c.max_seq_len = 8;
  c.init_std = 0.3f;
  return c;
}

// Generation: grouped KV heads, a context longer than the attention kernel's 64-row blocks, and
// logits far from uniform, so that greedy choices are clear-cut.
inline model::ModelConfig generation_model() {
  model::ModelConfig c;
  c.name = "generation-test";
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 48;
  c.max_seq_len = 96;
  c.init_std = 0.5f;
  return c;
}

// Layouts: tiny, with sizes that shard unevenly (11 vocabulary rows, 6 FFN columns, 4 heads in 2
// KV groups) so that shard boundaries fall everywhere.
inline model::ModelConfig layout_model() {
  model::ModelConfig c;
  c.name = "layout-test";
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 6;
  c.max_seq_len = 4;
  return c;
}

// Planning: a 1024-wide, 8-layer model, large enough that memory shapes plans on small devices.
inline model::ModelConfig planner_model() {
  model::ModelConfig m;
  m.name = "small";
  m.vocab_size = 8000;
  m.hidden_size = 1024;
  m.num_layers = 8;
  m.num_heads = 16;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 2816;
  m.max_seq_len = 1024;
  return m;
}

// The CUDA backend against the CPU backend: a whole training step of a LLaMA-shaped model
// (head_dim 16: the fp32 attention kernels in every mode).
inline model::ModelConfig cuda_test_model() {
  model::ModelConfig c;
  c.name = "cuda-test";
  c.vocab_size = 700;
  c.hidden_size = 128;
  c.num_layers = 3;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 352;
  c.max_seq_len = 96;
  return c;
}

}  // namespace malleus::testing
