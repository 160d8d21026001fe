#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace malleus::train {

namespace {

[[noreturn]] void fail(const std::string& what, const std::filesystem::path& path, int error) {
  throw Error("cannot " + what + " metrics file " + path.string() + ": " + std::strerror(error));
}

// Removes an incomplete last line (no final newline); returns how many bytes it had.
off_t cut_torn_tail(int fd, const std::filesystem::path& path) {
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < 0) fail("read", path, errno);
  off_t end = size;  // the file up to `end` holds whole lines only
  char chunk[4096];
  while (end > 0) {
    const off_t start = std::max<off_t>(0, end - static_cast<off_t>(sizeof chunk));
    const auto length = static_cast<size_t>(end - start);
    if (::pread(fd, chunk, length, start) != static_cast<ssize_t>(length))
      fail("read", path, errno);
    const char* newline = static_cast<const char*>(::memrchr(chunk, '\n', length));
    if (newline != nullptr) {
      end = start + (newline - chunk) + 1;
      break;
    }
    end = start;
  }
  if (end != size && ::ftruncate(fd, end) != 0) fail("repair", path, errno);
  return size - end;
}

}  // namespace

MetricsLog::MetricsLog(const std::filesystem::path& path) : path_(path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("open", path, errno);
  try {
    if (const off_t torn = cut_torn_tail(fd_, path_); torn > 0) {
      std::fprintf(stderr,
                   "warning: %s ended in an incomplete line (%lld bytes, from a write that was "
                   "interrupted); removed it\n",
                   path_.c_str(), static_cast<long long>(torn));
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MetricsLog::~MetricsLog() {
  ::close(fd_);
}

void MetricsLog::write(const Json& record) {
  const std::string line = record.dump() + "\n";
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  if (before < 0) fail("write", path_, errno);
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      // Cut the partial line back off: the file keeps whole records only.
      if (::ftruncate(fd_, before) != 0) {
        std::fprintf(stderr, "warning: %s: cannot remove a partly written line\n", path_.c_str());
      }
      fail("write", path_, error);
    }
    done += static_cast<size_t>(n);
  }
}

std::string format_duration(double seconds) {
  char text[32];
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds < 60) {
    std::snprintf(text, sizeof text, "%.1fs", seconds);
  } else if (seconds < 3600) {
    std::snprintf(text, sizeof text, "%dm%02ds", static_cast<int>(seconds) / 60,
                  static_cast<int>(seconds) % 60);
  } else {
    std::snprintf(text, sizeof text, "%dh%02dm", static_cast<int>(seconds) / 3600,
                  static_cast<int>(seconds) / 60 % 60);
  }
  return text;
}

std::string format_count(double value) {
  char text[32];
  if (value >= 1e9) {
    std::snprintf(text, sizeof text, "%.2fB", value / 1e9);
  } else if (value >= 1e6) {
    std::snprintf(text, sizeof text, "%.2fM", value / 1e6);
  } else if (value >= 1e3) {
    std::snprintf(text, sizeof text, "%.1fk", value / 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.0f", value);
  }
  return text;
}

}  // namespace malleus::train
