// What the single-file (checkpoint.cpp) and the sharded (sharded_checkpoint.cpp) checkpoint
// formats share: names, the manifest's seal, and the atomic move of a finished directory into
// place. Internal to the checkpoint library.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/json.h"

namespace malleus::checkpoint::detail {

namespace fs = std::filesystem;

inline constexpr const char* kFormat = "malleus-checkpoint";
// Version 2 added the manifest's own checksum; version 3 is the sharded form; version 4 stores
// the Adam moments as pieces of their own (written by their optimizer shard's owner).
inline constexpr int64_t kVersion = 2;
inline constexpr int64_t kShardedVersion3 = 3;
inline constexpr int64_t kShardedVersion = 4;
inline constexpr const char* kManifestChecksum = "manifest_xxh3";
inline constexpr const char* kManifest = "manifest.json";

// "a/step_1/" must give the siblings "a/step_1.tmp.<pid>", not entries inside "a/step_1".
inline fs::path normalized(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

inline fs::path with_suffix(const fs::path& path, const std::string& suffix) {
  fs::path p = path;
  p += suffix;
  return p;
}

inline fs::path parent_of(const fs::path& path) {
  return path.has_parent_path() ? path.parent_path() : fs::path(".");
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The head of a manifest both forms write: format, `version`, model, training config, progress
// (from `header`; its buffers are not used) and the `tensors` list; each form adds its "files"
// (and the sharded one its "buffers").
Json manifest_head(int64_t version, const Checkpoint& header, Json tensors);

// The manifest's fields both forms share (format, version and seal, already checked by
// verified_manifest; model, training config and progress), read into a Checkpoint without buffers.
Checkpoint read_manifest_header(JsonReader& reader, const std::string& source);

// Removes the half-written temporary directory unless the save got to the final rename, so a
// failed save leaves nothing behind but the previous checkpoint.
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path dir) : dir_(std::move(dir)) {}
  ~TempDirGuard() {
    if (!dismissed_) {
      std::error_code ignored;
      fs::remove_all(dir_, ignored);
    }
  }
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  void dismiss() { dismissed_ = true; }

 private:
  fs::path dir_;
  bool dismissed_ = false;
};

// A single-file checkpoint's buffers (the Adam moments only `with_optimizer`) from the files its
// verified manifest, `index`, lists; no tokenizer. Throws Error naming the file at fault.
Checkpoint read_single_file(const CheckpointIndex& index, bool with_optimizer);

// Parses manifest.json's text and checks its format, version (single-file or sharded) and own
// checksum before any value is used; `version` receives the version.
Json verified_manifest(const std::string& text, const std::string& source, int64_t* version);
// The manifest with its own checksum added, as written to manifest.json.
std::string sealed_manifest_text(const Json& manifest, const std::string& where);
// Renames the finished directory `tmp` to `dir`; a previous `dir` is moved aside first
// ("<dir>.old.<pid>", put back if the rename fails) and removed once the new one is in place.
void move_into_place(const fs::path& tmp, const fs::path& dir, const std::string& where);

}  // namespace malleus::checkpoint::detail
