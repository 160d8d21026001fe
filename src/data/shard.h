// Token shard files in llm.c's format, so shards made by llm.c's scripts (GPT-2 tokens) load too:
// a header of 256 little-endian int32 (magic 20240520, version 1, token count, rest zero)
// followed by the tokens as little-endian uint16.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <vector>

namespace malleus::data {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;

// Written atomically (temporary file + rename), so a reader never sees half a shard. Throws Error
// if the tokens do not fit the header's int32 count.
void write_shard(const std::filesystem::path& path, const std::vector<uint16_t>& tokens);

// One shard written as its tokens arrive, so a shard never has to be held in memory: the header's
// count is filled in by finish(). A writer destroyed before finish() removes its file. Writes in
// place (not atomically): prepare-data writes into a staging directory and renames finished
// shards into place.
class ShardFileWriter {
 public:
  explicit ShardFileWriter(std::filesystem::path path);
  ~ShardFileWriter();
  ShardFileWriter(const ShardFileWriter&) = delete;
  ShardFileWriter& operator=(const ShardFileWriter&) = delete;
  // Throws Error naming the file on a write error, or past the header's int32 count.
  void write(std::span<const uint16_t> tokens);
  // Writes the header, fsyncs and closes.
  void finish();
  int64_t tokens() const { return tokens_; }

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  int64_t tokens_ = 0;
};

// Throws Error naming the file for: missing file ("no such file"), a file shorter than the header
// ("truncated header"), wrong magic ("not a token shard: bad magic N"), an unsupported version,
// and a token count that disagrees with the file size ("header says N tokens but file holds M").
std::vector<uint16_t> read_shard(const std::filesystem::path& path);

// read_shard, appending to `out`: a corpus of many shards is read straight into one buffer. On
// error `out` is left as it was.
void append_shard(const std::filesystem::path& path, std::vector<uint16_t>& out);

}  // namespace malleus::data
