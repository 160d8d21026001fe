#include "checkpoint/memory_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <numeric>

#include "checkpoint/checkpoint_detail.h"
#include "common/checksum.h"
#include "common/error.h"
#include "common/files.h"

namespace malleus::checkpoint {

using namespace detail;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One MPI message at most this long (Communicator's limit is INT_MAX bytes).
constexpr int64_t kChunkBytes = int64_t{1} << 30;
constexpr int kSizesTag = 7101, kEntryTag = 7102, kDataTag = 7103;

// The step of a directory named by checkpoint_dir ("step_00000012"), or nothing.
std::optional<int64_t> step_of(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return std::nullopt;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(name.substr(5));
}

// Every rank learns whether any rank failed, and the first failing rank's message.
void agree(const comm::Communicator& world, const std::string& error) {
  if (world.all_reduce_sum(int64_t{error.empty() ? 0 : 1}) == 0) return;
  std::string first;
  for (const std::string& e : world.gather_text(error, 0)) {
    if (first.empty()) first = e;
  }
  throw Error(world.broadcast_text(first, 0));
}

std::string attempt(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Writes `bytes` bytes of `data` as `dir`/`entry`'s file, atomically; nothing for an empty entry.
void write_copy(const fs::path& dir, const Json& entry, const void* data, int64_t bytes) {
  if (!entry.contains("file")) return;
  check(entry.at("bytes").get<int64_t>() == bytes,
        "memory checkpoint " + dir.string() + ": " + entry.at("file").get<std::string>() +
            " arrived with " + std::to_string(bytes) + " bytes, its entry says " +
            entry.at("bytes").dump());
  AtomicFile file(dir / entry.at("file").get<std::string>());
  file.write(data, static_cast<size_t>(bytes));
  file.commit();
}

// Removes `root` and everything under it. Ranks that share /dev/shm (emulated hosts, or a job
// whose host leaders see one memory) may remove the same tree at once: an entry another rank
// removed first is not an error, a tree still there afterwards is.
void remove_tree(const fs::path& root) {
  std::error_code ec;
  for (int attempt = 0; attempt < 3; ++attempt) {
    fs::remove_all(root, ec);
    if (ec != std::errc::no_such_file_or_directory) break;
  }
  if (ec == std::errc::no_such_file_or_directory) ec.clear();
  check(!ec && !fs::exists(root), "cannot remove the memory checkpoints " + root.string() + ": " +
                                      (ec ? ec.message() : "still there"));
}

}  // namespace

fs::path memory_checkpoint_base() {
  const char* dir = std::getenv("MALLEUS_MEMORY_CHECKPOINT_DIR");
  return dir != nullptr && *dir != '\0' ? fs::path(dir) : fs::path("/dev/shm");
}

fs::path memory_checkpoint_root(const fs::path& run_dir) {
  std::error_code ec;
  fs::path absolute = fs::weakly_canonical(fs::absolute(run_dir), ec);
  if (ec) absolute = fs::absolute(run_dir).lexically_normal();
  const std::string text = normalized(absolute).string();
  return memory_checkpoint_base() / ("malleus-" + checksum_hex(text.data(), text.size()));
}

std::optional<fs::path> latest_memory_checkpoint(const fs::path& run_dir) {
  const fs::path root = memory_checkpoint_root(run_dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return std::nullopt;
  std::optional<fs::path> newest;
  int64_t newest_step = -1;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = step_of(entry.path());
    if (!step || *step <= newest_step) continue;
    if (!fs::is_regular_file(entry.path() / kManifest, ec)) continue;  // not complete
    newest = entry.path();
    newest_step = *step;
  }
  return newest;
}

void remove_memory_checkpoints(const fs::path& run_dir) {
  remove_tree(memory_checkpoint_root(run_dir));
}

MemoryHolders memory_holders(const std::vector<int>& hosts, int rank) {
  const int n = static_cast<int>(hosts.size());
  check(rank >= 0 && rank < n,
        "memory_holders: rank " + std::to_string(rank) + " of " + std::to_string(n));
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return hosts[static_cast<size_t>(a)] < hosts[static_cast<size_t>(b)];
  });
  std::vector<int> per_host(static_cast<size_t>(*std::max_element(hosts.begin(), hosts.end()) + 1));
  for (int h : hosts) ++per_host[static_cast<size_t>(h)];
  const int shift =
      per_host.size() > 1 ? *std::max_element(per_host.begin(), per_host.end()) % n : 1 % n;
  const auto at = static_cast<int>(std::find(order.begin(), order.end(), rank) - order.begin());
  MemoryHolders h;
  h.peer = order[static_cast<size_t>((at + shift) % n)];
  h.source = order[static_cast<size_t>((at - shift + n) % n)];
  h.own_copy =
      h.peer == rank || hosts[static_cast<size_t>(h.peer)] != hosts[static_cast<size_t>(rank)];
  return h;
}

MemoryCheckpointer::MemoryCheckpointer(comm::Communicator world, const fs::path& run_dir,
                                       std::vector<int> hosts)
    : world_(std::move(world)), root_(memory_checkpoint_root(run_dir)), hosts_(std::move(hosts)) {
  check(static_cast<int>(hosts_.size()) == world_.size(),
        "MemoryCheckpointer: " + std::to_string(hosts_.size()) + " hosts given for " +
            std::to_string(world_.size()) + " ranks");
  holders_ = memory_holders(hosts_, world_.rank());
  const auto mine = hosts_[static_cast<size_t>(world_.rank())];
  host_leader_ = std::find(hosts_.begin(), hosts_.end(), mine) - hosts_.begin() == world_.rank();
}

MemoryCheckpointer::Received MemoryCheckpointer::exchange(const Json& entry,
                                                          const ShardSnapshot& snapshot) {
  const std::string text = entry.dump();
  const int64_t sent_bytes = entry.contains("file") ? shard_bytes(snapshot) : 0;
  int64_t sizes[2] = {static_cast<int64_t>(text.size()), sent_bytes};
  int64_t got[2] = {0, 0};
  {
    std::vector<comm::Request> r;
    r.push_back(world_.irecv(got, sizeof got, holders_.source, kSizesTag));
    r.push_back(world_.isend(sizes, sizeof sizes, holders_.peer, kSizesTag));
    comm::Request::wait_all(r);
  }
  std::string got_text(static_cast<size_t>(got[0]), '\0');
  if (received_.size() < static_cast<size_t>(got[1])) {
    received_ = PageBuffer<char>(static_cast<size_t>(got[1]));
  }
  std::vector<comm::Request> r;
  r.push_back(world_.irecv(got_text.data(), got_text.size(), holders_.source, kEntryTag));
  r.push_back(world_.isend(text.data(), text.size(), holders_.peer, kEntryTag));
  const char* out = reinterpret_cast<const char*>(snapshot.data.data());
  for (int64_t at = 0, tag = kDataTag; at < std::max(got[1], sent_bytes); at += kChunkBytes) {
    if (at < got[1]) {
      r.push_back(world_.irecv(received_.data() + at,
                               static_cast<size_t>(std::min(kChunkBytes, got[1] - at)),
                               holders_.source, static_cast<int>(tag)));
    }
    if (at < sent_bytes) {
      r.push_back(world_.isend(out + at,
                               static_cast<size_t>(std::min(kChunkBytes, sent_bytes - at)),
                               holders_.peer, static_cast<int>(tag)));
    }
  }
  comm::Request::wait_all(r);
  return {parse_json(got_text, "memory checkpoint: rank " + std::to_string(holders_.source) +
                                   "'s shard entry"),
          got[1]};
}

MemorySaveStats MemoryCheckpointer::save(const Checkpoint& header,
                                         const std::vector<SavedKind>& state) {
  const double start = now_s();
  const fs::path dir = checkpoint_dir(root_, header.step);
  // A fresh directory for this step on every host (one left by a save that died is replaced).
  agree(world_, attempt([&] {
          if (!host_leader_) return;
          std::error_code ec;
          fs::remove_all(dir, ec);
          fs::create_directories(dir, ec);
          check(!ec, "memory checkpoint: cannot create " + dir.string() + ": " + ec.message());
        }));
  ShardSnapshot snapshot =
      state.empty() ? ShardSnapshot{} : snapshot_shard(world_.rank(), state, std::move(spare_));
  const Json entry = snapshot.pieces.empty() ? Json::object() : shard_entry(snapshot);
  MemorySaveStats stats;
  stats.bytes = entry.contains("file") ? shard_bytes(snapshot) : 0;
  std::string error;
  if (holders_.peer != world_.rank()) {
    error = attempt([&] {
      const Received got = exchange(entry, snapshot);
      write_copy(dir, got.entry, received_.data(), got.bytes);
      stats.held_bytes += got.bytes;
    });
  }
  if (error.empty() && holders_.own_copy) {
    error = attempt([&] { write_copy(dir, entry, snapshot.data.data(), stats.bytes); });
    stats.held_bytes += stats.bytes;
  }
  spare_ = std::move(snapshot);
  const bool with_moments = world_.all_reduce_max(static_cast<double>(state.size())) > 1;
  try {
    agree(world_, error);
    commit(dir, header, entry.dump(), with_moments);
  } catch (const Error&) {
    std::error_code ignored;
    if (host_leader_) fs::remove_all(dir, ignored);  // no manifest: never taken anyway
    throw;
  }
  stats.seconds = now_s() - start;
  return stats;
}

void MemoryCheckpointer::commit(const fs::path& dir, const Checkpoint& header,
                                const std::string& own_entry, bool with_moments) {
  const std::vector<std::string> entries = world_.gather_text(own_entry, 0);
  std::string text, error;
  if (world_.rank() == 0) {
    error = attempt([&] {
      std::vector<Json> shards;
      for (const std::string& e : entries) {
        Json shard = Json::parse(e);
        if (shard.contains("file")) shards.push_back(std::move(shard));
      }
      text =
          sharded_manifest_text(header, shards, with_moments, "memory checkpoint " + dir.string());
      const CheckpointIndex verified(dir, text);  // every tensor tiled exactly once
    });
  }
  agree(world_, error);
  text = world_.broadcast_text(text, 0);
  agree(world_, attempt([&] {
          if (!host_leader_) return;
          if (header.tokenizer) tokenizer::save_tokenizer(*header.tokenizer, dir);
          // Written last: a step directory with a manifest is a complete memory checkpoint.
          write_file_atomic(dir / kManifest, text);
          std::error_code ec;
          for (const auto& other : fs::directory_iterator(root_, ec)) {
            if (other.path().filename() != dir.filename()) fs::remove_all(other.path(), ec);
          }
        }));
}

void MemoryCheckpointer::clear() {
  agree(world_, attempt([&] {
          if (host_leader_) remove_tree(root_);
        }));
}

}  // namespace malleus::checkpoint

// ---- At a restart: the surviving copies moved between hosts ----

namespace malleus::checkpoint {

using namespace detail;

namespace {

// A transfer's chunks: one MPI message each, one buffer of this size on either end.
constexpr int64_t kCopyChunkBytes = int64_t{64} << 20;
constexpr int kCopyTag = 7104;

HostMemoryCopies::Step step_copies(const fs::path& dir, int64_t step) {
  HostMemoryCopies::Step s;
  s.step = step;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    // AtomicFile's temporaries ("<name>.tmp.<pid>") are writes that never finished.
    if (name.find(".tmp.") != std::string::npos || !entry.is_regular_file(ec)) continue;
    s.files[name] = static_cast<int64_t>(entry.file_size(ec));
  }
  if (s.files.count(kManifest) != 0) {
    try {
      const CheckpointIndex index(dir);
      if (index.sharded()) s.listed = index.file_bytes();
    } catch (const Error&) {
      // A manifest that does not verify lists nothing: another host's may.
    }
  }
  return s;
}

Json copies_json(const HostMemoryCopies& copies) {
  Json steps = Json::array();
  for (const auto& s : copies.steps) {
    steps.push_back({{"step", s.step}, {"files", s.files}, {"listed", s.listed}});
  }
  return steps;
}

HostMemoryCopies copies_from_json(const Json& steps) {
  HostMemoryCopies copies;
  for (const Json& s : steps) {
    copies.steps.push_back({s.at("step").get<int64_t>(),
                            s.at("files").get<std::map<std::string, int64_t>>(),
                            s.at("listed").get<std::map<std::string, int64_t>>()});
  }
  return copies;
}

Json plan_json(const MemoryCopyPlan& plan) {
  Json transfers = Json::array();
  for (const auto& t : plan.transfers) {
    transfers.push_back({{"file", t.file}, {"bytes", t.bytes}, {"from", t.from}, {"to", t.to}});
  }
  return {{"step", plan.step ? Json(*plan.step) : Json()},
          {"transfers", transfers},
          {"bytes", plan.bytes},
          {"refused", plan.refused}};
}

MemoryCopyPlan plan_from_json(const Json& j) {
  MemoryCopyPlan plan;
  if (!j.at("step").is_null()) plan.step = j.at("step").get<int64_t>();
  for (const Json& t : j.at("transfers")) {
    plan.transfers.push_back({t.at("file").get<std::string>(), t.at("bytes").get<int64_t>(),
                              t.at("from").get<int>(), t.at("to").get<int>()});
  }
  plan.bytes = j.at("bytes").get<int64_t>();
  plan.refused = j.at("refused").get<std::string>();
  return plan;
}

// Host `h`'s copy of `step`, or null.
const HostMemoryCopies::Step* step_on(const std::vector<HostMemoryCopies>& hosts, size_t h,
                                      int64_t step) {
  for (const auto& s : hosts[h].steps) {
    if (s.step == step) return &s;
  }
  return nullptr;
}

bool holds(const std::vector<HostMemoryCopies>& hosts, size_t h, int64_t step,
           const std::string& file, int64_t bytes) {
  const HostMemoryCopies::Step* s = step_on(hosts, h, step);
  if (s == nullptr) return false;
  const auto it = s->files.find(file);
  return it != s->files.end() && it->second == bytes;
}

// Every file of `step` from `source`, the copy whose manifest is taken: what its manifest lists,
// and the other files it holds (the manifest, the tokenizer) with their sizes there.
std::map<std::string, int64_t> step_files(const HostMemoryCopies::Step& source) {
  std::map<std::string, int64_t> files = source.listed;
  for (const auto& [name, bytes] : source.files) files.emplace(name, bytes);
  return files;
}

// The transfers that give every host all of `files`, or the files no host holds.
std::vector<std::string> assign_transfers(const std::vector<HostMemoryCopies>& hosts, int64_t step,
                                          const std::map<std::string, int64_t>& files,
                                          MemoryCopyPlan& plan) {
  std::vector<std::string> missing;
  std::vector<int64_t> sent(hosts.size(), 0);
  std::vector<MemoryCopyTransfer> manifests;
  for (const auto& [name, bytes] : files) {
    std::vector<size_t> holders;
    for (size_t h = 0; h < hosts.size(); ++h) {
      if (holds(hosts, h, step, name, bytes)) holders.push_back(h);
    }
    if (holders.empty()) {
      missing.push_back(name);
      continue;
    }
    for (size_t to = 0; to < hosts.size(); ++to) {
      if (holds(hosts, to, step, name, bytes)) continue;
      const size_t from = *std::min_element(holders.begin(), holders.end(),
                                            [&](size_t a, size_t b) { return sent[a] < sent[b]; });
      sent[from] += bytes;
      (name == kManifest ? manifests : plan.transfers)
          .push_back({name, bytes, static_cast<int>(from), static_cast<int>(to)});
      plan.bytes += bytes;
    }
  }
  plan.transfers.insert(plan.transfers.end(), manifests.begin(), manifests.end());
  return missing;
}

std::string missing_text(const fs::path& dir, const std::vector<std::string>& missing,
                         size_t host_count) {
  std::string names;
  for (const std::string& m : missing) names += (names.empty() ? "" : ", ") + m;
  return "checkpoint " + dir.string() + ": " + names + (missing.size() == 1 ? " is" : " are") +
         " missing" + (host_count > 1 ? " on every host" : "");
}

}  // namespace

HostMemoryCopies host_memory_copies(const fs::path& root) {
  HostMemoryCopies copies;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return copies;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = step_of(entry.path());
    if (step && entry.is_directory(ec)) copies.steps.push_back(step_copies(entry.path(), *step));
  }
  std::sort(copies.steps.begin(), copies.steps.end(),
            [](const auto& a, const auto& b) { return a.step < b.step; });
  return copies;
}

MemoryCopyPlan plan_memory_copies(const std::vector<HostMemoryCopies>& hosts, int64_t disk_step,
                                  const fs::path& root) {
  // Each step with a verified manifest somewhere, newest first, and the first host that has it.
  std::map<int64_t, const HostMemoryCopies::Step*, std::greater<>> sources;
  for (const auto& host : hosts) {
    for (const auto& s : host.steps) {
      if (!s.listed.empty()) sources.emplace(s.step, &s);
    }
  }
  MemoryCopyPlan plan;
  for (const auto& [step, source] : sources) {
    const fs::path dir = checkpoint_dir(root, step);
    if (step <= disk_step) {
      if (plan.refused.empty()) {
        plan.refused = "memory checkpoint " + dir.string() + " is of step " + std::to_string(step) +
                       ", not later than the disk's " + std::to_string(disk_step);
      }
      break;
    }
    MemoryCopyPlan candidate;
    const std::vector<std::string> missing =
        assign_transfers(hosts, step, step_files(*source), candidate);
    if (missing.empty()) {
      candidate.step = step;
      return candidate;
    }
    if (plan.refused.empty()) plan.refused = missing_text(dir, missing, hosts.size());
  }
  return plan;
}

namespace {

// Sends `t`'s file from `dir` to rank `dest` in chunks; every chunk is sent even when the file
// cannot be read (the receiver waits for them), and the error returned.
std::string send_copy(const comm::Communicator& world, const fs::path& dir,
                      const MemoryCopyTransfer& t, int dest) {
  const fs::path path = dir / t.file;
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  std::string error;
  if (!in || static_cast<int64_t>(fs::file_size(path, ec)) != t.bytes || ec) {
    error = "memory checkpoint: cannot send " + path.string() + ": not a file of " +
            std::to_string(t.bytes) + " bytes";
  }
  std::vector<char> chunk(static_cast<size_t>(std::min(kCopyChunkBytes, t.bytes)));
  for (int64_t at = 0; at < t.bytes; at += kCopyChunkBytes) {
    const int64_t n = std::min(kCopyChunkBytes, t.bytes - at);
    if (error.empty() && !in.read(chunk.data(), n)) {
      error = "memory checkpoint: cannot read " + path.string();
    }
    world.isend(chunk.data(), static_cast<size_t>(n), dest, kCopyTag).wait();
  }
  return error;
}

// Receives `t`'s file from rank `source` and writes it into `dir` atomically; every chunk is
// received even when writing fails, and the error returned.
std::string receive_copy(const comm::Communicator& world, const fs::path& dir,
                         const MemoryCopyTransfer& t, int source) {
  std::optional<AtomicFile> file;
  std::string error = attempt([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    check(!ec, "memory checkpoint: cannot create " + dir.string() + ": " + ec.message());
    file.emplace(dir / t.file);
  });
  std::vector<char> chunk(static_cast<size_t>(std::min(kCopyChunkBytes, t.bytes)));
  for (int64_t at = 0; at < t.bytes; at += kCopyChunkBytes) {
    const int64_t n = std::min(kCopyChunkBytes, t.bytes - at);
    world.irecv(chunk.data(), static_cast<size_t>(n), source, kCopyTag).wait();
    if (error.empty()) error = attempt([&] { file->write(chunk.data(), static_cast<size_t>(n)); });
  }
  if (error.empty()) error = attempt([&] { file->commit(); });
  return error;
}

// This rank's part of the plan's transfers that `phase` selects, in plan order (the same on
// every rank, so a pair never waits on one that waits on another); the first error, if any.
std::string run_transfers(const comm::Communicator& world, const MemoryCopyPlan& plan,
                          const fs::path& dir, const std::vector<int>& leaders,
                          const std::function<bool(const MemoryCopyTransfer&)>& phase) {
  std::string error;
  for (const MemoryCopyTransfer& t : plan.transfers) {
    if (!phase(t)) continue;
    const int from = leaders.at(static_cast<size_t>(t.from));
    const int to = leaders.at(static_cast<size_t>(t.to));
    std::string e;
    if (world.rank() == from) e = send_copy(world, dir, t, to);
    if (world.rank() == to) e = receive_copy(world, dir, t, from);
    if (error.empty()) error = e;
  }
  return error;
}

}  // namespace

MemoryCopyPlan gather_memory_copies(const comm::Communicator& world, const fs::path& run_dir,
                                    const std::vector<int>& leaders, int64_t disk_step) {
  const fs::path root = memory_checkpoint_root(run_dir);
  const bool leader = std::find(leaders.begin(), leaders.end(), world.rank()) != leaders.end();
  const std::vector<std::string> listed =
      world.gather_text(leader ? copies_json(host_memory_copies(root)).dump() : "", 0);
  std::string text;
  agree(world, attempt([&] {
          if (world.rank() != 0) return;
          std::vector<HostMemoryCopies> hosts;
          for (int l : leaders) {
            hosts.push_back(copies_from_json(parse_json(
                listed.at(static_cast<size_t>(l)), "memory copies of rank " + std::to_string(l))));
          }
          text = plan_json(plan_memory_copies(hosts, disk_step, root)).dump();
        }));
  const MemoryCopyPlan plan = plan_from_json(Json::parse(world.broadcast_text(text, 0)));
  if (!plan.step || plan.transfers.empty()) return plan;
  const fs::path dir = checkpoint_dir(root, *plan.step);
  const auto is_manifest = [](const MemoryCopyTransfer& t) { return t.file == kManifest; };
  agree(world, run_transfers(world, plan, dir, leaders, std::not_fn(is_manifest)));
  // Only once every host holds every other file: a step directory with a manifest is complete.
  agree(world, run_transfers(world, plan, dir, leaders, is_manifest));
  return plan;
}

}  // namespace malleus::checkpoint
