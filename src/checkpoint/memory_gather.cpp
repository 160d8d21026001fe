#include "checkpoint/memory_gather.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>

#include "checkpoint/checkpoint_detail.h"
#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_folder.h"
#include "common/error.h"
#include "common/files.h"

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
  if (!fs::exists(fs::symlink_status(root, ec))) return copies;
  // Nothing another user could have placed is listed, let alone sent to another host.
  check_memory_base(root.parent_path());
  check_private_dir(root, "memory checkpoints");
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = checkpoint_dir_step(entry.path());
    if (!step || !entry.is_directory(ec)) continue;
    // The running job removes old steps as it writes new ones: one may go while this lists.
    if (!check_private_dir_if_present(entry.path(), "memory checkpoint")) continue;
    copies.steps.push_back(step_copies(entry.path(), *step));
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
  std::string error = comm::error_of([&] {
    make_memory_base(dir.parent_path().parent_path());
    make_private_dir(dir.parent_path(), "memory checkpoints");
    make_private_dir(dir, "memory checkpoint");
    file.emplace(dir / t.file, FileAccess::kPrivate);
  });
  std::vector<char> chunk(static_cast<size_t>(std::min(kCopyChunkBytes, t.bytes)));
  for (int64_t at = 0; at < t.bytes; at += kCopyChunkBytes) {
    const int64_t n = std::min(kCopyChunkBytes, t.bytes - at);
    world.irecv(chunk.data(), static_cast<size_t>(n), source, kCopyTag).wait();
    if (error.empty())
      error = comm::error_of([&] { file->write(chunk.data(), static_cast<size_t>(n)); });
  }
  if (error.empty()) error = comm::error_of([&] { file->commit(); });
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
  // Each leader's listing, or why it has none to give (another user's folder): the first such
  // error stops every rank.
  std::string mine;
  if (leader) {
    try {
      mine = copies_json(host_memory_copies(root)).dump();
    } catch (const Error& e) {
      mine = Json{{"error", e.what()}}.dump();
    }
  }
  const std::vector<std::string> listed = world.gather_text(mine, 0);
  std::string text;
  comm::agree_on_error(world, comm::error_of([&] {
                         if (world.rank() != 0) return;
                         std::vector<HostMemoryCopies> hosts;
                         for (int l : leaders) {
                           const Json copies =
                               parse_json(listed.at(static_cast<size_t>(l)),
                                          "memory copies of rank " + std::to_string(l));
                           if (copies.is_object())
                             throw Error(copies.at("error").get<std::string>());
                           hosts.push_back(copies_from_json(copies));
                         }
                         text = plan_json(plan_memory_copies(hosts, disk_step, root)).dump();
                       }));
  const MemoryCopyPlan plan = plan_from_json(Json::parse(world.broadcast_text(text, 0)));
  if (!plan.step || plan.transfers.empty()) return plan;
  const fs::path dir = checkpoint_dir(root, *plan.step);
  const auto is_manifest = [](const MemoryCopyTransfer& t) { return t.file == kManifest; };
  comm::agree_on_error(world, run_transfers(world, plan, dir, leaders, std::not_fn(is_manifest)));
  // Only once every host holds every other file: a step directory with a manifest is complete.
  comm::agree_on_error(world, run_transfers(world, plan, dir, leaders, is_manifest));
  return plan;
}

}  // namespace malleus::checkpoint
