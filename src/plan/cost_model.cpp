#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/error.h"

namespace malleus::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double rate_of(const Rates& rates, int rank) {
  return rank >= 0 && static_cast<size_t>(rank) < rates.size() ? rates[static_cast<size_t>(rank)]
                                                               : 1.0;
}

// Integer shares of `total` units over ranks minimising max_r rate_r·(base_r + unit·share_r),
// every share at least one: binary search on the bottleneck, then trim the surplus from the
// ranks that would finish last.
std::vector<int> water_fill(int total, double unit, const std::vector<double>& base,
                            const std::vector<double>& rate) {
  const size_t n = rate.size();
  std::vector<int> shares(n, 1);
  if (total <= static_cast<int>(n)) return shares;  // caller guarantees total ≥ n
  auto capacity = [&](double t, size_t r) {
    const double c = std::floor((t / rate[r] - base[r]) / unit + 1e-9);
    return std::max(1.0, c);
  };
  double lo = 0, hi = 0;
  for (size_t r = 0; r < n; ++r) hi = std::max(hi, rate[r] * (base[r] + unit * total));
  for (int iter = 0; iter < 100 && hi - lo > 1e-12 * hi; ++iter) {
    const double mid = 0.5 * (lo + hi);
    double sum = 0;
    for (size_t r = 0; r < n; ++r) sum += capacity(mid, r);
    (sum >= total ? hi : lo) = mid;
  }
  long long sum = 0;
  for (size_t r = 0; r < n; ++r) {
    shares[r] = static_cast<int>(std::min<double>(capacity(hi, r), total));
    sum += shares[r];
  }
  while (sum > total) {  // trim from whoever finishes last
    size_t worst = n;
    double worst_time = -1;
    for (size_t r = 0; r < n; ++r) {
      const double t = rate[r] * (base[r] + unit * shares[r]);
      if (shares[r] > 1 && t > worst_time) worst_time = t, worst = r;
    }
    if (worst == n) break;
    --shares[worst];
    --sum;
  }
  while (sum < total) {  // numerical slack: give to whoever finishes first after taking it
    size_t best = 0;
    double best_time = kInf;
    for (size_t r = 0; r < n; ++r) {
      const double t = rate[r] * (base[r] + unit * (shares[r] + 1));
      if (t < best_time) best_time = t, best = r;
    }
    ++shares[best];
    ++sum;
  }
  return shares;
}

}  // namespace

void BatchConfig::validate(const std::string& source) const {
  check(global_batch > 0, source + ": global batch must be positive");
  check(micro_batch > 0, source + ": micro-batch must be positive");
  check(seq_len > 0, source + ": sequence length must be positive");
  check(global_batch % micro_batch == 0, source + ": global batch " + std::to_string(global_batch) +
                                             " is not a multiple of the micro-batch " +
                                             std::to_string(micro_batch));
}

Json Profile::to_json() const {
  return Json{{"device", device},
              {"model", model},
              {"threads", threads},
              {"micro_batch", micro_batch},
              {"seq_len", seq_len},
              {"layer_forward_s", layer_forward_s},
              {"layer_backward_s", layer_backward_s},
              {"head_forward_s", head_forward_s},
              {"head_backward_s", head_backward_s},
              {"layer_forward_flops_per_s", layer_forward_flops_per_s},
              {"layer_backward_flops_per_s", layer_backward_flops_per_s},
              {"head_flops_per_s", head_flops_per_s}};
}

Profile Profile::from_json(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  Profile p;
  p.device = r.optional<std::string>("device", "");
  p.model = r.optional<std::string>("model", "");
  p.threads = r.optional<int>("threads", 1);
  p.micro_batch = r.required<int>("micro_batch");
  p.seq_len = r.required<int>("seq_len");
  p.layer_forward_s = r.required<double>("layer_forward_s");
  p.layer_backward_s = r.required<double>("layer_backward_s");
  p.head_forward_s = r.required<double>("head_forward_s");
  p.head_backward_s = r.required<double>("head_backward_s");
  p.layer_forward_flops_per_s = r.required<double>("layer_forward_flops_per_s");
  p.layer_backward_flops_per_s = r.required<double>("layer_backward_flops_per_s");
  p.head_flops_per_s = r.required<double>("head_flops_per_s");
  r.finish();
  for (auto [key, value] : {std::pair{"layer_forward_flops_per_s", p.layer_forward_flops_per_s},
                            {"layer_backward_flops_per_s", p.layer_backward_flops_per_s},
                            {"head_flops_per_s", p.head_flops_per_s}}) {
    check(value > 0 && std::isfinite(value),
          source + ": \"" + key + "\" must be positive (got " + std::to_string(value) + ")");
  }
  return p;
}

double Prediction::samples_per_second(int global_batch) const {
  return std::isfinite(iteration_time) && iteration_time > 0 ? global_batch / iteration_time : 0;
}

CostModel::CostModel(model::ModelConfig model, ClusterSpec cluster, BatchConfig batch,
                     std::optional<Profile> profile)
    : model_(std::move(model)),
      cluster_(std::move(cluster)),
      batch_(batch),
      profile_(std::move(profile)) {
  batch_.validate("batch");
  const double h = model_.hidden_size;
  attention_params_ = 2 * h * h + 2 * h * model_.kv_dim();
  ffn_params_ = 3 * h * model_.ffn_hidden_size;
  if (profile_) {
    layer_flops_per_s_fwd_ = profile_->layer_forward_flops_per_s;
    layer_flops_per_s_bwd_ = profile_->layer_backward_flops_per_s;
    head_flops_per_s_ = profile_->head_flops_per_s;
  } else {
    layer_flops_per_s_fwd_ = layer_flops_per_s_bwd_ = head_flops_per_s_ = cluster_.flops();
  }
}

double CostModel::layer_forward_flops() const {
  const double tokens = double(batch_.micro_batch) * batch_.seq_len;
  const double h = model_.hidden_size;
  return tokens * (2 * attention_params_ + 2 * h * batch_.seq_len + 2 * ffn_params_);
}

double CostModel::head_forward_flops() const {
  return double(batch_.micro_batch) * batch_.seq_len * 2.0 * model_.vocab_size * model_.hidden_size;
}

double CostModel::activation_message_bytes() const {
  return double(batch_.micro_batch) * batch_.seq_len * model_.hidden_size *
         cluster_.activation_bytes;
}

double CostModel::allreduce_time(int parts, double bytes, double bandwidth, double latency) const {
  if (parts <= 1) return 0;
  return 2.0 * (parts - 1) / parts * bytes / bandwidth + 2.0 * (parts - 1) * latency;
}

double CostModel::allreduce_time(const std::vector<int>& ranks, double bytes) const {
  if (ranks.size() <= 1) return 0;
  bool cross = false;
  for (int r : ranks) cross = cross || cluster_.node_of(r) != cluster_.node_of(ranks[0]);
  return allreduce_time(static_cast<int>(ranks.size()), bytes,
                        cross ? cluster_.inter_node_bandwidth : cluster_.intra_node_bandwidth,
                        cross ? cluster_.inter_node_latency : cluster_.intra_node_latency);
}

double CostModel::p2p_time(const Stage& from, const Stage& to) const {
  bool cross = false;
  for (int a : from.ranks) {
    for (int b : to.ranks) cross = cross || cluster_.node_of(a) != cluster_.node_of(b);
  }
  // Megatron's scatter-gather: each of the min(t_from, t_to) rank pairs sends its slice.
  const double links = static_cast<double>(std::min(from.tp(), to.tp()));
  const double bw = cross ? cluster_.inter_node_bandwidth : cluster_.intra_node_bandwidth;
  const double latency = cross ? cluster_.inter_node_latency : cluster_.intra_node_latency;
  return activation_message_bytes() / (bw * links) + latency;
}

GroupCost CostModel::group_cost(const Stage& stage, const Rates& rates) const {
  GroupCost g;
  g.tp = stage.tp();
  const double H = model_.num_heads, F = model_.ffn_hidden_size, V = model_.vocab_size;
  const double h = model_.hidden_size;
  const double tokens = double(batch_.micro_batch) * batch_.seq_len;
  const double act_scale = cluster_.activation_bytes / 2.0;
  for (size_t i = 0; i < stage.ranks.size(); ++i) {
    const double rate = rate_of(rates, stage.ranks[i]);
    if (!std::isfinite(rate)) g.gone = true;
    const double fh = stage.heads[i] / H, ff = stage.ffn[i] / F, fv = stage.vocab[i] / V;
    const double fwd_flops =
        tokens * (2 * attention_params_ * fh + 2 * h * batch_.seq_len * fh + 2 * ffn_params_ * ff);
    g.layer_forward = std::max(g.layer_forward, fwd_flops / layer_flops_per_s_fwd_ * rate);
    g.layer_backward = std::max(g.layer_backward, 2 * fwd_flops / layer_flops_per_s_bwd_ * rate);
    const double head_flops = tokens * 2 * V * h * fv;
    g.head_forward = std::max(g.head_forward, head_flops / head_flops_per_s_ * rate);
    g.head_backward = std::max(g.head_backward, 2 * head_flops / head_flops_per_s_ * rate);
    const double share =
        (attention_params_ * fh + ffn_params_ * ff) / (attention_params_ + ffn_params_);
    g.layer_state_bytes =
        std::max(g.layer_state_bytes, (attention_params_ * fh + ffn_params_ * ff + 2 * h) *
                                          cluster_.state_bytes_per_param);
    g.layer_activation_bytes =
        std::max(g.layer_activation_bytes, 34 * tokens * h * act_scale * share);
    g.layer_checkpoint_bytes =
        std::max(g.layer_checkpoint_bytes, 2 * tokens * h * act_scale * share);
    g.embed_state_bytes =
        std::max(g.embed_state_bytes, V * h * fv * cluster_.state_bytes_per_param);
    g.head_state_bytes =
        std::max(g.head_state_bytes, (V * h * fv + h) * cluster_.state_bytes_per_param);
    g.logits_bytes = std::max(g.logits_bytes, 2 * tokens * V * fv * 4.0);
  }
  g.layer_comm = allreduce_time(stage.ranks, activation_message_bytes());
  if (g.gone) g.layer_forward = g.layer_backward = g.head_forward = g.head_backward = kInf;
  return g;
}

std::vector<double> CostModel::member_load(const Stage& stage, const Rates& rates) const {
  std::vector<double> load;
  double worst = 0;
  for (size_t i = 0; i < stage.ranks.size(); ++i) {
    const double fh = double(stage.heads[i]) / model_.num_heads;
    const double ff = double(stage.ffn[i]) / model_.ffn_hidden_size;
    const double work = (2 * attention_params_ + 2.0 * model_.hidden_size * batch_.seq_len) * fh +
                        2 * ffn_params_ * ff;
    load.push_back(work * rate_of(rates, stage.ranks[i]));
    worst = std::max(worst, load.back());
  }
  for (double& x : load) x = worst > 0 && std::isfinite(worst) ? x / worst : 1.0;
  return load;
}

StageCost CostModel::stage_cost(const GroupCost& g, int layers, bool first, bool last,
                                int in_flight) const {
  StageCost c;
  const double l = layers, n = std::max(in_flight, 1);
  const double cap = cluster_.usable_memory();
  const double fixed = l * g.layer_state_bytes + (first ? g.embed_state_bytes : 0) +
                       (last ? g.head_state_bytes + g.logits_bytes : 0);
  auto memory = [&](int k) {
    return fixed + n * ((l - k) * g.layer_activation_bytes + k * g.layer_checkpoint_bytes) +
           (k > 0 ? g.layer_activation_bytes : 0);
  };
  int k = 0;
  if (memory(0) > cap) {
    const double saved_per_layer = n * (g.layer_activation_bytes - g.layer_checkpoint_bytes);
    k = saved_per_layer > 0 ? static_cast<int>(std::ceil(
                                  (memory(0) + g.layer_activation_bytes - cap) / saved_per_layer))
                            : layers;
    k = std::clamp(k, 1, std::max(layers, 1));
    while (k > 1 && memory(k - 1) <= cap) --k;
    while (k < layers && memory(k) > cap) ++k;
    c.fits = memory(k) <= cap;
  }
  c.recompute_layers = k;
  c.memory_bytes = memory(k);
  const double layer_fwd = g.layer_forward + 2 * g.layer_comm;
  c.forward = l * layer_fwd + (first ? g.layer_comm : 0) + (last ? g.head_forward : 0);
  c.backward = l * (g.layer_backward + 2 * g.layer_comm) +
               (last ? g.head_backward + g.layer_comm : 0) + (k > 0 ? k * layer_fwd : 0.0);
  c.comm = (4 * l + (first ? 1 : 0) + (last ? 1 : 0) + 2 * k) * g.layer_comm;
  return c;
}

PipelinePrediction CostModel::pipeline_time(std::vector<StagePrediction> stages,
                                            int micro_batches) {
  PipelinePrediction p;
  p.stages = std::move(stages);
  const size_t S = p.stages.size();
  if (S == 0 || micro_batches <= 0) return p;
  double suffix = 0;
  for (size_t i = S; i-- > 0;) {
    const auto& s = p.stages[i];
    const double work = s.cost.forward + s.cost.backward;
    suffix += work + (i + 1 < S ? 2 * s.p2p_next : 0);
    p.period = std::max({p.period, work, suffix / static_cast<double>(S - i)});
  }
  p.first_micro_batch = suffix;
  p.time = suffix + (micro_batches > 1 ? (micro_batches - 1) * p.period : 0.0);
  return p;
}

double CostModel::owned_parameters(const Stage& stage, size_t member, bool first, bool last) const {
  const double h = model_.hidden_size;
  const double fh = double(stage.heads[member]) / model_.num_heads;
  const double ff = double(stage.ffn[member]) / model_.ffn_hidden_size;
  const double fv = double(stage.vocab[member]) / model_.vocab_size;
  double params = stage.num_layers() * (attention_params_ * fh + ffn_params_ * ff + 2 * h);
  if (first) params += model_.vocab_size * h * fv;
  if (last) params += model_.vocab_size * h * fv + h;
  return params;
}

Prediction CostModel::predict(const Plan& plan, const Rates& rates) const {
  Prediction out;
  out.memory_bytes.assign(static_cast<size_t>(plan.world_size), 0.0);
  const double cap = cluster_.usable_memory();
  const int L = model_.num_layers;
  // Nodes holding each layer, over all pipelines: a layer whose owners span nodes syncs its
  // gradients over the inter-node network.
  std::vector<int> layer_node(static_cast<size_t>(L), -1);
  std::vector<bool> layer_crosses(static_cast<size_t>(L), false);
  for (const auto& p : plan.pipelines) {
    for (const auto& s : p.stages) {
      for (int r : s.ranks) {
        const int node = cluster_.node_of(r);
        for (int l = s.layer_begin; l < s.layer_end; ++l) {
          int& n = layer_node[static_cast<size_t>(l)];
          if (n < 0) n = node;
          if (n != node) layer_crosses[static_cast<size_t>(l)] = true;
        }
      }
    }
  }
  const int P = static_cast<int>(plan.pipelines.size());
  for (const auto& p : plan.pipelines) {
    const int S = static_cast<int>(p.stages.size());
    std::vector<StagePrediction> stages;
    for (int j = 0; j < S; ++j) {
      const Stage& s = p.stages[static_cast<size_t>(j)];
      const bool first = j == 0, last = j == S - 1;
      const GroupCost g = group_cost(s, rates);
      if (g.gone && out.problem.empty()) {
        for (int r : s.ranks) {
          if (is_gone(rate_of(rates, r))) {
            out.problem = "device " + std::to_string(r) + " is gone but the plan uses it";
          }
        }
      }
      StagePrediction sp;
      const int in_flight = std::min(S - j, p.micro_batches);
      sp.cost = stage_cost(g, s.num_layers(), first, last, in_flight);
      if (!sp.cost.fits && out.fits) {
        out.fits = false;
        if (out.problem.empty()) {
          out.problem = "stage with ranks starting at " + std::to_string(s.ranks[0]) + " needs " +
                        std::to_string(sp.cost.memory_bytes / 1e9) + " GB, more than the usable " +
                        std::to_string(cap / 1e9) + " GB even with every layer recomputed";
        }
      }
      if (!last) sp.p2p_next = p2p_time(s, p.stages[static_cast<size_t>(j + 1)]);
      stages.push_back(sp);
      // Per-rank memory with the stage's recomputation choice.
      const double tokens = double(batch_.micro_batch) * batch_.seq_len;
      const double act_scale = cluster_.activation_bytes / 2.0;
      const int k = sp.cost.recompute_layers;
      for (size_t i = 0; i < s.ranks.size(); ++i) {
        const double fh = double(s.heads[i]) / model_.num_heads;
        const double ff = double(s.ffn[i]) / model_.ffn_hidden_size;
        const double fv = double(s.vocab[i]) / model_.vocab_size;
        const double share =
            (attention_params_ * fh + ffn_params_ * ff) / (attention_params_ + ffn_params_);
        const double act = 34 * tokens * model_.hidden_size * act_scale * share;
        const double ckpt = 2 * tokens * model_.hidden_size * act_scale * share;
        double mem = owned_parameters(s, i, first, last) * cluster_.state_bytes_per_param +
                     in_flight * ((s.num_layers() - k) * act + k * ckpt) + (k > 0 ? act : 0);
        if (last) mem += 2 * tokens * model_.vocab_size * fv * 4.0;
        const int r = s.ranks[i];
        if (r >= 0 && r < plan.world_size) out.memory_bytes[static_cast<size_t>(r)] = mem;
      }
    }
    out.pipelines.push_back(pipeline_time(std::move(stages), p.micro_batches));
    out.pipeline_time = std::max(out.pipeline_time, out.pipelines.back().time);
  }
  // Gradient sync and optimizer step, per rank.
  for (const auto& p : plan.pipelines) {
    const int S = static_cast<int>(p.stages.size());
    for (int j = 0; j < S; ++j) {
      const Stage& s = p.stages[static_cast<size_t>(j)];
      bool crosses = false;
      for (int l = s.layer_begin; l < s.layer_end; ++l) {
        crosses = crosses || layer_crosses[static_cast<size_t>(l)];
      }
      for (size_t i = 0; i < s.ranks.size(); ++i) {
        const double params = owned_parameters(s, i, j == 0, j == S - 1);
        if (P > 1) {
          const double t = allreduce_time(
              P, params * cluster_.grad_bytes,
              crosses ? cluster_.inter_node_bandwidth : cluster_.intra_node_bandwidth,
              crosses ? cluster_.inter_node_latency : cluster_.intra_node_latency);
          out.grad_sync_time = std::max(out.grad_sync_time, t);
        }
        const double rate = rate_of(rates, s.ranks[i]);
        const double opt = params * 2 * cluster_.state_bytes_per_param / cluster_.memory_bandwidth *
                           (std::isfinite(rate) ? rate : 1.0);
        out.optimizer_time = std::max(out.optimizer_time, opt);
      }
    }
  }
  // A gone device in the plan makes its stage's times infinite, and so the iteration.
  out.iteration_time = out.pipeline_time + out.grad_sync_time + out.optimizer_time;
  return out;
}

void CostModel::even_shares_of(Stage& stage) const {
  const int t = stage.tp();
  stage.heads = even_shares(model_.num_heads, t, model_.num_heads / model_.num_kv_heads);
  stage.ffn = even_shares(model_.ffn_hidden_size, t);
  stage.vocab = even_shares(model_.vocab_size, t);
}

void CostModel::balance_shares(Stage& stage, const Rates& rates) const {
  const size_t t = stage.ranks.size();
  std::vector<double> rate(t);
  bool uniform = true;
  for (size_t i = 0; i < t; ++i) {
    const double r = rate_of(rates, stage.ranks[i]);
    rate[i] = std::isfinite(r) ? r : 1e9;
    uniform = uniform && rate[i] == rate[0];
  }
  check(model_.num_kv_heads >= static_cast<int>(t),
        "a tensor-parallel group of " + std::to_string(t) + " ranks exceeds the model's " +
            std::to_string(model_.num_kv_heads) + " KV heads");
  if (uniform || t == 1) {
    even_shares_of(stage);
    return;
  }
  const int kv = model_.num_kv_heads, group = model_.num_heads / model_.num_kv_heads;
  const double tokens = double(batch_.micro_batch) * batch_.seq_len;
  const double attn_unit =
      tokens * (2 * attention_params_ + 2.0 * model_.hidden_size * batch_.seq_len) / kv;
  const double ffn_unit = tokens * 2 * ffn_params_ / model_.ffn_hidden_size;
  // Two ways to place the coarse head units, then FFN columns water-filled around them; keep the
  // better. (a) heads alone balanced greedily; (b) heads toward each rank's share of all work.
  std::vector<std::vector<int>> head_options;
  {
    std::vector<int> hu(t, 1);
    for (int u = static_cast<int>(t); u < kv; ++u) {
      size_t best = 0;
      for (size_t i = 1; i < t; ++i) {
        if (rate[i] * (hu[i] + 1) < rate[best] * (hu[best] + 1)) best = i;
      }
      ++hu[best];
    }
    head_options.push_back(hu);
  }
  {
    double inv = 0;
    for (double r : rate) inv += 1 / r;
    const double total = attn_unit * kv + ffn_unit * model_.ffn_hidden_size;
    std::vector<int> hu(t, 1);
    for (int u = static_cast<int>(t); u < kv; ++u) {
      size_t best = 0;
      double best_room = -kInf;
      for (size_t i = 0; i < t; ++i) {
        const double room = total * (1 / rate[i]) / inv - attn_unit * hu[i];
        if (room > best_room) best_room = room, best = i;
      }
      ++hu[best];
    }
    head_options.push_back(hu);
  }
  double best_time = kInf;
  for (const auto& hu : head_options) {
    std::vector<double> base(t);
    for (size_t i = 0; i < t; ++i) base[i] = attn_unit * hu[i];
    const auto ffn = water_fill(model_.ffn_hidden_size, ffn_unit, base, rate);
    double worst = 0;
    for (size_t i = 0; i < t; ++i) {
      worst = std::max(worst, rate[i] * (base[i] + ffn_unit * ffn[i]));
    }
    if (worst < best_time) {
      best_time = worst;
      stage.heads.assign(t, 0);
      for (size_t i = 0; i < t; ++i) stage.heads[i] = hu[i] * group;
      stage.ffn = ffn;
    }
  }
  stage.vocab = water_fill(model_.vocab_size, 1.0, std::vector<double>(t, 0.0), rate);
}

}  // namespace malleus::plan
