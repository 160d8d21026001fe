#include "checkpoint/checkpoint_writer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>

#include "checkpoint/retention.h"
#include "common/error.h"
#include "common/json.h"

namespace malleus::checkpoint {

namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rank `root`'s verdict on every rank: throws its error everywhere, so that no rank goes on (or
// waits in a collective) after another failed.
void agree(const comm::Communicator& world, const std::string& error, int root = 0) {
  const std::string verdict = world.broadcast_text(error, root);
  if (!verdict.empty()) throw Error(verdict);
}

}  // namespace

void CheckpointWriter::mark_copied(Pending& p) {
  {
    std::lock_guard lock(p.mutex);
    p.copied = true;
  }
  p.copy_done.notify_all();
}

void CheckpointWriter::copy_state(Pending& p) {
  if (!p.state.empty()) {
    p.snapshot = std::make_unique<ShardSnapshot>(
        snapshot_shard(p.rank, p.state, p.reuse ? std::move(*p.reuse) : ShardSnapshot{}));
    p.reuse.reset();
  }
  mark_copied(p);
}

CheckpointWriter::~CheckpointWriter() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

void CheckpointWriter::begin(const fs::path& root, const Checkpoint& header,
                             std::vector<SavedKind> state, bool background,
                             bool copy_in_background) {
  wait();
  const double started = now_s();
  const fs::path dir = checkpoint_dir(root, header.step);
  // Rank 0 names and makes the directory every rank writes into; its pid marks it as this
  // process's, so clean_stale_temporaries removes it once the job is gone.
  std::string tmp_text, error;
  if (world_.rank() == 0) {
    try {
      const fs::path tmp = temporary_dir(dir, ::getpid());
      std::error_code ec;
      fs::create_directories(root, ec);
      check(!ec, "checkpoint " + dir.string() + ": cannot create " + root.string() + ": " +
                     ec.message());
      fs::remove_all(tmp, ec);
      fs::create_directory(tmp, ec);
      check(!ec,
            "checkpoint " + dir.string() + ": cannot create " + tmp.string() + ": " + ec.message());
      tmp_text = tmp.string();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  agree(world_, error);
  tmp_text = world_.broadcast_text(tmp_text, 0);

  Pending& p = pending_.emplace();
  p.root = root;
  p.dir = dir;
  p.tmp = tmp_text;
  p.header = header;
  p.header.params.clear();
  p.header.adam_m.clear();
  p.header.adam_v.clear();
  p.kinds = static_cast<int>(state.size());
  p.started = started;
  p.background = background;
  p.rank = world_.rank();
  if (!state.empty()) {
    p.state = std::move(state);
    p.reuse = std::move(spare_);
  }
  // The copy: here, or first thing on the writer's thread.
  const bool copy_later = background && copy_in_background;
  if (!copy_later) copy_state(p);
  p.thread = std::thread([&p, copy_later] {
    try {
      if (copy_later) copy_state(p);
      p.entry = p.snapshot && !p.snapshot->pieces.empty()
                    ? write_shard(p.tmp, *p.snapshot).dump()
                    : Json::object().dump();  // nothing owned here, no file
    } catch (const std::exception& e) {
      mark_copied(p);  // a failed copy is over too: the buffers are free again
      p.entry = Json{{"error", e.what()}}.dump();
    }
    p.done = true;
  });
  p.stall_s = now_s() - started;
  if (!background) wait();
}

void CheckpointWriter::wait_for_copy() {
  if (!copying()) return;
  Pending& p = *pending_;
  const double start = now_s();
  std::unique_lock lock(p.mutex);
  p.copy_done.wait(lock, [&p] { return p.copied.load(); });
  p.stall_s += now_s() - start;
}

bool CheckpointWriter::poll() {
  if (!pending_) return false;
  const int64_t finished = world_.all_reduce_sum(int64_t{pending_->done ? 1 : 0});
  if (finished < world_.size()) return false;
  commit();
  return true;
}

void CheckpointWriter::wait() {
  if (!pending_) return;
  pending_->thread.join();
  commit();
}

void CheckpointWriter::commit() {
  Pending& p = *pending_;
  if (p.thread.joinable()) p.thread.join();
  const std::vector<std::string> entries = world_.gather_text(p.entry, 0);
  // Every rank agrees on whether the moments were saved (ranks holding nothing pass no state).
  const bool with_moments = world_.all_reduce_max(static_cast<double>(p.kinds)) > 1;
  std::string error;
  SaveStats stats;
  if (world_.rank() == 0) {
    try {
      std::vector<Json> shards;
      for (size_t r = 0; r < entries.size(); ++r) {
        Json entry = Json::parse(entries[r]);
        if (entry.contains("error")) {
          throw Error("checkpoint " + p.dir.string() + ": rank " + std::to_string(r) +
                      " could not write its part: " + entry["error"].get<std::string>());
        }
        if (!entry.contains("file")) continue;
        stats.bytes += entry["bytes"].get<int64_t>();
        shards.push_back(std::move(entry));
      }
      commit_sharded_checkpoint(p.tmp, p.dir, p.header, shards, with_moments);
      // `latest` moves only once the checkpoint it names is complete and in place.
      mark_latest(p.root, p.dir);
      // Then older ones past the limit go (never the latest, a marked one, or one being read).
      RetentionPass pass = prune_checkpoints(p.root, keep_);
      stats.removed = std::move(pass.removed);
      stats.left = std::move(pass.left);
    } catch (const std::exception& e) {
      error = e.what();
      std::error_code ignored;
      fs::remove_all(p.tmp, ignored);
    }
  }
  spare_ = std::move(p.snapshot);  // written: its memory serves the next save
  stats.dir = p.dir;
  stats.total_s = now_s() - p.started;
  stats.stall_s = p.background ? p.stall_s : stats.total_s;
  pending_.reset();
  agree(world_, error);
  last_ = stats;
}

}  // namespace malleus::checkpoint
