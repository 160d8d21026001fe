// Models the benchmark programs share, so that their figures describe the same model.
#pragma once

#include "common/json.h"
#include "model/config.h"

namespace malleus::bench {

// LLaMA-shaped, 8 layers of hidden 768 and a 32000-token vocabulary: 106M parameters (the
// checkpoint and optimizer-memory benchmarks: at least 100M, as issue 11 asks).
inline model::ModelConfig model_106m() {
  return model::ModelConfig::from_json(Json{{"name", "bench-106m"},
                                            {"vocab_size", 32000},
                                            {"hidden_size", 768},
                                            {"num_layers", 8},
                                            {"num_heads", 12},
                                            {"num_kv_heads", 12},
                                            {"ffn_hidden_size", 2048},
                                            {"max_seq_len", 256}},
                                       "bench model");
}

}  // namespace malleus::bench
