// The folder a run's memory copies live in on a host (checkpoint/memory_checkpoint.h), and the
// rules that keep it private and keep it from outliving its run, on a host shared by many users:
//
// - Private: <base>/malleus-<key> is made with mode 0700 and every file in it 0600; the base
//   ($MALLEUS_MEMORY_CHECKPOINT_DIR or /dev/shm) must be the effective user's or root's, and
//   writable by others only with its sticky bit (as /dev/shm is). A folder (the run's, or one of
//   its step folders) that another user owns, or that group or others can write, is neither
//   written to nor read from: the error names the path and its owner. So no copy another user
//   could have placed is ever taken as the run's state.
// - Owned by processes: each host's first rank writes owner.json into the folder (0600): the run
//   directory, the host, the pid and start time of each of the host's ranks, and of the
//   supervisor (`malleus launch`, from $MALLEUS_SUPERVISOR) when there is one.
// - Removed when abandoned: at the start of `malleus train` (each host's first rank) and of
//   `malleus launch`, every folder of the effective user in the base whose run is gone is removed
//   (remove_abandoned_memory_copies): none of the processes its record names is running on this
//   host (a pid counts only with its recorded start time), and its supervisor is not running
//   either — one on another host, which cannot be asked, counts as gone once the folder has not
//   changed for kAbandonedAfterS. A folder without a record counts as gone after as long. The
//   run being started is never removed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace malleus::checkpoint {

// The quiet time after which a folder whose supervisor runs elsewhere, or which has no record,
// counts as abandoned.
inline constexpr double kAbandonedAfterS = 600;

// Throws Error naming `dir` (as `what`) and its owner unless it is a directory, not a symbolic
// link, owned by the effective user, that neither group nor others can write.
void check_private_dir(const std::filesystem::path& dir, const std::string& what);
// As above, but false when `dir` no longer exists (a step folder the running job removed
// between a listing and this check).
bool check_private_dir_if_present(const std::filesystem::path& dir, const std::string& what);
// Creates `dir` with mode 0700 (its parent must exist), or checks an existing one as above.
void make_private_dir(const std::filesystem::path& dir, const std::string& what);
// Throws Error naming `base` and its owner unless it is a directory owned by the effective user
// or root that others can write only with its sticky bit set.
void check_memory_base(const std::filesystem::path& base);
// Creates `base` (its last folder 0700) when it does not exist, then checks it as above.
void make_memory_base(const std::filesystem::path& base);

// A process on this host: its pid and its start time (clock ticks after boot, /proc/PID/stat),
// which tells it from a later process given the same pid.
struct HostProcess {
  int64_t pid = 0;
  int64_t start = 0;
};
HostProcess this_process();
bool is_running(const HostProcess& process);

// owner.json of a run's memory folder on one host.
struct MemoryOwner {
  std::string run_dir;  // absolute
  std::string host;
  std::vector<HostProcess> ranks;  // the ranks on this host that wrote the folder
  std::optional<HostProcess> supervisor;
  std::string supervisor_host;
};
inline constexpr const char* kMemoryOwnerFile = "owner.json";
// The supervisor as $MALLEUS_SUPERVISOR names it ("HOST PID START"), if set and well formed.
std::optional<std::pair<std::string, HostProcess>> supervisor_from_environment();
// "HOST PID START" of this process: what `malleus launch` sets $MALLEUS_SUPERVISOR to.
std::string supervisor_text();
// Writes `root`/owner.json (private, atomically).
void write_memory_owner(const std::filesystem::path& root, const MemoryOwner& owner);
// The record of `root`, or nothing when it has none or one this reader does not understand.
std::optional<MemoryOwner> read_memory_owner(const std::filesystem::path& root);

// Bytes of the files under `dir` (what a tmpfs holds in memory for them).
int64_t folder_bytes(const std::filesystem::path& dir);

// This host's name (gethostname), as owner records give it.
std::string host_name();
// The user name of `uid` ("uid 1001" when it has none).
std::string user_name(uint32_t uid);

// The sweep described above, in memory_checkpoint_base(): removes the effective user's abandoned
// memory folders except `keep` (a memory_checkpoint_root; empty: none kept). Returns one line per
// folder removed ("removed /dev/shm/malleus-… (12.0 MiB) of run runs/x: its processes are gone").
// Never throws: a folder it cannot judge or remove is left alone.
std::vector<std::string> remove_abandoned_memory_copies(const std::filesystem::path& keep);

}  // namespace malleus::checkpoint
