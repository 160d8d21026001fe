#include "checkpoint/memory_checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "checkpoint/checkpoint_detail.h"
#include "checkpoint/memory_folder.h"
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
  AtomicFile file(dir / entry.at("file").get<std::string>(), FileAccess::kPrivate);
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

std::optional<fs::path> private_memory_root(const fs::path& run_dir) {
  const fs::path root = memory_checkpoint_root(run_dir);
  struct stat st;
  if (::lstat(root.c_str(), &st) != 0 && errno == ENOENT) return std::nullopt;
  check_memory_base(root.parent_path());
  check_private_dir(root, "memory checkpoints");
  return root;
}

void check_memory_copy_dir(const fs::path& dir) {
  check_memory_base(dir.parent_path().parent_path());
  check_private_dir(dir.parent_path(), "memory checkpoints");
  check_private_dir(dir, "memory checkpoint");
}

std::optional<fs::path> latest_memory_checkpoint(const fs::path& run_dir) {
  const std::optional<fs::path> root = private_memory_root(run_dir);
  if (!root) return std::nullopt;
  std::error_code ec;
  std::optional<fs::path> newest;
  int64_t newest_step = -1;
  for (const auto& entry : fs::directory_iterator(*root, ec)) {
    const std::optional<int64_t> step = checkpoint_dir_step(entry.path());
    if (!step || *step <= newest_step) continue;
    if (!fs::is_regular_file(entry.path() / kManifest, ec)) continue;  // not complete
    newest = entry.path();
    newest_step = *step;
  }
  if (newest) check_private_dir(*newest, "memory checkpoint");
  return newest;
}

std::optional<MemoryCopiesHeld> memory_copies_held(const fs::path& run_dir) {
  try {
    const std::optional<fs::path> root = private_memory_root(run_dir);
    if (!root) return std::nullopt;
    return MemoryCopiesHeld{*root, folder_bytes(*root)};
  } catch (const Error&) {
    return std::nullopt;
  }
}

bool remove_memory_checkpoints(const fs::path& run_dir) {
  std::optional<fs::path> root;
  try {
    root = private_memory_root(run_dir);
  } catch (const Error&) {
    return false;  // not this user's copies (a save or a resume says so)
  }
  if (!root) return false;
  remove_tree(*root);
  return true;
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

MemoryCopyBytes memory_copy_bytes(const std::vector<int>& hosts, int rank,
                                  const std::vector<int64_t>& shard_bytes) {
  check(shard_bytes.size() == hosts.size(),
        "memory_copy_bytes: " + std::to_string(shard_bytes.size()) + " shards for " +
            std::to_string(hosts.size()) + " ranks");
  const MemoryHolders h = memory_holders(hosts, rank);
  const int64_t own = shard_bytes[static_cast<size_t>(rank)];
  const int64_t received = h.source == rank ? 0 : shard_bytes[static_cast<size_t>(h.source)];
  MemoryCopyBytes bytes;
  bytes.buffers = own + received;
  bytes.files = 2 * (received + (h.own_copy ? own : 0));
  return bytes;
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
  // Every rank's pid and start time, for the owner record of its host's folder.
  const HostProcess me = this_process();
  const std::vector<std::string> all =
      world_.gather_text(std::to_string(me.pid) + " " + std::to_string(me.start), 0);
  std::string joined;
  for (const std::string& p : all) joined += p + "\n";
  std::istringstream lines(world_.broadcast_text(joined, 0));
  owner_.run_dir = fs::absolute(run_dir).lexically_normal().string();
  owner_.host = host_name();
  for (int r = 0; r < world_.size(); ++r) {
    HostProcess p;
    lines >> p.pid >> p.start;
    if (hosts_[static_cast<size_t>(r)] == mine) owner_.ranks.push_back(p);
  }
  if (const auto supervisor = supervisor_from_environment()) {
    owner_.supervisor_host = supervisor->first;
    owner_.supervisor = supervisor->second;
  }
}

void MemoryCheckpointer::prepare_step_dir(const fs::path& dir) {
  // A private folder for the run, with its owner record, and a fresh one for this step (one left
  // by a save that died is replaced). Another user's folder, or one others can write, is refused.
  make_memory_base(root_.parent_path());
  make_private_dir(root_, "memory checkpoints");
  if (!owner_written_) {
    write_memory_owner(root_, owner_);
    owner_written_ = true;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  make_private_dir(dir, "memory checkpoint");
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
  comm::agree_on_error(world_, comm::error_of([&] {
                         if (host_leader_) prepare_step_dir(dir);
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
  comm::agree_on_error(
      world_, comm::error_of([&] {
        if (!host_leader_) return;
        if (header.tokenizer) {
          tokenizer::save_tokenizer(*header.tokenizer, dir, FileAccess::kPrivate);
        }
        // Written last: a step directory with a manifest is a complete memory
        // checkpoint.
        write_file_atomic(dir / kManifest, text, FileAccess::kPrivate);
        std::error_code ec;
        for (const auto& other : fs::directory_iterator(root_, ec)) {
          if (checkpoint_dir_step(other.path()) && other.path().filename() != dir.filename())
            fs::remove_all(other.path(), ec);
        }
      }));
}

void MemoryCheckpointer::clear() {
  comm::agree_on_error(world_, comm::error_of([&] {
                         if (host_leader_) remove_memory_checkpoints(owner_.run_dir);
                       }));
  owner_written_ = false;
}

}  // namespace malleus::checkpoint
