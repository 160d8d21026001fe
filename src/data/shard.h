// Token shard files in llm.c's format, so shards made by llm.c's scripts (GPT-2 tokens) load too:
// a header of 256 little-endian int32 (magic 20240520, version 1, token count, rest zero)
// followed by the tokens as little-endian uint16.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

namespace malleus::data {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int kShardHeaderInts = 256;

// Written atomically (temporary file + rename).
void write_shard(const std::filesystem::path& path, const std::vector<uint16_t>& tokens);
// Throws Error naming the file for: missing file, short header, wrong magic or version, a token
// count that disagrees with the file size.
std::vector<uint16_t> read_shard(const std::filesystem::path& path);

}  // namespace malleus::data
