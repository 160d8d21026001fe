// At a restart after a host was lost, a memory checkpoint's files (memory_checkpoint.h) are spread
// over the hosts left, and a host that comes back holds none: the hosts' leaders list what they
// hold, agree on the newest step later than the disk checkpoint whose every file some host holds,
// and send each host the files it lacks, so that every host has the whole step directory and the
// restart reads it from its own memory (train/resume.h calls gather_memory_copies before it
// chooses between memory and disk).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace malleus::checkpoint {

// One host's memory copies of a run, per step directory (oldest first): the files it holds with
// their sizes (temporaries of unfinished writes left out), and the files its manifest lists with
// theirs (empty where the directory has no manifest, or one that does not verify).
struct HostMemoryCopies {
  struct Step {
    int64_t step = 0;
    std::map<std::string, int64_t> files;
    std::map<std::string, int64_t> listed;
  };
  std::vector<Step> steps;
};
// What `root` (memory_checkpoint_root) holds on this host; nothing when it does not exist. Throws
// Error naming the folder and its owner when it, or a step folder in it, is not private
// (memory_folder.h).
HostMemoryCopies host_memory_copies(const std::filesystem::path& root);

// One file sent from host `from`, which holds it with the size its step needs, to host `to`.
struct MemoryCopyTransfer {
  std::string file;
  int64_t bytes = 0;
  int from = 0;
  int to = 0;
};

// Which memory checkpoint a restart takes, and what moves so that every host holds all of it.
struct MemoryCopyPlan {
  std::optional<int64_t> step;  // none: no step later than the disk's is complete across the hosts
  std::vector<MemoryCopyTransfer> transfers;  // every manifest.json after all the other files
  int64_t bytes = 0;                          // of all the transfers
  // Without a step: why the newest memory checkpoint is not taken, naming the files no host holds
  // (empty when there is no memory checkpoint at all).
  std::string refused;
};

// The plan for hosts holding `hosts` (by host index): the newest step later than `disk_step`
// whose manifest some host has and whose every file (what the manifest lists, the manifest, the
// tokenizer) some host holds with its size; each file a host lacks comes from the holder that has
// sent the fewest bytes so far. `root`: the step directories named in messages. Not collective.
MemoryCopyPlan plan_memory_copies(const std::vector<HostMemoryCopies>& hosts, int64_t disk_step,
                                  const std::filesystem::path& root);

// Collective, at a restart: every host's leader (`leaders`: world rank by host index,
// runtime::host_leaders) lists its copies of `run_dir`'s memory checkpoints, rank 0 plans
// (plan_memory_copies), and each transfer is sent over MPI in chunks from the sending host's leader
// to the receiving host's, which writes it into its step directory atomically, the manifest last
// (after every host's other files are in place), into private folders. A host whose folder is not
// private stops the gathering: the Error names it. Returns the same plan on every rank once every
// file is written; throws the same Error on every rank if any rank failed.
MemoryCopyPlan gather_memory_copies(const comm::Communicator& world,
                                    const std::filesystem::path& run_dir,
                                    const std::vector<int>& leaders, int64_t disk_step);

}  // namespace malleus::checkpoint
