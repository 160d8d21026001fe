#include "train/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>

#include "checkpoint/checkpoint.h"
#include "common/error.h"

namespace malleus::train {

using checkpoint::clean_stale_temporaries;

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockFile = ".lock";

// Who holds a lock: what its holder wrote into the file ("pid 123 on host"), if anything.
std::string holder_of(int fd) {
  char text[256] = {};
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  std::string holder = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
  return holder.empty() ? "another process" : holder;
}

}  // namespace

RunDirectory::RunDirectory(const fs::path& dir, const std::optional<fs::path>& resumed_run)
    : dir_(dir) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  check(!ec, "cannot create the run directory " + dir_.string() + ": " + ec.message());

  // Locked before the directory is looked at, so two runs starting together cannot both find
  // it empty: exactly one gets the lock.
  const fs::path lock_path = dir_ / kLockFile;
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    const int error = errno;
    throw Error("cannot open " + lock_path.string() + ": " + std::strerror(error));
  }
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = holder_of(lock_fd_);
    ::close(lock_fd_);
    lock_fd_ = -1;
    check(error != EWOULDBLOCK,
          "run directory " + dir_.string() + " is in use by " + holder +
              ": two runs must not share one (wait for it, or choose another --out)");
    throw Error("cannot lock " + lock_path.string() + ": " + std::strerror(error));
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string holder = "pid " + std::to_string(::getpid()) + " on " + host + "\n";
  if (::ftruncate(lock_fd_, 0) != 0 ||
      ::pwrite(lock_fd_, holder.data(), holder.size(), 0) != static_cast<ssize_t>(holder.size())) {
    const int error = errno;
    ::close(lock_fd_);
    throw Error("cannot write " + lock_path.string() + ": " + std::strerror(error));
  }

  const bool resuming_here =
      resumed_run && fs::exists(*resumed_run, ec) && fs::equivalent(dir_, *resumed_run, ec);
  if (!resuming_here) {
    std::string found;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      const std::string name = entry.path().filename().string();
      if (name == kLockFile) continue;
      found += (found.empty() ? "" : ", ") + name;
    }
    if (!found.empty()) {
      ::close(lock_fd_);
      lock_fd_ = -1;
      throw Error("run directory " + dir_.string() + " already holds a run (" + found +
                  "): continue it with --resume " + dir_.string() +
                  ", or choose another --out (or remove it)");
    }
  }
  for (const std::string& note : clean_stale_temporaries(dir_ / "checkpoints")) {
    std::fprintf(stderr, "note: %s\n", note.c_str());
  }
}

RunDirectory::~RunDirectory() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

}  // namespace malleus::train
