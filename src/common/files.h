// File helpers shared by data shards, checkpoints, exports and metrics. Every write that replaces
// a file goes through AtomicFile so a crash never leaves a half-written file behind.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace malleus {

namespace fs = std::filesystem;

// Who may read a file written: everyone the umask lets (kShared), or its owner alone (kPrivate:
// mode 0600 from its creation on, whatever the umask; what memory copies are written with).
enum class FileAccess { kShared, kPrivate };

// Writes to "<path>.tmp.<pid>" and renames it over `path` on commit(); the temporary file is
// removed if the object is destroyed without commit() (an exception was thrown midway).
class AtomicFile {
 public:
  explicit AtomicFile(fs::path path, FileAccess access = FileAccess::kShared);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  // Flushes, fsyncs and renames into place.
  void commit();
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  fs::path temp_path_;
  std::FILE* file_ = nullptr;
};

// Writes a whole file atomically.
void write_file_atomic(const fs::path& path, const std::string& contents,
                       FileAccess access = FileAccess::kShared);

// Reads a whole file; throws Error naming the file if it is missing or unreadable.
std::string read_file(const fs::path& path);

// fsyncs a directory so a rename inside it is durable.
void sync_directory(const fs::path& dir);

// Expands a path that may hold shell-style wildcards (*, ?) in its file name into the sorted list
// of matching files. A path without wildcards is returned as is if it exists. Throws Error naming
// the pattern when nothing matches.
std::vector<fs::path> expand_files(const std::string& pattern);

}  // namespace malleus
