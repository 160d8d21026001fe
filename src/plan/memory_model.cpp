// The memory model (memory_model.h): the formula, and the CostModel members that apply it to a
// stage, a plan or an idle device.
#include "plan/memory_model.h"

#include <algorithm>

#include "plan/cost_model.h"

namespace malleus::plan {

void MemoryFootprint::include(const MemoryFootprint& o) {
  auto raise = [](double& x, double y) { x = std::max(x, y); };
  raise(params_per_layer, o.params_per_layer);
  raise(embedding_params, o.embedding_params);
  raise(head_params, o.head_params);
  raise(largest_layer_tensor, o.largest_layer_tensor);
  raise(vocabulary_tensor, o.vocabulary_tensor);
  raise(parameter_bytes, o.parameter_bytes);
  raise(gradient_bytes, o.gradient_bytes);
  raise(optimizer_bytes, o.optimizer_bytes);
  for (int m = 0; m < 3; ++m) {
    raise(layer_kept[m], o.layer_kept[m]);
    raise(recompute_scratch[m], o.recompute_scratch[m]);
  }
  raise(stage_output, o.stage_output);
  raise(embedding_inputs, o.embedding_inputs);
  raise(head_kept, o.head_kept);
  raise(layer_workspace, o.layer_workspace);
  raise(head_workspace, o.head_workspace);
}

MemoryUse memory_use(const MemoryFootprint& f, const StageMemory& q) {
  const int layers = q.layers;
  const bool first = q.first, last = q.last;
  const model::Recompute& recompute = q.recompute;
  MemoryUse use;
  const bool synced = q.pipelines > 1;
  const double params =
      layers * f.params_per_layer + (first ? f.embedding_params : 0) + (last ? f.head_params : 0);
  const double holders = synced && q.optimizer == OptimizerSharding::kDistributed ? q.pipelines : 1;
  use.parameters = params * f.parameter_bytes;
  use.gradients = params * f.gradient_bytes * (holders > 1 ? 1 + 1 / holders : 1);
  use.optimizer = params * f.optimizer_bytes / holders;
  const auto mode = static_cast<size_t>(recompute.mode);
  const int recomputed =
      recompute.mode == model::RecomputeMode::kNone ? 0 : std::clamp(recompute.layers, 0, layers);
  const double per_micro_batch = (layers - recomputed) * f.layer_kept[0] +
                                 recomputed * f.layer_kept[mode] + f.stage_output +
                                 (first ? f.embedding_inputs : 0) + (last ? f.head_kept : 0);
  const int scratch_layers = recomputed == 0                       ? 0
                             : q.timing == RecomputeTiming::kAhead ? recomputed
                                                                   : 1;
  use.activations = q.in_flight * per_micro_batch + scratch_layers * f.recompute_scratch[mode];
  use.workspace = f.layer_workspace + (last ? f.head_workspace : 0);
  // The runtime packs gradients in fp32 (gradient_bytes per element).
  const double largest = std::max(f.largest_layer_tensor, first || last ? f.vocabulary_tensor : 0);
  use.communication = std::max({largest, synced ? std::min(params, kGradSyncChunkElements) : 0.0,
                                q.probe == LinkProbe::kHeld ? 2 * kLinkProbeElements : 0.0}) *
                      f.gradient_bytes;
  return use;
}

MemoryFootprint CostModel::footprint(const Stage& stage, size_t member) const {
  const Shares shares = Shares::of(stage, member, model_);
  const double h = model_.hidden_size, V = model_.vocab_size, F = model_.ffn_hidden_size;
  const double heads = model_.num_heads * shares.heads;
  const double q = h * shares.heads, kv = model_.kv_dim() * shares.heads, f = F * shares.ffn;
  const double v = V * shares.vocab;
  const double tokens = double(batch_.micro_batch) * batch_.seq_len;
  const double a = cluster_.activation_bytes;
  constexpr double kTokenBytes = 4;  // int32 token ids
  // Tensors of h values per token that every rank of the group holds whole, unless sequence
  // parallelism splits them (norm outputs, residuals).
  const double replicated = cluster_.sequence_parallel ? 1.0 / stage.tp() : 1.0;
  MemoryFootprint fp;
  fp.params_per_layer = layer_parameters(shares);
  fp.embedding_params = V * h * shares.vocab;
  fp.head_params = V * h * shares.vocab + h;
  fp.largest_layer_tensor = std::max(h * f, h * q);
  fp.vocabulary_tensor = v * h;
  fp.gradient_bytes = cluster_.grad_bytes;
  fp.parameter_bytes = cluster_.activation_bytes;  // weights in the training precision
  fp.optimizer_bytes =
      std::max(0.0, cluster_.state_bytes_per_param - fp.parameter_bytes - fp.gradient_bytes);
  // Per token of one micro-batch through one layer: the input; the outputs of the norms, the
  // matmuls and the MLP (what selective recomputation keeps); the attention core (scores, unless
  // fused, and the attention output).
  const double input = h * replicated;
  const double outputs = (3 * h + 2) * replicated + q + 2 * kv + 3 * f;
  const double core = q + (cluster_.flash_attention ? 0.0 : heads * batch_.seq_len);
  using model::RecomputeMode;
  auto index = [](RecomputeMode m) { return static_cast<size_t>(m); };
  fp.layer_kept[index(RecomputeMode::kNone)] = tokens * (input + outputs + core) * a;
  fp.layer_kept[index(RecomputeMode::kSelective)] = tokens * (input + outputs) * a;
  fp.layer_kept[index(RecomputeMode::kFull)] = tokens * input * a;
  fp.recompute_scratch[index(RecomputeMode::kSelective)] = tokens * core * a;
  fp.recompute_scratch[index(RecomputeMode::kFull)] = tokens * (outputs + core) * a;
  fp.stage_output = tokens * h * replicated * a;
  fp.embedding_inputs = tokens * kTokenBytes;
  // Targets; final norm output and its rstd; logits; losses, row maxima, two softmax sums.
  fp.head_kept = tokens * kTokenBytes + tokens * ((h + 1) * replicated + v + 4) * a;
  // Backward scratch: four of h, two of q, two of kv, three of f per token; the logits' gradient.
  fp.layer_workspace = tokens * (4 * h + 2 * q + 2 * kv + 3 * f) * a;
  fp.head_workspace = tokens * v * a;
  return fp;
}

MemoryUse CostModel::idle_memory(int device) const {
  MemoryUse use;
  use.workspace = 3.0 * kComputeProbeSize * kComputeProbeSize * sizeof(float);
  use.communication = probes_links(device) ? 2 * kLinkProbeElements * sizeof(float) : 0.0;
  return use;
}

bool CostModel::choose_recompute_ahead(Plan& plan) const {
  const double cap = cluster_.usable_memory();
  const int P = static_cast<int>(plan.pipelines.size());
  bool any = false;
  for (auto& p : plan.pipelines) {
    const int S = static_cast<int>(p.stages.size());
    for (int j = 0; j + 1 < S; ++j) {
      Stage& s = p.stages[static_cast<size_t>(j)];
      if (s.recompute_ahead || s.recompute.mode == model::RecomputeMode::kNone ||
          s.recompute.layers == 0) {
        continue;
      }
      bool fits = true;
      for (size_t i = 0; i < s.ranks.size() && fits; ++i) {
        StageMemory q = stage_memory(p, static_cast<size_t>(j), P, s.ranks[i]);
        q.timing = RecomputeTiming::kAhead;
        fits = memory_use(footprint(s, i), q).total() <= cap;
      }
      s.recompute_ahead = fits;
      any = any || fits;
    }
  }
  return any;
}

std::vector<MemoryUse> CostModel::memory_by_kind(const Plan& plan) const {
  std::vector<MemoryUse> out(static_cast<size_t>(plan.world_size));
  for (int r = 0; r < plan.world_size; ++r) out[static_cast<size_t>(r)] = idle_memory(r);
  const int P = static_cast<int>(plan.pipelines.size());
  for (const auto& p : plan.pipelines) {
    const int S = static_cast<int>(p.stages.size());
    for (int j = 0; j < S; ++j) {
      const Stage& s = p.stages[static_cast<size_t>(j)];
      for (size_t i = 0; i < s.ranks.size(); ++i) {
        const int r = s.ranks[i];
        if (r < 0 || r >= plan.world_size) continue;
        out[static_cast<size_t>(r)] =
            memory_use(footprint(s, i), stage_memory(p, static_cast<size_t>(j), P, r));
      }
    }
  }
  return out;
}

StageMemory CostModel::stage_memory(const Pipeline& pipeline, size_t j, int pipelines,
                                    int device) const {
  const Stage& s = pipeline.stages[j];
  const int S = static_cast<int>(pipeline.stages.size());
  StageMemory q;
  q.layers = s.num_layers();
  q.first = j == 0;
  q.last = static_cast<int>(j) == S - 1;
  q.in_flight = std::min(S - static_cast<int>(j), pipeline.micro_batches);
  q.recompute = s.recompute;
  q.pipelines = pipelines;
  q.optimizer =
      distributed_optimizer_ ? OptimizerSharding::kDistributed : OptimizerSharding::kWhole;
  q.timing = (shifted_recompute_ || s.recompute_ahead) && !q.last ? RecomputeTiming::kAhead
                                                                  : RecomputeTiming::kInBackward;
  q.probe = probes_links(device) ? LinkProbe::kHeld : LinkProbe::kNone;
  return q;
}

}  // namespace malleus::plan
