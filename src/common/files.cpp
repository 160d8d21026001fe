#include "common/files.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace malleus {

namespace {
// The reason of the call that just failed: read errno at once, before another call changes it.
std::string errno_text(int error = errno) {
  return std::strerror(error);
}
}  // namespace

AtomicFile::AtomicFile(fs::path path, FileAccess access) : path_(std::move(path)) {
  temp_path_ = path_;
  temp_path_ += ".tmp." + std::to_string(::getpid());
  const bool mine = access == FileAccess::kPrivate;
  // A private file is never readable by others, not even for a moment: created 0600, and set so
  // where a temporary of that name was left over (O_TRUNC keeps its mode). A symbolic link in its
  // place is refused rather than followed.
  const int fd = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                        mine ? 0600 : 0666);
  if (fd >= 0 && mine && ::fchmod(fd, 0600) != 0) {
    const int error = errno;
    ::close(fd);
    throw Error("cannot make " + temp_path_.string() + " private: " + errno_text(error));
  }
  if (fd >= 0) file_ = ::fdopen(fd, "wb");
  if (file_ == nullptr) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    throw Error("cannot create " + temp_path_.string() + ": " + errno_text(error));
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::error_code ignored;
    fs::remove(temp_path_, ignored);
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  check(file_ != nullptr, "write to " + path_.string() + " after commit");
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, file_) != bytes) {
    const int error = errno;
    throw Error("cannot write " + temp_path_.string() + ": " + errno_text(error));
  }
}

void AtomicFile::commit() {
  check(file_ != nullptr, "double commit of " + path_.string());
  // The first failure's errno is the reason (a full disk shows up at fflush or fsync); later
  // calls, fclose and remove included, may overwrite errno.
  int error = 0;
  if (std::fflush(file_) != 0 || ::fsync(::fileno(file_)) != 0) error = errno;
  if (std::fclose(file_) != 0 && error == 0) error = errno;
  file_ = nullptr;
  if (error == 0 && std::rename(temp_path_.c_str(), path_.c_str()) != 0) error = errno;
  if (error != 0) {
    std::error_code ignored;
    fs::remove(temp_path_, ignored);
    throw Error("cannot write " + path_.string() + ": " + errno_text(error));
  }
  sync_directory(path_.has_parent_path() ? path_.parent_path() : fs::path("."));
}

void write_file_atomic(const fs::path& path, const std::string& contents, FileAccess access) {
  AtomicFile file(path, access);
  file.write(contents);
  file.commit();
}

std::string read_file(const fs::path& path) {
  // A directory or a device (/dev/zero, a disk) is no file to read whole: refused before it is
  // opened, where /dev/zero would otherwise fill the memory. Pipes stay readable (<(...)).
  std::error_code status_error;
  const fs::file_status status = fs::status(path, status_error);
  check(!fs::is_directory(status), "cannot read " + path.string() + ": it is a directory");
  check(!fs::is_character_file(status) && !fs::is_block_file(status),
        "cannot read " + path.string() + ": it is a device, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) {
    const int error = errno;
    std::error_code ec;
    throw Error("cannot open " + path.string() + ": " +
                (fs::exists(path, ec) ? errno_text(error) : std::string("no such file")));
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  check(!in.bad(), "cannot read " + path.string());
  return buffer.str();
}

void sync_directory(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some file systems do not allow opening directories
  ::fsync(fd);
  ::close(fd);
}

std::vector<fs::path> expand_files(const std::string& pattern) {
  fs::path p(pattern);
  std::string name = p.filename().string();
  if (name.find_first_of("*?[") == std::string::npos) {
    check(fs::is_regular_file(p), "no such file: " + pattern);
    return {p};
  }
  fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::vector<fs::path> matches;
  if (fs::is_directory(dir)) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file() &&
          ::fnmatch(name.c_str(), entry.path().filename().c_str(), 0) == 0) {
        matches.push_back(entry.path());
      }
    }
  }
  check(!matches.empty(), "no files match " + pattern);
  std::sort(matches.begin(), matches.end());
  return matches;
}

}  // namespace malleus
