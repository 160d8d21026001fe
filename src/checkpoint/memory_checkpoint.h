// In-memory redundant checkpoints (after Gemini, SOSP '23): every K steps each rank's checkpoint
// shard — the pieces its file of a sharded checkpoint holds (checkpoint.h) — is copied into host
// memory: into its peer's, a rank on another host where the job has several hosts (else the next
// rank), which receives it over MPI and writes it into its host's shared memory; and when that
// peer is on another host, into its own host's as well, so that every shard is on two hosts where
// there are two. Files in a tmpfs (/dev/shm) outlive the processes that wrote them: the copies
// survive a killed rank and mpirun ending the job, and the restarted job reads them instead of the
// disk (train/resume.h).
//
// Where: <base>/malleus-<key>/step_NNNNNNNN/, holding rank_NNNNN.bin files and manifest.json in the
// sharded checkpoint format, so a restart reads them with CheckpointIndex like a checkpoint on
// disk, every piece checked against its checksum. <base> is $MALLEUS_MEMORY_CHECKPOINT_DIR, else
// /dev/shm; <key> is the XXH3 of the run directory's absolute path: one per run, the same across
// its restarts. A step directory gets its manifest (written last, atomically, by each host's
// leader) only once every rank's shard is in place on every host, so a copy torn by a rank dying
// mid-save has no manifest and is never taken; a complete one whose file was damaged or removed
// since is refused by its sizes and checksums. Once a step's manifest is in place, the host's
// other step directories go: a host keeps one complete memory checkpoint (two while the next is
// made). A run that ends (finished, stopped, diverged) removes its copies; a fresh run in the same
// directory removes a previous run's first.
//
// The folder is private (mode 0700, files 0600), and one another user owns or could have written
// into is never used (checkpoint/memory_folder.h, which also says when the copies of a run whose
// processes are gone are removed).
//
// At a restart after a host was lost, the hosts left send each other the files they lack
// (checkpoint/memory_gather.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/memory_folder.h"
#include "comm/communicator.h"
#include "common/host_pages.h"

namespace malleus::checkpoint {

// $MALLEUS_MEMORY_CHECKPOINT_DIR, else /dev/shm.
std::filesystem::path memory_checkpoint_base();
// <base>/malleus-<XXH3 of the absolute run directory>: where this host keeps a run's copies.
std::filesystem::path memory_checkpoint_root(const std::filesystem::path& run_dir);
// memory_checkpoint_root(run_dir) when it exists, checked private (memory_folder.h: the base, then
// the folder; Error naming the path and its owner otherwise); nothing when it does not exist.
std::optional<std::filesystem::path> private_memory_root(const std::filesystem::path& run_dir);
// Throws Error naming the path and its owner unless a memory checkpoint's step directory, its
// run's folder and their base are private as memory_folder.h requires.
void check_memory_copy_dir(const std::filesystem::path& dir);
// The newest step directory of the run's memory checkpoints on this host that has a manifest;
// throws Error when the folder or that step directory is not private (private_memory_root).
std::optional<std::filesystem::path> latest_memory_checkpoint(const std::filesystem::path& run_dir);
// The run's memory copies on this host: their folder and the bytes its files hold in memory.
// Nothing when there are none, or when the folder is not the effective user's own.
struct MemoryCopiesHeld {
  std::filesystem::path root;
  int64_t bytes = 0;
};
std::optional<MemoryCopiesHeld> memory_copies_held(const std::filesystem::path& run_dir);
// Removes the run's memory copies on this host; returns whether there were any. A folder of that
// name that is not the effective user's own (private_memory_root) is not its copies: left alone.
bool remove_memory_checkpoints(const std::filesystem::path& run_dir);

// Who holds a rank's copy: `peer` receives it and writes it on its host; the rank receives the
// shard of `source`; `own_copy`: the rank also writes its own shard on its host (when its peer is
// on another host, or when it is alone). `hosts`: each rank's host (runtime::host_indices). Ranks
// in host order, each sends to the rank as many places on as the largest host has ranks: a rank on
// another host whenever there is one.
struct MemoryHolders {
  int peer = 0;
  int source = 0;
  bool own_copy = false;
};
MemoryHolders memory_holders(const std::vector<int>& hosts, int rank);

// What memory copies hold for rank `rank` (the trainer's memory check counts it): two host
// buffers kept between saves — the snapshot of its own shard that it sends, the peer's shard that
// it receives — and the files it writes into its host's memory — the peer's shard, and its own
// when own_copy — twice over while a save replaces the previous one (a host holds two step
// directories until the new manifest is in place). `shard_bytes`: every rank's shard.
struct MemoryCopyBytes {
  int64_t buffers = 0;
  int64_t files = 0;
  int64_t total() const { return buffers + files; }
};
MemoryCopyBytes memory_copy_bytes(const std::vector<int>& hosts, int rank,
                                  const std::vector<int64_t>& shard_bytes);

// What a memory save took on this rank.
struct MemorySaveStats {
  double seconds = 0;      // the whole save: the step waits for all of it
  int64_t bytes = 0;       // this rank's shard
  int64_t held_bytes = 0;  // what this rank wrote into its host's memory (the peer's, its own)
};

class MemoryCheckpointer {
 public:
  // Collective. `hosts`: runtime::host_indices(world).
  MemoryCheckpointer(comm::Communicator world, const std::filesystem::path& run_dir,
                     std::vector<int> hosts);

  // Collective: the memory checkpoint of `header`'s step (the run's folder made private, with its
  // owner record, by each host's first rank; another user's is refused with an Error) (model,
  // config, progress, tokenizer; its buffers are not used) from this rank's `state` (saved_state;
  // empty on a rank holding nothing). Synchronous: the state may change once it returns. Throws the
  // same Error on every rank if any rank failed; the previous memory checkpoint is then still the
  // complete one.
  MemorySaveStats save(const Checkpoint& header, const std::vector<SavedKind>& state);
  // Collective: every host's copies of this run removed.
  void clear();

  const MemoryHolders& holders() const { return holders_; }

 private:
  // The peer's shard as received: its manifest entry and its bytes.
  struct Received {
    Json entry;
    int64_t bytes = 0;
  };
  Received exchange(const Json& entry, const ShardSnapshot& snapshot);
  // The host leader's part before a save: the run's private folder and owner record, and an empty
  // private folder `dir` for the step.
  void prepare_step_dir(const std::filesystem::path& dir);
  // Rank 0 writes the manifest text every host's leader puts into `dir`, then removes its older
  // step directories. Collective.
  void commit(const std::filesystem::path& dir, const Checkpoint& header,
              const std::string& own_entry, bool with_moments);

  comm::Communicator world_;
  std::filesystem::path root_;
  std::vector<int> hosts_;
  MemoryHolders holders_;
  bool host_leader_ = false;
  MemoryOwner owner_;           // this host's ranks, and the supervisor
  bool owner_written_ = false;  // into the run's folder, since it was made
  ShardSnapshot spare_;         // the last save's snapshot: its memory serves the next
  PageBuffer<char> received_;   // the peer's shard, kept between saves
};

}  // namespace malleus::checkpoint
