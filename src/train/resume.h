// Where a resumed run continues from: the latest complete checkpoint on disk, or the run's newest
// memory checkpoint (checkpoint/memory_checkpoint.h) when that is of a later step, complete and
// verified; on several hosts, the newest whose every file some host holds, the files a host lacks
// first sent to it (checkpoint::gather_memory_copies). A memory copy that cannot be used — a file
// missing or of the wrong size (its holder's host gone, a segment removed), a checksum that does
// not match (a torn or damaged copy), a manifest that does not verify, a folder another user owns
// or could have written into (checkpoint/memory_folder.h) — is refused with a line saying why, and
// the disk checkpoint is read instead.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "train/trainer.h"

namespace malleus::train {

struct ResumePoint {
  // The latest disk checkpoint (none when the run lost a rank before its first, and a memory
  // copy is there), and the run directory it belongs to (none for a checkpoint outside one).
  std::optional<std::filesystem::path> disk;
  std::optional<std::filesystem::path> run_dir;
  std::optional<std::filesystem::path> memory;  // the memory checkpoint chosen, if any
  checkpoint::Checkpoint checkpoint;            // loaded from `memory` if chosen, else the disk
  std::filesystem::path dir() const { return memory ? *memory : *disk; }
};

// Which hosts a restart's memory copies may come from (restart_step).
enum class MemoryHosts {
  kThisHost,  // the job runs on this host alone: a file missing here is missing everywhere
  kSeveral,   // the job spans hosts: this host holds only some shards; the others hold the rest
};
// The step a restart of `run_dir` continues from: the newer of the latest disk checkpoint and the
// newest memory checkpoint on this host — usable here (kThisHost, as find_resume_point would
// choose), or with a manifest, which a host gets only once every shard is on two hosts
// (kSeveral: the restart gathers the files it lacks from the others, gather_memory_copies).
// Nothing if neither. Not collective: what malleus launch reports before it restarts the job.
std::optional<int64_t> restart_step(const std::filesystem::path& run_dir,
                                    MemoryHosts hosts = MemoryHosts::kThisHost);

// `memory` (a memory checkpoint's step directory on this host) if it is of a later step than
// `disk_step` and its manifest verifies and lists files that are all present with their sizes;
// else nothing, with the reason in `*refused`. Not collective.
std::optional<std::filesystem::path> usable_memory_copy(const std::filesystem::path& memory,
                                                        int64_t disk_step, std::string* refused);
// The memory checkpoint `run_dir` has on this host if it is of a later step than `disk_step` and
// its manifest verifies and lists files that are all present with their sizes; else nothing,
// with the reason in `*refused` when there was a copy. Not collective.
std::optional<std::filesystem::path> usable_memory_checkpoint(const std::filesystem::path& run_dir,
                                                              int64_t disk_step,
                                                              std::string* refused);

// Collective. `given`: what --resume names. Memory copies are considered only when it names a
// run directory (or its checkpoint root), not one checkpoint: first the hosts' copies are
// gathered (checkpoint::gather_memory_copies: every host is sent the files of the newest step
// complete across the hosts that it lacks), then rank 0's host checks the step's copy as
// usable_memory_copy does, and every rank reads the copy on its own host.
ResumePoint find_resume_point(const std::filesystem::path& given, comm::Communicator& world);

// Collective: restores `point` into `trainer`. When the memory copy fails to read on any rank,
// says so (rank 0) and restores the disk checkpoint instead; `point` then names it.
void restore_resume_point(Trainer& trainer, ResumePoint& point, comm::Communicator& world);

}  // namespace malleus::train
