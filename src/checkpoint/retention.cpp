#include "checkpoint/retention.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_detail.h"
#include "common/error.h"

namespace malleus::checkpoint {

using namespace detail;

namespace {

// Whether `error` (of flock) means the file system has no locks: nothing to wait for then.
bool no_locks(int error) {
  return error == ENOLCK || error == ENOSYS || error == EOPNOTSUPP || error == EINVAL;
}

// The same file: `fd` is still what `path` names (not removed or renamed away meanwhile).
bool still_named(int fd, const fs::path& path) {
  struct stat opened, named;
  return ::fstat(fd, &opened) == 0 && ::stat(path.c_str(), &named) == 0 &&
         opened.st_dev == named.st_dev && opened.st_ino == named.st_ino;
}

// Why the complete checkpoint `dir` cannot go now, or nothing once it is gone: renamed to a
// temporary under an exclusive lock of its manifest, then removed.
std::optional<std::string> remove_checkpoint(const fs::path& dir) {
  const fs::path manifest = dir / kManifest;
  const int fd = ::open(manifest.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::string("cannot open its manifest: ") + std::strerror(errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && !no_locks(errno)) {
    const int error = errno;
    ::close(fd);
    return error == EWOULDBLOCK ? std::string("a reader holds it")
                                : std::string("cannot lock it: ") + std::strerror(error);
  }
  // Renamed while locked: a reader that opened the manifest meanwhile finds it gone once it has
  // its own lock (CheckpointReadLock), and stops with an error rather than reading half of it.
  const fs::path doomed = temporary_dir(dir, ::getpid());
  std::error_code ec;
  fs::remove_all(doomed, ec);
  fs::rename(dir, doomed, ec);
  ::close(fd);
  if (ec) return "cannot move it aside: " + ec.message();
  fs::remove_all(doomed, ec);
  // A failure here leaves a temporary, not a checkpoint: clean_stale_temporaries finishes it.
  return std::nullopt;
}

}  // namespace

CheckpointReadLock::CheckpointReadLock(const fs::path& dir) : dir_(normalized(dir)) {
  const fs::path manifest = dir_ / kManifest;
  fd_ = ::open(manifest.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd_ >= 0, "checkpoint " + dir_.string() +
                      ": not a checkpoint: cannot open manifest.json (" + std::strerror(errno) +
                      ")");
  while (::flock(fd_, LOCK_SH) != 0) {
    const int error = errno;
    if (error == EINTR) continue;
    if (no_locks(error)) break;
    ::close(fd_);
    throw Error("checkpoint " + dir_.string() +
                ": cannot lock manifest.json: " + std::strerror(error));
  }
  if (!still_named(fd_, manifest)) {
    ::close(fd_);
    throw Error("checkpoint " + dir_.string() +
                " was removed while it was being opened (by a run's --keep-checkpoints)");
  }
}

CheckpointReadLock::~CheckpointReadLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string CheckpointReadLock::manifest_text() const {
  std::string text;
  char buffer[65536];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd_, buffer, sizeof buffer, at);
    if (n < 0 && errno == EINTR) continue;
    check(n >= 0, "cannot read " + (dir_ / kManifest).string() + ": " + std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

RetentionPass prune_checkpoints(const fs::path& root, int keep) {
  RetentionPass pass;
  if (keep <= 0) return pass;
  std::vector<std::pair<int64_t, fs::path>> complete;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::optional<int64_t> step = checkpoint_dir_step(entry.path());
    if (step && fs::is_regular_file(entry.path() / kManifest, ec)) {
      complete.emplace_back(*step, entry.path());
    }
  }
  std::sort(complete.begin(), complete.end(), std::greater<>());
  std::optional<fs::path> latest;
  try {
    latest = latest_checkpoint(root);
  } catch (const Error&) {
    return pass;  // `latest` unreadable: which one is the latest is not known; remove nothing
  }
  for (size_t i = static_cast<size_t>(keep); i < complete.size(); ++i) {
    const fs::path& dir = complete[i].second;
    if (latest && normalized(*latest) == normalized(dir)) continue;
    if (fs::exists(dir / kKeepMarker, ec)) continue;
    if (const std::optional<std::string> why = remove_checkpoint(dir)) {
      pass.left.push_back(dir.string() + ": " + *why);
    } else {
      pass.removed.push_back(dir);
    }
  }
  return pass;
}

}  // namespace malleus::checkpoint
