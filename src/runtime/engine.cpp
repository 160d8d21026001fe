#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "comm/staging.h"
#include "common/error.h"
#include "layout/migration.h"
#include "layout/redistribution.h"
#include "layout/staged_redistribution.h"
#include "plan/cost_model.h"
#include "runtime/engine_background.h"
#include "runtime/schedule.h"
#include "runtime/step_exchange.h"

namespace malleus::runtime {

namespace {

// An idle rank's probe (plan/memory_model.h). Its matrices are counted in the cost model's memory
// of an idle device (plan::CostModel::idle_memory).
constexpr int kProbeSize = plan::kComputeProbeSize;
constexpr int kProbeRepeats = plan::kComputeProbeRepeats;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int forward_tag(int micro_batch) {
  return 2 * micro_batch;
}
int backward_tag(int micro_batch) {
  return 2 * micro_batch + 1;
}

}  // namespace

Engine::Engine(const model::ModelConfig& model, const plan::Plan& plan, comm::Communicator world,
               const EngineOptions& options)
    : Engine(model, plan, std::move(world), options, false) {}

Engine::Engine(const model::ModelConfig& model, const plan::Plan& plan, comm::Communicator world,
               const EngineOptions& options, bool deferred)
    : model_config_(model),
      options_(options),
      state_(
          std::make_unique<ParallelState>(plan, model, std::move(world), options.core_lease.get())),
      backend_(options.make_backend ? options.make_backend(options.threads)
                                    : backend::make_cpu_backend<float>(options.threads)),
      distributed_optimizer_(layout::splits_moments(plan, options.distributed_optimizer)) {
  check(options.migration_bucket_bytes > 0, "migration_bucket_bytes must be positive, got " +
                                                std::to_string(options.migration_bucket_bytes));
  backend_->allocations().set_deferring(deferred);
  // A device's memory reaches MPI through the communicator's staging (comm/staging.h), and its
  // queued compute is not counted as waiting inside tensor-parallel collectives.
  comm::register_device_memory(backend_->device_memory());
  if (MpiTensorParallelGroup* tp = state_->tensor_parallel()) {
    tp->set_settle([timer = &backend_->region_timer()] { timer->settle(); });
  }
  if (state_->role().idle()) {
    const size_t probe = size_t{kProbeSize} * kProbeSize;
    probe_a_ = backend::Buffer<float>(*backend_, probe, backend::MemoryKind::kWorkspace);
    probe_b_ = backend::Buffer<float>(*backend_, probe, backend::MemoryKind::kWorkspace);
    probe_c_ = backend::Buffer<float>(*backend_, probe, backend::MemoryKind::kWorkspace);
    return;
  }
  const int slots = activation_slots(state_->role().stage, state_->num_stages(),
                                     state_->pipeline().micro_batches);
  model_ = std::make_unique<model::Transformer<float>>(
      model, *state_->shard(), *backend_, plan.micro_batch_size, options.seq_len, slots,
      state_->tensor_parallel(), state_->stage().recompute,
      (options.shifted_recompute || state_->stage().recompute_ahead) && !state_->last_stage());
  model_->set_tp_subpipeline(options.tp_subpipeline);
  if (distributed_optimizer_) {
    shard_ =
        layout::optimizer_shard(state_->grad_sync(), state_->rank(), plan::kGradSyncChunkElements);
    optimizer_ = std::make_unique<AdamW>(*backend_, shard_->elements, options.adamw);
    grad_shard_ = backend::Buffer<float>(*backend_, static_cast<size_t>(shard_->elements),
                                         backend::MemoryKind::kGradients);
  } else {
    optimizer_ = std::make_unique<AdamW>(*backend_, model_->layout().total_size(), options.adamw);
  }
  const size_t tokens = static_cast<size_t>(plan.micro_batch_size) * options.seq_len;
  inputs_.resize(tokens);
  targets_.resize(tokens);
  // The cost model's FLOP count of this rank's shard: what its measured time is divided by.
  work_flops_ =
      plan::work_flops(plan, model, options.seq_len).at(static_cast<size_t>(state_->rank()));
}

void Engine::init_parameters(uint64_t seed) {
  if (model_) model_->init_parameters(seed);
}

void Engine::zero_grads() {
  if (model_) model_->zero_grads();
}

template <typename Section>
double Engine::timed(Section&& section, double slowdown) {
  CoreLease::Hold turn(lease());  // waiting for a turn on the core is not computing
  if (!options_.measure && slowdown == 1) {
    section();
    return 0;
  }
  const auto* tp = state_->tensor_parallel();
  const double waited_before = tp ? tp->wait_seconds() : 0;
  // The backend's timer: the host's clock on the CPU, the device's events on a GPU.
  backend::RegionTimer& timer = backend_->region_timer();
  timer.begin();
  section();
  auto compute = [&] {
    const double waited = (tp ? tp->wait_seconds() : 0) - waited_before;
    return std::max(0.0, timer.elapsed() - waited);
  };
  // The extra work runs on the device, after the section's: the timer counts it (a GPU's events
  // would not see the host spinning).
  if (slowdown > 1) timer.keep_busy((slowdown - 1) * compute());
  return compute();
}

// A fixed piece of work for a rank without work under the current plan, so that it keeps
// measuring its device and is seen when it recovers.
double Engine::run_probe(double slowdown, double* seconds) {
  *seconds += timed(
      [&] {
        for (int i = 0; i < kProbeRepeats; ++i) {
          backend_->matmul_forward(probe_c_.data(), probe_a_.data(), probe_b_.data(), kProbeSize,
                                   kProbeSize, kProbeSize);
        }
      },
      slowdown);
  return plan::kComputeProbeFlops;
}

StepResult Engine::step(const SampleFn& sample, float lr, float grad_clip, double slowdown,
                        const std::function<void()>& before_update) {
  check(slowdown >= 1, "an injected slowdown must be at least 1");
  StepResult result;
  const int64_t global_tokens = int64_t{state_->plan().global_batch()} * options_.seq_len;
  if (!before_update) release_local_state();  // moments lent out since the last step
  backend::memory_ledger().reset_peak();      // this step's peak, measured from here
  double loss_sum = 0;
  if (model_) {
    loss_sum = run_pipeline(sample, 1.0f / static_cast<float>(global_tokens), slowdown, &result);
    result.flops = work_flops_;
  } else {
    result.flops = run_probe(slowdown, &result.compute_seconds);
    poll_background();
  }
  exchange_figures(loss_sum, global_tokens, &result);
  const double clip =
      grad_clip > 0 && result.grad_norm > grad_clip ? grad_clip / result.grad_norm : 1.0;
  if (before_update) {
    before_update();
    release_local_state();
  }
  finish_background();  // an overlapped switch's moments, which the update reads
  // A loss or gradient norm that is not finite (the same on every rank) would make every
  // parameter NaN: such a step updates nothing, and the caller decides what to do (Trainer::run
  // stops).
  if (std::isfinite(result.loss) && std::isfinite(result.grad_norm)) {
    update(lr, static_cast<float>(clip), slowdown);
    host_copy_.fresh = false;
  }
  ++steps_done_;
  return result;
}

double Engine::run_pipeline(const SampleFn& sample, float loss_scale, double slowdown,
                            StepResult* result) {
  ParallelState& st = *state_;
  zero_grads();
  const int micro_batches = st.pipeline().micro_batches, b = st.plan().micro_batch_size;
  const int seq = options_.seq_len;
  const int slots = model_->slots();
  const bool sender = st.role().tp_rank == 0;  // one rank per stage talks to the neighbours
  // A slot's output may still be on its way to the next stage when the slot is reused; the
  // input gradient likewise until the next backward overwrites it.
  std::vector<std::vector<comm::Request>> forward_sends(static_cast<size_t>(slots));
  std::vector<comm::Request> backward_sends;
  double loss_sum = 0;
  auto fill = [&](int micro_batch) {
    for (int i = 0; i < b; ++i) {
      sample(st.first_sample() + micro_batch * b + i, inputs_.data() + size_t(i) * seq,
             targets_.data() + size_t(i) * seq);
    }
  };
  for (const PipelineOp& op : one_f_one_b(st.role().stage, st.num_stages(), micro_batches)) {
    const int j = op.micro_batch, slot = j % slots;
    if (op.kind == PipelineOp::kForward) {
      wait_all(forward_sends[static_cast<size_t>(slot)], lease());
      if (st.first_stage() || st.last_stage()) fill(j);
      receive_input(slot, j);
      double loss = 0;
      result->compute_seconds +=
          timed([&] { loss = model_->forward(slot, inputs_.data(), targets_.data()); }, slowdown);
      if (st.last_stage() && sender) loss_sum += loss;
      send_output(slot, j, &forward_sends[static_cast<size_t>(slot)]);
    } else {
      wait_all(backward_sends, lease());
      if (!st.last_stage()) receive_output_grad(slot, j, slowdown, result);
      result->compute_seconds += timed([&] { model_->backward(slot, loss_scale); }, slowdown);
      if (!st.first_stage() && sender) {
        for (int r : st.previous_stage_ranks()) {
          backward_sends.push_back(
              st.world().isend(model_->input_grad(), activation_bytes(), r, backward_tag(j)));
        }
      }
    }
    poll_background();
  }
  for (auto& sends : forward_sends) wait_all(sends, lease());
  wait_all(backward_sends, lease());
  return loss_sum;
}

void Engine::receive_output_grad(int slot, int micro_batch, double slowdown, StepResult* result) {
  ParallelState& st = *state_;
  comm::Request gradient =
      st.world().irecv(model_->output_grad(), activation_bytes(), st.next_stage_ranks().front(),
                       backward_tag(micro_batch));
  if (model_->recomputes_ahead() && model_->recompute().layers > 0) {
    // The shifted critical path: recompute while the gradient is on its way. Between blocks,
    // test the receive: a large message completes only when the receiver enters MPI
    // (rendezvous), and until then the sender cannot reuse its buffer for its next backward. The
    // first test that finds the gradient there says how long it was away.
    const auto start = Clock::now();
    double arrived_after = -1;
    const double seconds = timed(
        [&] {
          model_->recompute_ahead(slot, [&] {
            if (arrived_after < 0 && gradient.test()) arrived_after = seconds_since(start);
          });
        },
        slowdown);
    result->compute_seconds += seconds;
    result->recompute_ahead_seconds += seconds;
    result->recompute_overlapped_seconds +=
        arrived_after < 0 ? seconds : std::min(seconds, arrived_after);
  }
  wait(gradient, lease());
}

void Engine::exchange_figures(double loss_sum, int64_t global_tokens, StepResult* result) {
  comm::Communicator& world = state_->world();
  StepExchange figures(static_cast<size_t>(world.size()));
  figures.loss_sum = loss_sum;
  {
    // Packing gradients and summing squares is computing too: on a shared core, in turn.
    CoreLease::Hold turn(lease());
    if (model_) sync_gradients();
    figures.norm_squares = local_norm_squares();
    if (options_.measure && !options_.hosts.empty()) {
      std::tie(result->link_seconds, result->link_bytes) = probe_links();
    }
  }
  StepExchange::RankFigures& mine = figures.ranks[static_cast<size_t>(world.rank())];
  mine.compute_seconds = result->compute_seconds;
  mine.flops = result->flops;
  mine.link_seconds = result->link_seconds;
  mine.link_bytes = result->link_bytes;
  mine.peak_memory = backend::memory_ledger().peak();
  mine.peak_memory_total = double(backend::memory_ledger().peak_total());
  mine.recompute_ahead_seconds = result->recompute_ahead_seconds;
  mine.recompute_overlapped_seconds = result->recompute_overlapped_seconds;
  std::vector<double> packed = figures.pack();
  all_reduce_sum(world, packed.data(), packed.size(), lease());
  figures.unpack(packed);
  result->loss = figures.loss_sum / static_cast<double>(global_tokens);
  result->grad_norm = std::sqrt(figures.norm_squares);
  for (const StepExchange::RankFigures& rank : figures.ranks) {
    result->measurements.insert(result->measurements.end(), {rank.compute_seconds, rank.flops});
    result->link_measurements.insert(result->link_measurements.end(),
                                     {rank.link_seconds, rank.link_bytes});
    result->peak_memory.push_back(rank.peak_memory);
    result->peak_memory_total.push_back(rank.peak_memory_total);
    result->recompute_ahead_measurements.insert(
        result->recompute_ahead_measurements.end(),
        {rank.recompute_ahead_seconds, rank.recompute_overlapped_seconds});
  }
}

void Engine::update(float lr, float clip, double slowdown) {
  if (!optimizer_) return;
  // Not a section the monitor times (its cost does not scale with the plan's work), but an
  // emulated slow device is slow here too.
  CoreLease::Hold turn(lease());
  backend::RegionTimer& timer = backend_->region_timer();
  if (slowdown > 1) timer.begin();
  double waited = 0;
  if (shard_) {
    waited = distributed_update(lr, clip, slowdown > 1);
  } else {
    optimizer_->step(model_->layout(), model_->params(), model_->grads(), lr, clip);
  }
  // Slowed by its own compute only: the all-gathers' waits are not the device's (a peer late to
  // one, or a lossy link's resend, would come back (slowdown − 1) times over).
  if (slowdown > 1) timer.keep_busy((slowdown - 1) * std::max(0.0, timer.elapsed() - waited));
}

size_t Engine::activation_bytes() const {
  return static_cast<size_t>(state_->plan().micro_batch_size) * options_.seq_len *
         model_config_.hidden_size * sizeof(float);
}

void Engine::receive_input(int slot, int micro_batch) {
  if (state_->first_stage()) return;
  comm::Request input =
      state_->world().irecv(model_->input_activation(slot), activation_bytes(),
                            state_->previous_stage_ranks().front(), forward_tag(micro_batch));
  wait(input, lease());
}

void Engine::send_output(int slot, int micro_batch, std::vector<comm::Request>* sends) {
  if (state_->last_stage() || state_->role().tp_rank != 0) return;
  for (int r : state_->next_stage_ranks()) {
    sends->push_back(state_->world().isend(model_->output_activation(slot), activation_bytes(), r,
                                           forward_tag(micro_batch)));
  }
}

double Engine::evaluate(const SampleFn& sample, int count) {
  check(count > 0, "evaluation needs at least one sequence");
  ParallelState& st = *state_;
  const int b = st.plan().micro_batch_size, seq = options_.seq_len;
  double loss_sum = 0;
  if (model_) {
    const int micro_batches = (count + b - 1) / b;
    const int pipelines = static_cast<int>(st.plan().pipelines.size());
    const bool sender = st.role().tp_rank == 0;
    std::vector<comm::Request> sends;
    for (int j = st.role().pipeline; j < micro_batches; j += pipelines) {
      comm::Request::wait_all(sends);
      // A last partial micro-batch repeats the final sequence; the copies are not counted.
      for (int i = 0; i < b; ++i) {
        sample(std::min(j * b + i, count - 1), inputs_.data() + size_t(i) * seq,
               targets_.data() + size_t(i) * seq);
      }
      receive_input(0, j);
      model_->forward(0, inputs_.data(), targets_.data());
      if (st.last_stage() && sender) {
        const std::vector<float> losses = model_->token_losses(0);
        const int valid = std::min(b, count - j * b);
        for (size_t t = 0; t < static_cast<size_t>(valid) * seq; ++t) loss_sum += losses[t];
      }
      send_output(0, j, &sends);
    }
    comm::Request::wait_all(sends);
  }
  return st.world().all_reduce_sum(loss_sum) / (static_cast<double>(count) * seq);
}

namespace {

// The parts of a chunk cut among its group's members, as the uneven collectives take them.
void slice_parts(const layout::ShardChunk& chunk, std::vector<int>* counts,
                 std::vector<int>* displacements) {
  counts->clear();
  displacements->clear();
  for (size_t i = 0; i + 1 < chunk.bounds.size(); ++i) {
    counts->push_back(static_cast<int>(chunk.bounds[i + 1] - chunk.bounds[i]));
    displacements->push_back(static_cast<int>(chunk.bounds[i]));
  }
}

}  // namespace

// Sums every gradient piece over its holders: one all-reduce per holder set, pieces packed (with
// the distributed optimizer a reduce-scatter, each member keeping the sum of its slice in
// grad_shard_). Replicated copies beyond the first of each tensor-parallel group add zero, so
// each pipeline counts once.
void Engine::sync_gradients() {
  ParallelState& st = *state_;
  const auto& sync = st.grad_sync();
  const int me = st.rank();
  // Packs pieces [begin, end) of `ids` into the pack buffer: this rank's gradient, or zeros where
  // another holder of the same replica group contributes.
  auto pack = [&](const std::vector<int>& ids, size_t begin, size_t end, float* cursor) {
    for (size_t i = begin; i < end; ++i) {
      const auto& piece = sync.pieces[static_cast<size_t>(ids[i])];
      if (layout::contributes(piece, me)) {
        layout::pack_piece(*backend_, model_->grads(), my_part(piece), piece.piece, cursor);
      } else {
        backend_->fill_zero(cursor, static_cast<size_t>(piece.elements));
      }
      cursor += piece.elements;
    }
  };
  if (shard_) {
    std::vector<int> counts, displacements;
    for (const layout::ShardChunk& chunk : shard_->chunks) {
      float* summed = grad_shard_.data() + chunk.shard_offset;
      if (chunk.group < 0) {  // held by this rank alone: its gradient is the sum
        pack(chunk.pieces, 0, chunk.pieces.size(), summed);
        continue;
      }
      float* packed = pack_buffer(static_cast<size_t>(chunk.elements));
      pack(chunk.pieces, 0, chunk.pieces.size(), packed);
      slice_parts(chunk, &counts, &displacements);
      reduce_scatter_sum(st.grad_sync_comm(static_cast<size_t>(chunk.group)), packed, summed,
                         counts, lease());
    }
    return;
  }
  for (size_t g = 0; g < sync.groups.size(); ++g) {
    const auto& group = sync.groups[g];
    if (std::find(group.ranks.begin(), group.ranks.end(), me) == group.ranks.end()) continue;
    // In chunks of at most plan::kGradSyncChunkElements (a piece larger than that alone), so the
    // packing buffer stays bounded however much the rank holds.
    const auto& ids = group.pieces;
    for (const auto& [begin, end] : layout::pack_chunks(sync, ids, plan::kGradSyncChunkElements)) {
      int64_t elements = 0;
      for (size_t i = begin; i < end; ++i) elements += sync.pieces[size_t(ids[i])].elements;
      pack(ids, begin, end, pack_buffer(static_cast<size_t>(elements)));
      all_reduce_sum(st.grad_sync_comm(g), pack_buffer_.data(), pack_size_, lease());
      const float* cursor = pack_buffer_.data();
      for (size_t i = begin; i < end; ++i) {
        const auto& piece = sync.pieces[static_cast<size_t>(ids[i])];
        layout::unpack_piece(*backend_, cursor, my_part(piece), piece.piece, model_->grads());
        cursor += piece.elements;
      }
    }
  }
}

std::pair<double, double> Engine::probe_links() {
  comm::Communicator& world = state_->world();
  const std::vector<int>& hosts = options_.hosts;
  const int me = world.rank();
  const std::vector<int> leaders = host_leaders(hosts);
  const int my_host = hosts[static_cast<size_t>(me)];
  if (leaders[static_cast<size_t>(my_host)] != me) return {0, 0};
  // The host's leader exchanges kLinkProbeElements floats each way with every other host's
  // leader, one partner per round of a fixed schedule, waiting in MPI's own blocking wait: a
  // leader that slept between polls read the scheduler's delays, not the link (on a busy
  // machine, 20-60 times the transfer). It gives its turn on the core back first: a leader
  // holding it while waiting for another host's leader deadlocked a job whose emulated hosts'
  // ranks share the machine's cores (the other leader waited for the turn). Each exchange is
  // timed after the pair met (an untimed one-byte exchange), twice, the faster counted; the
  // leader reports the fastest of its exchanges: every exchange runs at the pace of the slower
  // of the two links, so a host whose link is healthy has a fast one, and only a slow host's
  // are all slow.
  CoreLease::Gap gap(lease());
  const size_t elements = static_cast<size_t>(plan::kLinkProbeElements);
  // The link's bytes, from host memory: the packing buffer where the backend's memory is the
  // host's, else a host buffer of the probe's own (staging a device's would time its copies too).
  std::vector<float> host_probe;
  backend::MemoryBooking host_probe_booking;
  float* buffer = nullptr;
  if (backend_->device_memory()) {
    host_probe.assign(2 * elements, 0.0f);
    host_probe_booking = backend::MemoryBooking(backend::MemoryKind::kCommunication,
                                                int64_t(2 * elements * sizeof(float)));
    buffer = host_probe.data();
  } else {
    buffer = pack_buffer(2 * elements);
    std::fill_n(buffer, 2 * elements, 0.0f);
  }
  const size_t bytes = elements * sizeof(float);
  constexpr int kProbeTag = 32000;  // above any micro-batch's activation tags
  double fastest = std::numeric_limits<double>::infinity();
  const int host_count = static_cast<int>(leaders.size());
  for (int round = 0; round < plan::link_probe_rounds(host_count); ++round) {
    const int partner_host = plan::link_probe_partner(host_count, round, my_host);
    if (partner_host < 0) continue;  // a bye (an odd number of hosts)
    const int partner = leaders[static_cast<size_t>(partner_host)];
    char sent = 0, received = 0;
    std::vector<comm::Request> meet;
    meet.push_back(world.irecv(&received, 1, partner, kProbeTag));
    meet.push_back(world.isend(&sent, 1, partner, kProbeTag));
    comm::Request::wait_all(meet);
    for (int i = 0; i < 2; ++i) {
      const auto start = Clock::now();
      std::vector<comm::Request> exchange;
      exchange.push_back(world.irecv(buffer + elements, bytes, partner, kProbeTag));
      exchange.push_back(world.isend(buffer, bytes, partner, kProbeTag));
      comm::Request::wait_all(exchange);
      fastest = std::min(fastest, seconds_since(start));
    }
  }
  if (!std::isfinite(fastest)) return {0, 0};  // one host: nothing crossed a link
  return {fastest, static_cast<double>(bytes)};
}

// Each rank updates its slice of every chunk (parameters packed as the gradients were, moments
// and summed gradients from its shard), range by range within tensors, so norm gains keep their
// exemption from weight decay; then the members gather each other's slices.
double Engine::distributed_update(float lr, float grad_scale, bool time_waits) {
  const auto& sync = state_->grad_sync();
  double waited = 0;
  optimizer_->begin_step();
  std::vector<int> counts, displacements;
  for (const layout::ShardChunk& chunk : shard_->chunks) {
    float* packed = pack_buffer(static_cast<size_t>(chunk.elements));
    int64_t at = 0;
    for (int p : chunk.pieces) {
      const auto& piece = sync.pieces[static_cast<size_t>(p)];
      const int64_t begin = std::max(at, chunk.slice_begin());
      const int64_t end = std::min(at + piece.elements, chunk.slice_end());
      if (begin < end) {
        const model::TensorSpec& part = my_part(piece);
        layout::pack_piece(*backend_, model_->params(), part, piece.piece, packed + at);
        const int64_t offset = chunk.shard_offset + (begin - chunk.slice_begin());
        optimizer_->update(packed + begin, grad_shard_.data() + offset, offset, end - begin,
                           part.weight_decay, lr, grad_scale);
      }
      at += piece.elements;
    }
    if (chunk.group >= 0) {
      slice_parts(chunk, &counts, &displacements);
      // The update's compute queued so far is not waiting: settled first (a device sync, so only
      // where the waits are asked for).
      if (time_waits) backend_->region_timer().settle();
      const auto start = std::chrono::steady_clock::now();
      all_gather_in_place(state_->grad_sync_comm(static_cast<size_t>(chunk.group)), packed, counts,
                          displacements, lease());
      if (time_waits) {
        waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    }
    at = 0;
    for (int p : chunk.pieces) {
      const auto& piece = sync.pieces[static_cast<size_t>(p)];
      layout::unpack_piece(*backend_, packed + at, my_part(piece), piece.piece, model_->params());
      at += piece.elements;
    }
  }
  return waited;
}

float* Engine::pack_buffer(size_t elements) {
  if (elements > pack_buffer_.size()) {
    // As std::vector::resize grows: to twice the size asked for last, or what is asked if more.
    const size_t capacity = std::max(2 * pack_size_, elements);
    pack_buffer_ = {};
    pack_buffer_ = backend::Buffer<float>(*backend_, capacity, backend::MemoryKind::kCommunication);
  }
  pack_size_ = elements;
  return pack_buffer_.data();
}

const model::TensorSpec& Engine::my_part(const layout::RefinedPiece& piece) const {
  return model_->layout().tensor(
      layout::find_holder(piece.holders[0], state_->rank())->local_tensor);
}

// Σ g² over the pieces this rank counts, so the global norm sees every element exactly once.
double Engine::local_norm_squares() {
  if (!model_) return 0;
  // Every element of the shards once: each holder set's sums cut among its members, and the
  // pieces held alone.
  if (shard_) return backend_->sum_squares(grad_shard_.data(), grad_shard_.size());
  const auto& sync = state_->grad_sync();
  const int me = state_->rank();
  double sum = 0;
  for (const auto& piece : sync.pieces) {
    if (layout::norm_owner(piece) != me) continue;
    layout::pack_piece(*backend_, model_->grads(), my_part(piece), piece.piece,
                       pack_buffer(static_cast<size_t>(piece.elements)));
    sum += backend_->sum_squares(pack_buffer_.data(), pack_size_);
  }
  return sum;
}

// Parameters and Adam moments from this engine's buffers into `next`'s, band by band: each band of
// `next`'s state is booked as it arrives and each of this engine's is given back once sent.
int64_t Engine::move_state(Engine& next, const layout::StagedRedistribution& staged,
                           const std::vector<layout::StateKind>& kinds) {
  const auto me = static_cast<size_t>(state_->rank());
  std::vector<layout::KindState<const float>> from(kinds.size());
  std::vector<layout::KindState<float>> to(kinds.size());
  std::vector<std::vector<float*>> old_buffers(kinds.size());  // given back band by band
  for (size_t k = 0; k < kinds.size(); ++k) {
    old_buffers[k] = state_buffers(static_cast<int>(k));
    from[k] = {&kinds[k].from[me],
               {old_buffers[k].begin(), old_buffers[k].end()},
               backend_->device_memory().get()};
    to[k] = {&kinds[k].to[me], next.state_buffers(static_cast<int>(k)),
             next.backend_->device_memory().get()};
  }
  layout::StateMemory memory;
  memory.commit = [&](int kind, int64_t offset, int64_t count) {
    for (float* buffer : to[size_t(kind)].buffers) {
      next.backend_->commit_range(buffer + offset, size_t(count));
    }
  };
  memory.release = [&](int kind, int64_t offset, int64_t count) {
    for (float* buffer : old_buffers[size_t(kind)]) {
      backend_->decommit_range(buffer + offset, size_t(count));
    }
  };
  return layout::redistribute_staged<float>(staged, state_->world(), from, to, memory);
}

int64_t Engine::move_kind(Engine& next, const layout::StagedRedistribution& staged,
                          const layout::StateKind& kind, int which) {
  const auto me = static_cast<size_t>(state_->rank());
  const std::vector<float*> old_buffers = state_buffers(which),
                            new_buffers = next.state_buffers(which);
  const std::vector<layout::KindState<const float>> from{
      {&kind.from[me], {old_buffers.begin(), old_buffers.end()}, backend_->device_memory().get()}};
  const std::vector<layout::KindState<float>> to{
      {&kind.to[me], new_buffers, next.backend_->device_memory().get()}};
  layout::StateMemory memory;
  memory.commit = [&](int, int64_t offset, int64_t count) {
    for (float* buffer : new_buffers) next.backend_->commit_range(buffer + offset, size_t(count));
  };
  memory.release = [&](int, int64_t offset, int64_t count) {
    for (float* buffer : old_buffers) backend_->decommit_range(buffer + offset, size_t(count));
  };
  return layout::redistribute_staged<float>(staged, state_->world(), from, to, memory);
}

std::vector<float*> Engine::state_buffers(int which) const {
  if (which == 0) return model_ ? std::vector<float*>{model_->params()} : std::vector<float*>{};
  if (!optimizer_) return {};  // idle, or (moments) none
  return {optimizer_->first_moment(), optimizer_->second_moment()};
}

std::vector<layout::StateKind> Engine::migrated_kinds(const Engine& next) const {
  return layout::migrated_state(
      model_config_, state_->layout(), distributed_optimizer_ ? &state_->grad_sync() : nullptr,
      next.state_->layout(), next.distributed_optimizer_ ? &next.state_->grad_sync() : nullptr);
}

void Engine::give_back_working_memory() {
  for (auto kind : {backend::MemoryKind::kGradients, backend::MemoryKind::kActivations,
                    backend::MemoryKind::kWorkspace}) {
    backend_->decommit_all(kind);
  }
  pack_buffer_ = {};
  pack_size_ = 0;
}

std::unique_ptr<Engine> Engine::migrate(const plan::Plan& plan, MigrationStats* stats) {
  finish_background();
  const auto start = std::chrono::steady_clock::now();
  backend::MemoryLedger& ledger = backend::memory_ledger();
  const int64_t total_before = ledger.current().total();
  // Only the state moves: what the next step recomputes goes first.
  give_back_working_memory();
  // The memory only falls until the state moves, and after it only rises to the new engine's
  // total: the peak is the state move's.
  ledger.reset_peak();
  const int64_t state_before = ledger.current().total();
  std::unique_ptr<Engine> next(new Engine(model_config_, plan, state_->world(), options_, true));
  // Parameters between the local layouts; Adam moments between where each side keeps them (each
  // rank's optimizer shard, or the local layout), straight from slice to slice: nothing gathered.
  const auto moves =
      layout::plan_redistribution(model_config_, state_->layout(), next->state_->layout());
  const auto kinds = migrated_kinds(*next);
  const auto staged =
      layout::stage_redistribution(model_config_, moves, kinds, options_.migration_bucket_bytes);
  const int64_t received = move_state(*next, staged, kinds);
  const int64_t state_peak = ledger.peak_total(), state_after = ledger.current().total();
  next->set_steps_done(steps_done_);
  // This engine's memory goes before the new one books the rest of its own.
  optimizer_.reset();
  model_.reset();
  probe_a_ = {};
  probe_b_ = {};
  probe_c_ = {};
  next->backend_->allocations().commit_all();
  const int64_t total_after = ledger.current().total();
  if (stats != nullptr) {
    comm::Communicator& world = state_->world();
    stats->bytes_received = received;
    stats->bytes_moved = world.all_reduce_sum(received);
    auto most = [&](int64_t bytes) {
      return static_cast<int64_t>(
          world.all_reduce_max(static_cast<double>(std::max<int64_t>(0, bytes))));
    };
    stats->peak_extra_bytes = most(state_peak - std::max(total_before, total_after));
    stats->state_extra_bytes = most(state_peak - std::max(state_before, state_after));
    stats->predicted_extra_bytes =
        *std::max_element(staged.predicted_extra_bytes.begin(), staged.predicted_extra_bytes.end());
    stats->seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return next;
}

HeldState Engine::held_state() {
  finish_background();
  if (!model_) return {};
  if (moment_blocks_.empty()) {
    const model::ParameterLayout full(model_config_);
    moment_blocks_ = shard_ ? layout::shard_blocks(full, state_->grad_sync(), *shard_)
                            : layout::local_blocks(full, model_->layout());
  }
  if (!backend_->device_memory()) {
    return {
        &model_->layout(),           model_->params(),  &moment_blocks_, optimizer_->first_moment(),
        optimizer_->second_moment(), shard_.has_value()};
  }
  copy_state_to_host();
  return {&model_->layout(),        host_copy_.params.data(), &moment_blocks_,
          host_copy_.adam_m.data(), host_copy_.adam_v.data(), shard_.has_value()};
}

// The state into host_copy_, unless it holds it already.
void Engine::copy_state_to_host() {
  const DeviceMemory& memory = *backend_->device_memory();
  const size_t params = static_cast<size_t>(model_->layout().total_size());
  const size_t moments = static_cast<size_t>(optimizer_->elements());
  if (host_copy_.params.size() != params) host_copy_.params = PageBuffer<float>(params);
  if (host_copy_.adam_m.size() != moments) {
    host_copy_.adam_m = PageBuffer<float>(moments);
    host_copy_.adam_v = PageBuffer<float>(moments);
    host_copy_.fresh = false;
  }
  if (host_copy_.fresh) return;
  memory.to_host(host_copy_.params.data(), model_->params(), params * sizeof(float));
  memory.to_host(host_copy_.adam_m.data(), optimizer_->first_moment(), moments * sizeof(float));
  memory.to_host(host_copy_.adam_v.data(), optimizer_->second_moment(), moments * sizeof(float));
  host_copy_.fresh = true;
}

void Engine::restore_held_state(const std::function<void(const HeldState&)>& write) {
  const HeldState held = held_state();
  write(held);
  if (!backend_->device_memory() || held.layout == nullptr) return;
  const DeviceMemory& memory = *backend_->device_memory();
  memory.from_host(model_->params(), held.params, host_copy_.params.size() * sizeof(float));
  memory.from_host(optimizer_->first_moment(), held.adam_m,
                   host_copy_.adam_m.size() * sizeof(float));
  memory.from_host(optimizer_->second_moment(), held.adam_v,
                   host_copy_.adam_v.size() * sizeof(float));
  host_copy_.fresh = true;  // the device now holds what the copy holds
}

layout::LocalState<float> Engine::local_state() {
  finish_background();
  layout::LocalState<float> state = writable_local_state();
  if (!shard_) return state;
  // Each member's slices of the moments to every member of its holder sets, unpacked into the
  // local layout.
  const auto& sync = state_->grad_sync();
  std::vector<int> counts, displacements;
  for (const layout::ShardChunk& chunk : shard_->chunks) {
    for (auto [moment, staged] : {std::pair{optimizer_->first_moment(), staged_m_.data()},
                                  std::pair{optimizer_->second_moment(), staged_v_.data()}}) {
      float* packed = pack_buffer(static_cast<size_t>(chunk.elements));
      backend_->copy(packed + chunk.slice_begin(), moment + chunk.shard_offset,
                     static_cast<size_t>(chunk.slice_elements()));
      if (chunk.group >= 0) {
        slice_parts(chunk, &counts, &displacements);
        all_gather_in_place(state_->grad_sync_comm(static_cast<size_t>(chunk.group)), packed,
                            counts, displacements, lease());
      }
      int64_t at = 0;
      for (int p : chunk.pieces) {
        const auto& piece = sync.pieces[static_cast<size_t>(p)];
        layout::unpack_piece(*backend_, packed + at, my_part(piece), piece.piece, staged);
        at += piece.elements;
      }
    }
  }
  return state;
}

layout::LocalState<float> Engine::writable_local_state() {
  finish_background();
  if (!model_) return {};
  const DeviceMemory* memory = backend_->device_memory().get();
  if (!shard_) {
    return {&model_->layout(),
            {model_->params(), optimizer_->first_moment(), optimizer_->second_moment()},
            memory};
  }
  const size_t total = static_cast<size_t>(model_->layout().total_size());
  if (staged_m_.size() != total) {
    staged_m_ = backend::Buffer<float>(*backend_, total, backend::MemoryKind::kOptimizer);
    staged_v_ = backend::Buffer<float>(*backend_, total, backend::MemoryKind::kOptimizer);
  }
  return {&model_->layout(), {model_->params(), staged_m_.data(), staged_v_.data()}, memory};
}

void Engine::commit_local_state() {
  host_copy_.fresh = false;  // written through writable_local_state()
  if (!shard_ || staged_m_.size() == 0) return;
  const auto& sync = state_->grad_sync();
  for (const layout::ShardChunk& chunk : shard_->chunks) {
    for (auto [moment, staged] : {std::pair{optimizer_->first_moment(), staged_m_.data()},
                                  std::pair{optimizer_->second_moment(), staged_v_.data()}}) {
      float* packed = pack_buffer(static_cast<size_t>(chunk.elements));
      int64_t at = 0;
      for (int p : chunk.pieces) {
        const auto& piece = sync.pieces[static_cast<size_t>(p)];
        if (at < chunk.slice_end() && chunk.slice_begin() < at + piece.elements) {
          layout::pack_piece(*backend_, staged, my_part(piece), piece.piece, packed + at);
        }
        at += piece.elements;
      }
      backend_->copy(moment + chunk.shard_offset, packed + chunk.slice_begin(),
                     static_cast<size_t>(chunk.slice_elements()));
    }
  }
  release_local_state();
}

void Engine::release_local_state() {
  staged_m_ = {};
  staged_v_ = {};
}

void Engine::set_steps_done(int64_t steps) {
  steps_done_ = steps;
  host_copy_.fresh = false;
  if (optimizer_) optimizer_->set_steps_done(steps);
}

FullState Engine::gather(int root) {
  finish_background();
  ParallelState& st = *state_;
  const auto checkpoint = layout::single_owner_layout(model_config_, st.world().size(), root);
  const auto plan = layout::plan_redistribution(model_config_, st.layout(), checkpoint);
  FullState full;
  std::optional<model::ParameterLayout> full_layout;
  layout::LocalState<float> to;
  if (st.rank() == root) {
    full_layout.emplace(model_config_);
    const size_t total = static_cast<size_t>(full_layout->total_size());
    full.params.assign(total, 0.0f);
    full.adam_m.assign(total, 0.0f);
    full.adam_v.assign(total, 0.0f);
    to = {&*full_layout, {full.params.data(), full.adam_m.data(), full.adam_v.data()}};
  }
  layout::redistribute<float>(plan, st.world(), layout::read_only(local_state()), to);
  release_local_state();
  return full;
}

void Engine::scatter(const FullState& full, int64_t steps_done, int root) {
  finish_background();
  ParallelState& st = *state_;
  const auto checkpoint = layout::single_owner_layout(model_config_, st.world().size(), root);
  const auto plan = layout::plan_redistribution(model_config_, checkpoint, st.layout());
  std::optional<model::ParameterLayout> full_layout;
  layout::LocalState<const float> from;
  if (st.rank() == root) {
    full_layout.emplace(model_config_);
    check(full.params.size() == static_cast<size_t>(full_layout->total_size()) &&
              full.adam_m.size() == full.params.size() && full.adam_v.size() == full.params.size(),
          "model state does not match the model's parameter layout");
    from = {&*full_layout, {full.params.data(), full.adam_m.data(), full.adam_v.data()}};
  }
  layout::redistribute<float>(plan, st.world(), from, writable_local_state());
  commit_local_state();
  set_steps_done(steps_done);
}

}  // namespace malleus::runtime
