// A file read as the text it holds: gzip, xz and zstd files are decompressed as they are read
// (Debian's zlib, liblzma and libzstd), anything else is read as it is. The compression is told
// from the first bytes (the formats' magic numbers), never from the file name.
//
// Concatenated streams (several gzip members, xz streams or zstd frames one after the other, as
// `cat a.gz b.gz` or parallel compressors make) are read as one text. A stream that stops before
// its end (a partial download) or holds corrupt data is an Error naming the file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace malleus::data {

enum class Compression { none, gzip, xz, zstd, unsupported };

// What the first bytes of a file say it is. `unsupported_name` is set for compressed formats
// that are recognised but not read (bzip2, lz4, lzip, zip, 7-Zip, Unix compress).
Compression detect_compression(std::string_view head, std::string* unsupported_name = nullptr);

// "plain", "gzip", "xz", "zstd".
std::string compression_name(Compression compression);

class DecompressingReader {
 public:
  // Opens `path` and reads its first bytes. Throws Error naming the file if it cannot be opened
  // or is compressed in a format not read here (the message names the format).
  explicit DecompressingReader(const std::filesystem::path& path);
  ~DecompressingReader();
  DecompressingReader(const DecompressingReader&) = delete;
  DecompressingReader& operator=(const DecompressingReader&) = delete;

  // Fills `out` with up to `capacity` bytes of text; returns how many, 0 only at the end of the
  // text. Throws Error naming the file for corrupt or truncated compressed data and read errors.
  size_t read(char* out, size_t capacity);

  Compression compression() const { return compression_; }
  // Bytes of the file (compressed, as on disk) consumed so far, and the file's size.
  uint64_t file_bytes_read() const { return file_bytes_read_; }
  uint64_t file_size() const { return file_size_; }

  struct Decoder;  // one per compression (decompress.cpp)

 private:
  bool refill();

  std::string name_;
  std::FILE* file_ = nullptr;
  Compression compression_ = Compression::none;
  std::unique_ptr<Decoder> decoder_;
  std::vector<unsigned char> in_;
  size_t in_begin_ = 0, in_end_ = 0;
  bool file_ended_ = false;
  uint64_t file_bytes_read_ = 0, file_size_ = 0;
};

}  // namespace malleus::data
