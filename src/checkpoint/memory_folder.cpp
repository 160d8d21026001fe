#include "checkpoint/memory_folder.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

#include "checkpoint/memory_checkpoint.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "common/proc_stat.h"

namespace malleus::checkpoint {

namespace fs = std::filesystem;

namespace {

std::string owner_text(uid_t uid) {
  return "user " + user_name(uid) + " (uid " + std::to_string(uid) + ")";
}

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// lstat of `path`, or nothing when it does not exist; throws Error naming it as `what` when it
// cannot be read otherwise. One lstat: what it says of the path is what is checked.
std::optional<struct stat> stat_if_present(const fs::path& path, const std::string& what) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) return st;
  const int error = errno;
  if (error == ENOENT) return std::nullopt;
  throw Error(what + " " + path.string() + ": " + std::strerror(error));
}

// lstat of `path`; throws Error naming it as `what` when it cannot be read or does not exist.
struct stat stat_of(const fs::path& path, const std::string& what) {
  if (const auto st = stat_if_present(path, what)) return *st;
  throw Error(what + " " + path.string() + ": " + std::strerror(ENOENT));
}

// The newest modification time of `root` and its entries, in seconds since the epoch.
double last_change_s(const fs::path& root) {
  struct stat st;
  double newest = ::lstat(root.c_str(), &st) == 0 ? static_cast<double>(st.st_mtime) : 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (::lstat(entry.path().c_str(), &st) == 0)
      newest = std::max(newest, static_cast<double>(st.st_mtime));
  }
  return newest;
}

double unix_now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Why the run of `root` still counts as alive on this host, or "" when it is gone.
std::string why_alive(const fs::path& root) {
  const double quiet_s = unix_now_s() - last_change_s(root);
  const std::optional<MemoryOwner> owner = read_memory_owner(root);
  if (!owner) {
    return quiet_s < kAbandonedAfterS ? "it has no owner record and changed "
                                        "less than " +
                                            format_duration(kAbandonedAfterS) + " ago"
                                      : "";
  }
  const std::string here = host_name();
  if (owner->host == here) {
    for (const HostProcess& p : owner->ranks) {
      if (is_running(p)) return "its rank with pid " + std::to_string(p.pid) + " is running";
    }
  }
  if (owner->supervisor) {
    if (owner->supervisor_host == here) {
      if (is_running(*owner->supervisor)) return "its supervisor is running";
    } else if (quiet_s < kAbandonedAfterS) {
      return "its supervisor runs on " + owner->supervisor_host;
    }
  }
  if (owner->host != here && quiet_s < kAbandonedAfterS) return "it was written on " + owner->host;
  return "";
}

}  // namespace

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

std::string user_name(uint32_t uid) {
  struct passwd entry;
  struct passwd* found = nullptr;
  std::vector<char> buffer(16384);
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) {
    return found->pw_name;
  }
  return "uid " + std::to_string(uid);
}

namespace {

void check_private_stat(const fs::path& dir, const std::string& what, const struct stat& st) {
  check(!S_ISLNK(st.st_mode),
        what + " " + dir.string() + " is a symbolic link (owned by " + owner_text(st.st_uid) +
            "), not a folder: refusing it (remove it, or set $MALLEUS_MEMORY_CHECKPOINT_DIR)");
  check(S_ISDIR(st.st_mode), what + " " + dir.string() + " is not a folder");
  check(st.st_uid == ::geteuid(),
        what + " " + dir.string() + " belongs to " + owner_text(st.st_uid) + ", not to " +
            owner_text(::geteuid()) +
            ": refusing to write to or read from it (another user may have placed it; its owner "
            "can remove it, or set $MALLEUS_MEMORY_CHECKPOINT_DIR)");
  check((st.st_mode & (S_IWGRP | S_IWOTH)) == 0,
        what + " " + dir.string() + " (owned by " + owner_text(st.st_uid) + ") has mode " +
            octal_mode(st.st_mode) +
            ": group or others can write to it, so its content may not be the run's: refusing "
            "it (remove it; malleus makes these folders 0700)");
}

}  // namespace

void check_private_dir(const fs::path& dir, const std::string& what) {
  check_private_stat(dir, what, stat_of(dir, what));
}

bool check_private_dir_if_present(const fs::path& dir, const std::string& what) {
  const auto st = stat_if_present(dir, what);
  if (st) check_private_stat(dir, what, *st);
  return st.has_value();
}

void make_private_dir(const fs::path& dir, const std::string& what) {
  if (::mkdir(dir.c_str(), 0700) == 0) {
    // The umask may have taken bits away, never added any; 0700 whatever it is.
    check(::chmod(dir.c_str(), 0700) == 0,
          "cannot set the mode of " + what + " " + dir.string() + ": " + std::strerror(errno));
    return;
  }
  const int error = errno;
  check(error == EEXIST,
        "cannot create " + what + " " + dir.string() + ": " + std::strerror(error));
  check_private_dir(dir, what);
}

void make_memory_base(const fs::path& base) {
  struct stat st;
  if (::stat(base.c_str(), &st) != 0 && errno == ENOENT) {
    // Not there yet (a $MALLEUS_MEMORY_CHECKPOINT_DIR to be): made, the last folder private.
    std::error_code ec;
    fs::create_directories(base, ec);
    if (!ec) ::chmod(base.c_str(), 0700);
  }
  check_memory_base(base);
}

void check_memory_base(const fs::path& base) {
  const std::string what = "the memory checkpoint base";
  struct stat st;
  check(::stat(base.c_str(), &st) == 0,
        what + " " + base.string() + ": " + std::strerror(errno) +
            " (it is $MALLEUS_MEMORY_CHECKPOINT_DIR, else /dev/shm)");
  check(S_ISDIR(st.st_mode), what + " " + base.string() + " is not a folder");
  check(st.st_uid == ::geteuid() || st.st_uid == 0,
        what + " " + base.string() + " belongs to " + owner_text(st.st_uid) +
            ", who could replace any folder in it: refusing it (set "
            "$MALLEUS_MEMORY_CHECKPOINT_DIR to a folder of yours)");
  check((st.st_mode & (S_IWGRP | S_IWOTH)) == 0 || (st.st_mode & S_ISVTX) != 0,
        what + " " + base.string() + " has mode " + octal_mode(st.st_mode) +
            ": others can write to it without the sticky bit, so they could replace the run's "
            "folder: refusing it (chmod +t it, or set $MALLEUS_MEMORY_CHECKPOINT_DIR)");
}

HostProcess this_process() {
  HostProcess p;
  p.pid = ::getpid();
  // A process's own start time: field 22 of /proc/self/stat.
  const std::vector<std::string> fields = proc_stat_fields("/proc/self/stat");
  if (fields.size() > 19) p.start = std::atoll(fields[19].c_str());
  return p;
}

bool is_running(const HostProcess& process) {
  if (process.pid <= 0) return false;
  const std::vector<std::string> fields =
      proc_stat_fields("/proc/" + std::to_string(process.pid) + "/stat");
  if (fields.empty() || fields[0] == "Z" || fields[0] == "X") return false;  // ended, or not reaped
  const int64_t start = fields.size() > 19 ? std::atoll(fields[19].c_str()) : -1;
  return start == process.start;
}

std::optional<std::pair<std::string, HostProcess>> supervisor_from_environment() {
  const char* text = std::getenv("MALLEUS_SUPERVISOR");
  if (text == nullptr) return std::nullopt;
  std::istringstream words(text);
  std::string host;
  HostProcess p;
  if (!(words >> host >> p.pid >> p.start) || p.pid <= 0) return std::nullopt;
  return std::make_pair(host, p);
}

std::string supervisor_text() {
  const HostProcess me = this_process();
  return host_name() + " " + std::to_string(me.pid) + " " + std::to_string(me.start);
}

void write_memory_owner(const fs::path& root, const MemoryOwner& owner) {
  Json ranks = Json::array();
  for (const HostProcess& p : owner.ranks) ranks.push_back({{"pid", p.pid}, {"start", p.start}});
  Json record = {{"run_dir", owner.run_dir}, {"host", owner.host}, {"ranks", ranks}};
  if (owner.supervisor) {
    record["supervisor"] = {{"host", owner.supervisor_host},
                            {"pid", owner.supervisor->pid},
                            {"start", owner.supervisor->start}};
  }
  write_file_atomic(root / kMemoryOwnerFile, record.dump(2) + "\n", FileAccess::kPrivate);
}

std::optional<MemoryOwner> read_memory_owner(const fs::path& root) {
  try {
    const Json record = Json::parse(read_file(root / kMemoryOwnerFile));
    MemoryOwner owner;
    owner.run_dir = record.at("run_dir").get<std::string>();
    owner.host = record.at("host").get<std::string>();
    for (const Json& p : record.at("ranks")) {
      owner.ranks.push_back({p.at("pid").get<int64_t>(), p.at("start").get<int64_t>()});
    }
    if (record.contains("supervisor")) {
      const Json& s = record.at("supervisor");
      owner.supervisor = HostProcess{s.at("pid").get<int64_t>(), s.at("start").get<int64_t>()};
      owner.supervisor_host = s.at("host").get<std::string>();
    }
    return owner;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

int64_t folder_bytes(const fs::path& dir) {
  int64_t bytes = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    struct stat st;
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) bytes += st.st_size;
  }
  return bytes;
}

std::vector<std::string> remove_abandoned_memory_copies(const fs::path& keep) {
  std::vector<std::string> removed;
  const fs::path base = memory_checkpoint_base();
  try {
    check_memory_base(base);
  } catch (const Error&) {
    return removed;  // the run's own use of it says why
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(base, ec)) {
    const fs::path root = entry.path();
    if (root.filename().string().rfind("malleus-", 0) != 0 || root == keep) continue;
    try {
      check_private_dir(root, "memory checkpoints");
    } catch (const Error&) {
      continue;  // another user's, or not a folder of ours
    }
    if (!why_alive(root).empty()) continue;
    const std::optional<MemoryOwner> owner = read_memory_owner(root);
    const int64_t bytes = folder_bytes(root);
    std::error_code removing;
    fs::remove_all(root, removing);
    if (removing) continue;
    removed.push_back("removed " + root.string() + " (" + format_bytes(static_cast<double>(bytes)) +
                      ")" +
                      (owner ? " of run " + owner->run_dir + ": its processes are gone"
                             : ": it has no owner record and has not changed for " +
                                   format_duration(kAbandonedAfterS)));
  }
  return removed;
}

}  // namespace malleus::checkpoint
