#include "checkpoint/memory_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
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
    const std::optional<int64_t> step = checkpoint_dir_step(entry.path());
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
  comm::agree_on_error(
      world_, comm::error_of([&] {
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
    error = comm::error_of([&] {
      const Received got = exchange(entry, snapshot);
      write_copy(dir, got.entry, received_.data(), got.bytes);
      stats.held_bytes += got.bytes;
    });
  }
  if (error.empty() && holders_.own_copy) {
    error = comm::error_of([&] { write_copy(dir, entry, snapshot.data.data(), stats.bytes); });
    stats.held_bytes += stats.bytes;
  }
  spare_ = std::move(snapshot);
  const bool with_moments = world_.all_reduce_max(static_cast<double>(state.size())) > 1;
  try {
    comm::agree_on_error(world_, error);
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
    error = comm::error_of([&] {
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
  comm::agree_on_error(world_, error);
  text = world_.broadcast_text(text, 0);
  comm::agree_on_error(world_, comm::error_of([&] {
                         if (!host_leader_) return;
                         if (header.tokenizer) tokenizer::save_tokenizer(*header.tokenizer, dir);
                         // Written last: a step directory with a manifest is a complete memory
                         // checkpoint.
                         write_file_atomic(dir / kManifest, text);
                         std::error_code ec;
                         for (const auto& other : fs::directory_iterator(root_, ec)) {
                           if (other.path().filename() != dir.filename())
                             fs::remove_all(other.path(), ec);
                         }
                       }));
}

void MemoryCheckpointer::clear() {
  comm::agree_on_error(world_, comm::error_of([&] {
                         if (host_leader_) remove_tree(root_);
                       }));
}

}  // namespace malleus::checkpoint
