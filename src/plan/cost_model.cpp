#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "common/error.h"

namespace malleus::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Matmul parameters of one layer: attention (Q, K, V, O) and the SwiGLU FFN.
struct LayerMatmuls {
  double attention, ffn;
};
LayerMatmuls layer_matmuls(const model::ModelConfig& model) {
  const double h = model.hidden_size;
  return {2 * h * h + 2 * h * model.kv_dim(), 3 * h * model.ffn_hidden_size};
}

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

// The fewest of 1..layers recomputed layers of `mode` for which `fits(k)`, 0 if none. A stage's
// memory is linear in k for k ≥ 1 (memory_use: each recomputed layer keeps less, and under the
// shifted schedule holds one more scratch), so the k that fit are a prefix or a suffix
// of 1..layers: k = 1, or, when memory falls with k, the first that fits by binary search (O(log
// layers) instead of trying every k).
template <typename Fits>
int fewest_recomputed_layers(int layers, const Fits& fits) {
  if (layers < 1) return 0;
  if (fits(1)) return 1;
  if (!fits(layers)) return 0;
  int lo = 1, hi = layers;  // fits(hi), !fits(lo)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace

Shares Shares::of(const Stage& stage, size_t member, const model::ModelConfig& model) {
  return {double(stage.heads[member]) / model.num_heads,
          double(stage.ffn[member]) / model.ffn_hidden_size,
          double(stage.vocab[member]) / model.vocab_size};
}

double layer_forward_flops(const model::ModelConfig& model, int sequences, int seq_len,
                           const Shares& shares) {
  const double h = model.hidden_size, tokens = double(sequences) * seq_len;
  const LayerMatmuls params = layer_matmuls(model);
  // 2 per matmul weight per token; causal attention (QKᵀ and PV) over s/2 keys on average.
  return tokens * (2 * params.attention * shares.heads + 2 * h * seq_len * shares.heads +
                   2 * params.ffn * shares.ffn);
}

double head_forward_flops(const model::ModelConfig& model, int sequences, int seq_len,
                          const Shares& shares) {
  return double(sequences) * seq_len * 2.0 * model.vocab_size * model.hidden_size * shares.vocab;
}

double shard_training_flops(const model::ModelConfig& model, int sequences, int seq_len, int layers,
                            bool last_stage, const Shares& shares) {
  double forward = layers * layer_forward_flops(model, sequences, seq_len, shares);
  if (last_stage) forward += head_forward_flops(model, sequences, seq_len, shares);
  return (1 + kBackwardPerForward) * forward;
}

std::vector<double> work_flops(const Plan& plan, const model::ModelConfig& model, int seq_len) {
  std::vector<double> flops(static_cast<size_t>(plan.world_size), kComputeProbeFlops);
  for (const Pipeline& pipeline : plan.pipelines) {
    for (size_t s = 0; s < pipeline.stages.size(); ++s) {
      const Stage& stage = pipeline.stages[s];
      for (size_t member = 0; member < stage.ranks.size(); ++member) {
        flops.at(static_cast<size_t>(stage.ranks[member])) =
            pipeline.micro_batches *
            shard_training_flops(model, plan.micro_batch_size, seq_len, stage.num_layers(),
                                 s + 1 == pipeline.stages.size(), Shares::of(stage, member, model));
      }
    }
  }
  return flops;
}

void BatchConfig::validate(const std::string& source) const {
  check(global_batch > 0, source + ": global batch must be positive");
  check(micro_batch > 0, source + ": micro-batch must be positive");
  check(seq_len > 0, source + ": sequence length must be positive");
  check(global_batch % micro_batch == 0, source + ": global batch " + std::to_string(global_batch) +
                                             " is not a multiple of the micro-batch " +
                                             std::to_string(micro_batch));
  check(micro_batches() <= kMaxMicroBatches,
        source + ": global batch " + std::to_string(global_batch) + " gives " +
            std::to_string(micro_batches()) + " micro-batches of " + std::to_string(micro_batch) +
            ", more than the " + std::to_string(kMaxMicroBatches) + " a step may have");
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

CostModel::CostModel(model::ModelConfig model, ClusterSpec cluster, BatchConfig batch,
                     std::optional<Profile> profile)
    : model_(std::move(model)),
      cluster_(std::move(cluster)),
      batch_(batch),
      profile_(std::move(profile)),
      shared_cores_(SharedCores::of(cluster_)) {
  batch_.validate("batch");
  const LayerMatmuls params = layer_matmuls(model_);
  attention_params_ = params.attention;
  ffn_params_ = params.ffn;
  if (profile_) {
    layer_flops_per_s_fwd_ = profile_->layer_forward_flops_per_s;
    layer_flops_per_s_bwd_ = profile_->layer_backward_flops_per_s;
    head_flops_per_s_ = profile_->head_flops_per_s;
  } else {
    layer_flops_per_s_fwd_ = layer_flops_per_s_bwd_ = head_flops_per_s_ = cluster_.flops();
  }
}

double CostModel::layer_forward_flops() const {
  return plan::layer_forward_flops(model_, batch_.micro_batch, batch_.seq_len);
}

double CostModel::head_forward_flops() const {
  return plan::head_forward_flops(model_, batch_.micro_batch, batch_.seq_len);
}

double CostModel::layer_parameters(const Shares& shares) const {
  return attention_params_ * shares.heads + ffn_params_ * shares.ffn + 2.0 * model_.hidden_size;
}

CostModel CostModel::with_link_rates(std::vector<double> link_rates) const {
  CostModel slowed = *this;
  slowed.cluster_.link_rates = std::move(link_rates);
  slowed.cluster_.validate("link rates");
  return slowed;
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
  return allreduce_time(static_cast<int>(ranks.size()), bytes, cluster_.span_bandwidth(ranks),
                        cluster_.span_latency(ranks));
}

bool CostModel::probes_links(int device) const {
  return cluster_.nodes > 1 && device % cluster_.devices_per_node == 0;
}

std::vector<double> CostModel::link_probe_seconds_per_byte() const {
  std::vector<double> expected(static_cast<size_t>(cluster_.num_devices()), 0.0);
  if (cluster_.nodes < 2) return expected;
  // The healthy cluster's: slow links are what the monitor measures.
  const double bytes = kLinkProbeElements * sizeof(float);
  const double seconds = cluster_.inter_node_latency + bytes / cluster_.inter_node_bandwidth;
  for (int node = 0; node < cluster_.nodes; ++node) {
    expected[static_cast<size_t>(node * cluster_.devices_per_node)] = seconds / bytes;
  }
  return expected;
}

int link_probe_rounds(int nodes) {
  return nodes < 2 ? 0 : nodes % 2 == 0 ? nodes - 1 : nodes;
}

int link_probe_partner(int nodes, int round, int node) {
  // Nodes 0..M-2 on a circle and node M-1 (M = nodes rounded up to even; node M-1 is nobody
  // when nodes is odd) in the middle: in round r, x and y pair when x + y = 2r (mod M-1), and
  // the node with 2x = 2r pairs with the middle.
  const int m = nodes % 2 == 0 ? nodes : nodes + 1;
  check(nodes >= 2 && round >= 0 && round < m - 1 && node >= 0 && node < nodes,
        "link probe schedule: no round " + std::to_string(round) + " for node " +
            std::to_string(node) + " of " + std::to_string(nodes));
  int partner;
  if (node == m - 1) {
    partner = round;
  } else if (node == round) {
    partner = m - 1;
  } else {
    partner = ((2 * round - node) % (m - 1) + (m - 1)) % (m - 1);
  }
  return partner < nodes ? partner : -1;
}

double CostModel::p2p_time(const Stage& from, const Stage& to) const {
  std::vector<int> both = from.ranks;
  both.insert(both.end(), to.ranks.begin(), to.ranks.end());
  // Megatron's scatter-gather: each of the min(t_from, t_to) rank pairs sends its slice.
  const double links = static_cast<double>(std::min(from.tp(), to.tp()));
  return activation_message_bytes() / (cluster_.span_bandwidth(both) * links) +
         cluster_.span_latency(both);
}

GroupCost CostModel::group_cost(const Stage& stage, const Rates& rates) const {
  GroupCost g;
  g.tp = stage.tp();
  const int b = batch_.micro_batch, s = batch_.seq_len;
  // Members that take turns on one core (plan/shared_cores.h) compute one after another: per core
  // the sum of their times; the group waits for its busiest core. Without shared cores every
  // member has a core of its own and this is the slowest member.
  struct Times {
    double layer_forward = 0, layer_backward = 0, head_forward = 0, head_backward = 0,
           attention_core_forward = 0;
  };
  std::vector<std::pair<int, Times>> cores;
  double slowest_member = -1;
  for (size_t i = 0; i < stage.ranks.size(); ++i) {
    const double rate = rate_of(rates, stage.ranks[i]);
    if (!std::isfinite(rate)) g.gone = true;
    const Shares shares = Shares::of(stage, i, model_);
    const double layer = plan::layer_forward_flops(model_, b, s, shares);
    const double head = plan::head_forward_flops(model_, b, s, shares);
    if (layer / layer_flops_per_s_fwd_ * rate >= slowest_member) {
      slowest_member = layer / layer_flops_per_s_fwd_ * rate;
      // The slowest member's split of its work (per token, as layer_forward_flops counts it).
      const double h = model_.hidden_size, tokens = double(b) * s;
      const double o_proj = 2 * h * h * shares.heads, qkv = 2 * (h * h + 2 * h * model_.kv_dim());
      g.attention_share =
          tokens * (2 * layer_matmuls(model_).attention + 2 * h * s) * shares.heads / layer;
      g.o_proj_share = tokens * o_proj / layer;
      g.qkv_share = tokens * qkv * shares.heads / layer;
    }
    const int core = unit_of(stage.ranks[i]);
    auto on_core = std::find_if(cores.begin(), cores.end(),
                                [&](const auto& entry) { return entry.first == core; });
    if (on_core == cores.end()) on_core = cores.insert(cores.end(), {core, Times{}});
    Times& t = on_core->second;
    t.layer_forward += layer / layer_flops_per_s_fwd_ * rate;
    t.layer_backward += kBackwardPerForward * layer / layer_flops_per_s_bwd_ * rate;
    t.head_forward += head / head_flops_per_s_ * rate;
    t.head_backward += kBackwardPerForward * head / head_flops_per_s_ * rate;
    const double attention_core = double(b) * s * 2.0 * model_.hidden_size * s * shares.heads;
    t.attention_core_forward += attention_core / layer_flops_per_s_fwd_ * rate;
    g.memory.include(footprint(stage, i));
    g.probes_links = g.probes_links || probes_links(stage.ranks[i]);
  }
  for (const auto& [core, t] : cores) {
    g.layer_forward = std::max(g.layer_forward, t.layer_forward);
    g.layer_backward = std::max(g.layer_backward, t.layer_backward);
    g.head_forward = std::max(g.head_forward, t.head_forward);
    g.head_backward = std::max(g.head_backward, t.head_backward);
    g.attention_core_forward = std::max(g.attention_core_forward, t.attention_core_forward);
  }
  g.layer_comm = allreduce_time(stage.ranks, activation_message_bytes());
  g.layer_comm_half = allreduce_time(stage.ranks, activation_message_bytes() / 2);
  const double token_values = double(b) * s * cluster_.activation_bytes;
  g.loss_comm =
      allreduce_time(stage.ranks, token_values) + allreduce_time(stage.ranks, 2 * token_values);
  if (g.gone) {
    g.layer_forward = g.layer_backward = g.head_forward = g.head_backward = kInf;
    g.attention_core_forward = kInf;
  }
  return g;
}

std::vector<double> CostModel::member_load(const Stage& stage, const Rates& rates) const {
  std::vector<double> load;
  double worst = 0;
  for (size_t i = 0; i < stage.ranks.size(); ++i) {
    const double work = plan::layer_forward_flops(model_, batch_.micro_batch, batch_.seq_len,
                                                  Shares::of(stage, i, model_));
    load.push_back(work * rate_of(rates, stage.ranks[i]));
    worst = std::max(worst, load.back());
  }
  for (double& x : load) x = worst > 0 && std::isfinite(worst) ? x / worst : 1.0;
  return load;
}

double CostModel::exposed_layer_comm(const GroupCost& g, bool backward) const {
  const bool split =
      tp_subpipeline_ && g.tp > 1 && (batch_.micro_batch >= 2 || batch_.seq_len >= 2);
  if (!split) return 2 * g.layer_comm;
  const double half = (backward ? g.layer_backward : g.layer_forward) / 2;  // one part's compute
  const double attention = g.attention_share * half, mlp = (1 - g.attention_share) * half;
  const bool by_sequence = batch_.micro_batch >= 2;
  // The compute that runs while each of the layer's first three half-reductions is in flight.
  double overlapped[3];
  if (!backward && by_sequence) {
    overlapped[0] = attention, overlapped[1] = overlapped[2] = mlp;
  } else if (!backward) {
    overlapped[0] = g.o_proj_share * half, overlapped[1] = overlapped[2] = mlp;
  } else if (by_sequence) {
    overlapped[0] = mlp, overlapped[1] = overlapped[2] = attention;
  } else {
    overlapped[0] = mlp, overlapped[1] = g.o_proj_share * half, overlapped[2] = g.qkv_share * half;
  }
  double exposed = g.layer_comm_half;  // the last one
  for (double compute : overlapped) exposed += std::max(0.0, g.layer_comm_half - compute);
  return exposed;
}

StageCost CostModel::stage_cost(const GroupCost& g, const StageQuery& q) const {
  using model::RecomputeMode;
  StageCost c;
  const int layers = q.layers;
  const bool first = q.first, last = q.last;
  const double l = layers;
  const double cap = cluster_.usable_memory();
  StageMemory question;
  question.layers = layers;
  question.first = first;
  question.last = last;
  question.in_flight = std::max(q.in_flight, 1);
  question.pipelines = q.pipelines;
  question.optimizer =
      distributed_optimizer_ ? OptimizerSharding::kDistributed : OptimizerSharding::kWhole;
  const bool shifted = (shifted_recompute_ || q.timing == RecomputeTiming::kAhead) && !last;
  question.timing = shifted ? RecomputeTiming::kAhead : RecomputeTiming::kInBackward;
  question.probe = g.probes_links ? LinkProbe::kHeld : LinkProbe::kNone;
  auto memory = [&](const model::Recompute& r) {
    question.recompute = r;
    return memory_use(g.memory, question).total();
  };
  // What recomputing one layer adds to the backward: the attention core's forward (selective),
  // or the layer's forward up to the MLP output with the attention all-reduce (full).
  auto extra_time = [&](const model::Recompute& r) {
    if (r.mode == RecomputeMode::kNone) return 0.0;
    return r.layers * (r.mode == RecomputeMode::kSelective ? g.attention_core_forward
                                                           : g.layer_forward + g.layer_comm);
  };
  model::Recompute chosen = q.planned;
  if (q.planned.mode == RecomputeMode::kNone && q.choice == RecomputeChoice::kChooseToFit &&
      recompute_allowed_ && memory({}) > cap) {
    // Stage-aware: of selective or full on the first k layers, the cheapest that fits; the most
    // memory saved when none does.
    // Memory falls and time grows with k, so per mode the fewest layers that fit is its best.
    chosen = {RecomputeMode::kFull, layers};
    if (memory(chosen) <= cap) {
      double best = kInf;
      for (RecomputeMode mode : {RecomputeMode::kSelective, RecomputeMode::kFull}) {
        const int k = fewest_recomputed_layers(layers, [&](int n) {
          return memory({mode, n}) <= cap;
        });
        if (k == 0) continue;
        const model::Recompute r{mode, k};
        if (extra_time(r) < best) best = extra_time(r), chosen = r;
      }
    }
  }
  if (chosen.mode == RecomputeMode::kNone) chosen.layers = 0;
  c.recompute = chosen;
  c.recompute_time = extra_time(chosen);
  c.recompute_ahead = shifted && chosen.layers > 0;
  c.memory_bytes = memory(chosen);
  c.fits = c.memory_bytes <= cap;
  const double forward_comm = exposed_layer_comm(g, false);
  const double backward_comm = exposed_layer_comm(g, true);
  c.forward = l * (g.layer_forward + forward_comm) + (first ? g.layer_comm : 0) +
              (last ? g.head_forward + g.loss_comm : 0);
  c.backward = l * (g.layer_backward + backward_comm) +
               (last ? g.head_backward + g.layer_comm : 0) + extra_time(chosen);
  const int recomputed_comm = chosen.mode == RecomputeMode::kFull ? chosen.layers : 0;
  c.comm = l * (forward_comm + backward_comm) +
           ((first ? 1 : 0) + (last ? 1 : 0) + recomputed_comm) * g.layer_comm +
           (last ? g.loss_comm : 0);
  return c;
}

PipelinePrediction CostModel::pipeline_time(std::vector<StagePrediction> stages,
                                            int micro_batches) {
  PipelinePrediction p;
  p.stages = std::move(stages);
  const size_t S = p.stages.size();
  if (S == 0 || micro_batches <= 0) return p;
  // suffix: the first micro-batch's trip from stage i down and back; round_trip: a steady-state
  // micro-batch's, both without the recomputation done ahead of the gradient.
  double suffix = 0, round_trip = 0;
  for (size_t i = S; i-- > 0;) {
    const auto& s = p.stages[i];
    const double work = s.cost.forward + s.cost.backward;
    const double trip_below = i + 1 < S ? suffix + 2 * s.p2p_next : 0;
    const double ahead = s.cost.recompute_ahead && i + 1 < S ? s.cost.recompute_time : 0;
    // Waiting for its first gradient, the stage has run its warm-up forwards.
    const int warmup = std::min(static_cast<int>(S - i), micro_batches) - 1;
    const double wait = std::max(0.0, trip_below - warmup * s.cost.forward);
    suffix = work - std::min(ahead, wait) + trip_below;
    round_trip += work - ahead + (i + 1 < S ? 2 * s.p2p_next : 0);
    p.period = std::max({p.period, work, round_trip / static_cast<double>(S - i)});
  }
  p.first_micro_batch = suffix;
  p.time = suffix + (micro_batches > 1 ? (micro_batches - 1) * p.period : 0.0);
  return p;
}

double CostModel::owned_parameters(const Stage& stage, size_t member, bool first, bool last) const {
  const Shares shares = Shares::of(stage, member, model_);
  const double h = model_.hidden_size, V = model_.vocab_size;
  double params = stage.num_layers() * layer_parameters(shares);
  if (first) params += V * h * shares.vocab;
  if (last) params += V * h * shares.vocab + h;
  return params;
}

CostModel::LayerLinks CostModel::layer_links(const Plan& plan) const {
  const auto L = static_cast<size_t>(model_.num_layers);
  LayerLinks links{std::vector<bool>(L, false), std::vector<double>(L, 1.0)};
  std::vector<int> layer_node(L, -1);
  for (const auto& p : plan.pipelines) {
    for (const auto& s : p.stages) {
      // The stage's nodes, once, then its layers (not every rank × layer).
      if (s.ranks.empty()) continue;
      const int node = cluster_.node_of(s.ranks[0]);
      bool spans = false;
      double slowest_link = 1.0;
      for (int r : s.ranks) {
        spans = spans || cluster_.node_of(r) != node;
        slowest_link = std::max(slowest_link, cluster_.link_rate(cluster_.node_of(r)));
      }
      for (int l = s.layer_begin; l < s.layer_end; ++l) {
        const auto layer = static_cast<size_t>(l);
        int& n = layer_node[layer];
        if (n < 0) n = node;
        if (n != node || spans) links.crosses[layer] = true;
        links.slowest_link[layer] = std::max(links.slowest_link[layer], slowest_link);
      }
    }
  }
  return links;
}

StagePrediction CostModel::predict_stage(const Pipeline& p, size_t j, int pipelines,
                                         const Rates& rates, bool choose_recompute,
                                         Prediction& out) const {
  const Stage& s = p.stages[j];
  const int S = static_cast<int>(p.stages.size());
  const bool first = j == 0, last = j + 1 == p.stages.size();
  const GroupCost g = group_cost(s, rates);
  if (g.gone && out.problem.empty()) {
    for (int r : s.ranks) {
      if (is_gone(rate_of(rates, r))) {
        out.problem = "device " + std::to_string(r) + " is gone but the plan uses it";
      }
    }
  }
  StagePrediction sp;
  StageQuery query;
  query.layers = s.num_layers();
  query.first = first;
  query.last = last;
  query.in_flight = std::min(S - static_cast<int>(j), p.micro_batches);
  query.planned = s.recompute;
  query.choice = choose_recompute ? RecomputeChoice::kChooseToFit : RecomputeChoice::kAsPlanned;
  query.pipelines = pipelines;
  query.timing = s.recompute_ahead ? RecomputeTiming::kAhead : RecomputeTiming::kInBackward;
  sp.cost = stage_cost(g, query);
  if (!sp.cost.fits && out.fits) {
    out.fits = false;
    if (out.problem.empty()) {
      out.problem = "stage with ranks starting at " + std::to_string(s.ranks[0]) + " needs " +
                    std::to_string(sp.cost.memory_bytes / 1e9) + " GB, more than the usable " +
                    std::to_string(cluster_.usable_memory() / 1e9) + " GB with recomputation " +
                    model::recompute_mode_name(sp.cost.recompute.mode) + " of " +
                    std::to_string(sp.cost.recompute.layers) + " layers";
    }
  }
  if (!last) sp.p2p_next = p2p_time(s, p.stages[j + 1]);
  // Per-rank memory with the stage's recomputation choice.
  MemoryFootprint member;  // members with the same shares hold the same footprint
  for (size_t i = 0; i < s.ranks.size(); ++i) {
    const int r = s.ranks[i];
    if (r < 0 || r >= static_cast<int>(out.memory_bytes.size())) continue;
    if (i == 0 || s.heads[i] != s.heads[i - 1] || s.ffn[i] != s.ffn[i - 1] ||
        s.vocab[i] != s.vocab[i - 1]) {
      member = footprint(s, i);
    }
    StageMemory m = stage_memory(p, j, pipelines, r);
    m.recompute = sp.cost.recompute;
    out.memory_bytes[static_cast<size_t>(r)] = memory_use(member, m).total();
  }
  return sp;
}

PipelinePrediction CostModel::predict_pipeline(const Pipeline& p, int pipelines, const Rates& rates,
                                               bool choose_recompute, Prediction& out) const {
  std::vector<StagePrediction> stages;
  for (size_t j = 0; j < p.stages.size(); ++j) {
    stages.push_back(predict_stage(p, j, pipelines, rates, choose_recompute, out));
  }
  if (!shared_cores_) return pipeline_time(std::move(stages), p.micro_batches);
  // Consecutive stages whose ranks take turns on the same cores run as one stage: the core
  // does one stage's work or the other's, and a micro-batch handed from one to the other
  // never waits for an idle core (the 1F1B bubble between them is the other stage's work).
  PipelinePrediction merged =
      pipeline_time(shared_cores_->merge_stages(p, stages), p.micro_batches);
  merged.stages = std::move(stages);
  return merged;
}

void CostModel::predict_sync_and_optimizer(const Plan& plan, const Rates& rates,
                                           Prediction& out) const {
  const LayerLinks links = layer_links(plan);
  const int P = static_cast<int>(plan.pipelines.size());
  std::vector<double> optimizer_per_core(static_cast<size_t>(std::max(plan.world_size, 1)), 0.0);
  for (const auto& p : plan.pipelines) {
    const int S = static_cast<int>(p.stages.size());
    for (int j = 0; j < S; ++j) {
      const Stage& s = p.stages[static_cast<size_t>(j)];
      bool crosses = false;
      double link_rate = 1;
      for (int l = s.layer_begin; l < s.layer_end; ++l) {
        if (!links.crosses[static_cast<size_t>(l)]) continue;
        crosses = true;
        link_rate = std::max(link_rate, links.slowest_link[static_cast<size_t>(l)]);
      }
      for (size_t i = 0; i < s.ranks.size(); ++i) {
        const double params = owned_parameters(s, i, j == 0, j == S - 1);
        if (P > 1) {
          const double t = allreduce_time(
              P, params * cluster_.grad_bytes,
              crosses ? cluster_.inter_node_bandwidth / link_rate : cluster_.intra_node_bandwidth,
              crosses ? cluster_.inter_node_latency : cluster_.intra_node_latency);
          out.grad_sync_time = std::max(out.grad_sync_time, t);
        }
        const double rate = rate_of(rates, s.ranks[i]);
        // The distributed optimizer's reduce-scatter and all-gather move what the all-reduce
        // above does; each holder updates 1/P of the parameters.
        const double updated = distributed_optimizer_ && P > 1 ? params / P : params;
        const double opt = updated * 2 * cluster_.state_bytes_per_param /
                           cluster_.memory_bandwidth * (std::isfinite(rate) ? rate : 1.0);
        // Ranks that take turns on a core step their optimizers one after another.
        const auto core = static_cast<size_t>(unit_of(s.ranks[i]));
        if (core >= optimizer_per_core.size()) optimizer_per_core.resize(core + 1, 0.0);
        double& on_core = optimizer_per_core[core];
        on_core += opt;
        out.optimizer_time = std::max(out.optimizer_time, on_core);
      }
    }
  }
}

Prediction CostModel::predict(const Plan& plan, const Rates& rates, bool choose_recompute) const {
  Prediction out;
  out.memory_bytes.resize(static_cast<size_t>(plan.world_size));
  for (int r = 0; r < plan.world_size; ++r) {
    out.memory_bytes[static_cast<size_t>(r)] = idle_memory(r).total();  // until a stage has r
  }
  const int P = static_cast<int>(plan.pipelines.size());
  for (const auto& p : plan.pipelines) {
    out.pipelines.push_back(predict_pipeline(p, P, rates, choose_recompute, out));
    out.pipeline_time = std::max(out.pipeline_time, out.pipelines.back().time);
  }
  if (shared_cores_) {
    // A core computes for one rank at a time: the pipelines take at least the compute of every
    // stage on it, over all pipelines (ranks of different pipelines sharing a core fill each
    // other's waits, but cannot compute at once).
    out.pipeline_time =
        std::max(out.pipeline_time, shared_cores_->busiest_core_compute(plan, out.pipelines));
  }
  predict_sync_and_optimizer(plan, rates, out);
  // A gone device in the plan makes its stage's times infinite, and so the iteration.
  out.iteration_time = out.pipeline_time + out.grad_sync_time + out.optimizer_time;
  return out;
}

void CostModel::write_recompute(Plan& plan, const Prediction& prediction) {
  for (size_t p = 0; p < plan.pipelines.size() && p < prediction.pipelines.size(); ++p) {
    auto& stages = plan.pipelines[p].stages;
    for (size_t j = 0; j < stages.size() && j < prediction.pipelines[p].stages.size(); ++j) {
      stages[j].recompute = prediction.pipelines[p].stages[j].cost.recompute;
      // Ahead of the gradient only what is recomputed.
      if (stages[j].recompute.layers == 0) stages[j].recompute_ahead = false;
    }
  }
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
  // Forward FLOPs of one KV group of heads and of one FFN column: the units shares move in.
  const int b = batch_.micro_batch, s = batch_.seq_len;
  const double attn_unit =
      plan::layer_forward_flops(model_, b, s, Shares{double(group) / model_.num_heads, 0, 0});
  const double ffn_unit =
      plan::layer_forward_flops(model_, b, s, Shares{0, 1.0 / model_.ffn_hidden_size, 0});
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
