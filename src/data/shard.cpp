#include "data/shard.h"

#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "common/error.h"
#include "common/files.h"

namespace malleus::data {

namespace {

constexpr size_t kHeaderBytes = kShardHeaderInts * sizeof(int32_t);

// The format is little-endian on disk whatever the host is; on little-endian hosts (every machine
// we run on) these compile to nothing and the tokens go straight from fread into the vector.
constexpr bool kBigEndianHost = std::endian::native == std::endian::big;

uint16_t swap16(uint16_t v) {
  return static_cast<uint16_t>((v >> 8) | (v << 8));
}

void put_le32(unsigned char* out, int32_t value) {
  auto v = static_cast<uint32_t>(value);
  for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

int32_t get_le32(const unsigned char* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return static_cast<int32_t>(v);
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

void append_shard(const std::filesystem::path& path, std::vector<uint16_t>& out) {
  const std::string name = path.string();
  FilePtr file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    int err = errno;
    throw Error(name + ": " + (err == ENOENT ? std::string("no such file") : std::strerror(err)));
  }
  struct stat st {};
  check(::fstat(::fileno(file.get()), &st) == 0, name + ": cannot stat: " + std::strerror(errno));
  check(S_ISREG(st.st_mode), name + ": not a regular file");
  const auto file_bytes = static_cast<uint64_t>(st.st_size);

  check(file_bytes >= kHeaderBytes, name + ": truncated header (" + std::to_string(file_bytes) +
                                        " bytes, a shard header is " +
                                        std::to_string(kHeaderBytes) + ")");
  std::array<unsigned char, kHeaderBytes> header{};
  check(std::fread(header.data(), 1, kHeaderBytes, file.get()) == kHeaderBytes,
        name + ": cannot read header");
  const int32_t magic = get_le32(&header[0]);
  const int32_t version = get_le32(&header[4]);
  const int32_t count = get_le32(&header[8]);
  check(magic == kShardMagic, name + ": not a token shard: bad magic " + std::to_string(magic) +
                                  " (expected " + std::to_string(kShardMagic) + ")");
  check(version == kShardVersion, name + ": unsupported shard version " + std::to_string(version) +
                                      " (this build reads version " +
                                      std::to_string(kShardVersion) + ")");
  const uint64_t payload = file_bytes - kHeaderBytes;
  if (count < 0 || payload != static_cast<uint64_t>(count) * sizeof(uint16_t)) {
    std::string holds = std::to_string(payload / sizeof(uint16_t));
    if (payload % sizeof(uint16_t) != 0) holds += " and a stray byte";
    throw Error(name + ": header says " + std::to_string(count) + " tokens but file holds " +
                holds);
  }

  const size_t begin = out.size();
  const auto n = static_cast<size_t>(count);
  out.resize(begin + n);
  if (std::fread(out.data() + begin, sizeof(uint16_t), n, file.get()) != n) {
    out.resize(begin);  // leave `out` as it was, so a caller that catches sees no half shard
    throw Error(name + ": cannot read tokens (file changed while reading?)");
  }
  if constexpr (kBigEndianHost) {
    for (size_t i = begin; i < out.size(); ++i) out[i] = swap16(out[i]);
  }
}

namespace {

// The header of a shard of `count` tokens. The header stores the count as int32: llm.c's readers
// would misread a larger shard.
std::array<unsigned char, kHeaderBytes> shard_header(const std::filesystem::path& path,
                                                     uint64_t count) {
  check(count <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max()),
        path.string() + ": " + std::to_string(count) +
            " tokens do not fit one shard (the header's count is an int32)");
  std::array<unsigned char, kHeaderBytes> header{};
  put_le32(&header[0], kShardMagic);
  put_le32(&header[4], kShardVersion);
  put_le32(&header[8], static_cast<int32_t>(count));
  return header;
}

}  // namespace

ShardFileWriter::ShardFileWriter(std::filesystem::path path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "wb");
  check(file_ != nullptr, path_.string() + ": cannot create: " + std::strerror(errno));
  const std::array<unsigned char, kHeaderBytes> placeholder{};
  check(std::fwrite(placeholder.data(), 1, placeholder.size(), file_) == placeholder.size(),
        path_.string() + ": write error: " + std::strerror(errno));
}

ShardFileWriter::~ShardFileWriter() {
  if (file_ == nullptr) return;
  std::fclose(file_);
  std::error_code ignored;
  std::filesystem::remove(path_, ignored);
}

void ShardFileWriter::write(std::span<const uint16_t> tokens) {
  check(file_ != nullptr, path_.string() + ": written after finish()");
  shard_header(path_, static_cast<uint64_t>(tokens_) + tokens.size());  // checks the count
  size_t written;
  if constexpr (kBigEndianHost) {
    std::vector<uint16_t> swapped(tokens.begin(), tokens.end());
    for (auto& t : swapped) t = swap16(t);
    written = std::fwrite(swapped.data(), sizeof(uint16_t), swapped.size(), file_);
  } else {
    written = std::fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), file_);
  }
  check(written == tokens.size(), path_.string() + ": write error: " + std::strerror(errno));
  tokens_ += static_cast<int64_t>(tokens.size());
}

void ShardFileWriter::finish() {
  check(file_ != nullptr, path_.string() + ": finished twice");
  const auto header = shard_header(path_, static_cast<uint64_t>(tokens_));
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 &&
                  std::fwrite(header.data(), 1, header.size(), file_) == header.size() &&
                  std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!ok || !closed) {
    std::error_code ignored;
    std::filesystem::remove(path_, ignored);
    throw Error(path_.string() + ": write error: " + std::strerror(ok ? errno : err));
  }
}

void write_shard(const std::filesystem::path& path, const std::vector<uint16_t>& tokens) {
  const auto header = shard_header(path, tokens.size());
  AtomicFile file(path);
  file.write(header.data(), header.size());
  if constexpr (kBigEndianHost) {
    std::vector<uint16_t> swapped(tokens);
    for (auto& t : swapped) t = swap16(t);
    file.write(swapped.data(), swapped.size() * sizeof(uint16_t));
  } else {
    file.write(tokens.data(), tokens.size() * sizeof(uint16_t));
  }
  file.commit();
}

std::vector<uint16_t> read_shard(const std::filesystem::path& path) {
  std::vector<uint16_t> tokens;
  append_shard(path, tokens);
  return tokens;
}

}  // namespace malleus::data
